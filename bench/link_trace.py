"""Read a link trace of bench/averaging.py --link-trace: each host's upload/download in Mbit/s over time.

    python bench/link_trace.py /tmp/dedloc-bench-averaging/dedloc-homogeneous-links.txt [--min-mbit 20]

One line per sample interval (~70 ms) in which the links together moved at
least --min-mbit: the time since the first sample and, per host, up/down.
The idle stretches between rounds are left out; a stretch where a round ran
but a link idled shows as a column of small numbers. Stdlib only.
"""

from __future__ import annotations

import argparse
import ipaddress


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--min-mbit", type=float, default=20.0)
    args = parser.parse_args()
    hosts: dict[str, str] = {}
    nets: dict[str, ipaddress.IPv4Network] = {}
    samples: list[tuple[float, dict[str, tuple[int, int]]]] = []
    with open(args.trace) as f:
        for line in f:
            kind, _, rest = line.rstrip("\n").partition(" ")
            if kind == "H":
                hosts = dict(item.split("=", 1) for item in rest.split())
            elif kind == "A":
                parts = rest.split()  # "5: l1    inet 198.18.1.1/24 ..."
                if len(parts) >= 4 and parts[2] == "inet":
                    nets[parts[1]] = ipaddress.ip_interface(parts[3]).network
            elif kind == "T":
                samples.append((float(rest), {}))
            elif kind == "S" and samples:
                name, rx, tx = rest.split()
                samples[-1][1][name] = (int(rx), int(tx))
    names = {ifname: next((h for h, ip in hosts.items() if ipaddress.ip_address(ip) in net), ifname)
             for ifname, net in nets.items()}
    links = sorted(names, key=lambda i: names[i])
    samples = [s for s in samples if all(i in s[1] for i in links)]
    if not samples:
        raise SystemExit("no complete samples in the trace")
    print("time s  " + "  ".join(f"{names[i]:>11}" for i in links) + "   (host up/down, Mbit/s)")
    t0 = samples[0][0]
    for (ta, a), (tb, b) in zip(samples, samples[1:]):
        dt = tb - ta
        rates = [((b[i][0] - a[i][0]) * 8 / dt / 1e6, (b[i][1] - a[i][1]) * 8 / dt / 1e6) for i in links]
        if sum(up for up, _ in rates) >= args.min_mbit:
            print(f"{tb - t0:7.2f}  " + "  ".join(f"{up:5.0f}/{down:<5.0f}" for up, down in rates))


if __name__ == "__main__":
    main()
