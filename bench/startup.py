"""How fast `dedloc` starts and how little an idle relay holds (issue "What operators and volunteers see").

    .venv/bin/python bench/startup.py [--repeats 5] [--json]

Times, each a whole fresh process (interpreter start included), min / median of --repeats:
`dedloc --help`, `dedloc id` (an existing identity), and `dedloc ping -c 1` to a `dedloc relay` on
127.0.0.1; then the relay's resident memory once idle. Goals on the 2-core machine: --help and id
<= 0.5 s, the ping <= 1.0 s whole, the idle relay <= 100 MiB. Nothing leaves 127.0.0.1.

Python caches compiled modules (``__pycache__``); an installed wheel has them from pip's install and
a checkout writes them on its first run. ``--bytecode cached`` (the default) measures that case: it
clears ``PYTHONDONTWRITEBYTECODE`` for the commands and runs each once untimed first. ``as-is`` keeps
the environment: where it sets ``PYTHONDONTWRITEBYTECODE=1`` (this sandbox does) and the checkout
has no cache, every start compiles dedloc's own modules again (~0.1-0.2 s more).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEDLOC = [sys.executable, "-m", "training.commands"]


def timed(argv: list[str], env: dict[str, str], repeats: int, warm: bool) -> dict[str, float]:
    if warm:
        subprocess.run([*DEDLOC, *argv], cwd=ROOT, env=env, check=True, capture_output=True, timeout=60)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([*DEDLOC, *argv], cwd=ROOT, env=env, check=True, capture_output=True, timeout=60)
        times.append(time.perf_counter() - start)
    return {"min_s": min(times), "median_s": statistics.median(times)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")
    p.add_argument("--bytecode", choices=("cached", "as-is"), default="cached")
    args = p.parse_args()
    warm = args.bytecode == "cached"
    with tempfile.TemporaryDirectory() as home:
        env = {**os.environ, "XDG_CONFIG_HOME": home}
        if warm:
            env.pop("PYTHONDONTWRITEBYTECODE", None)
        subprocess.run([*DEDLOC, "id"], cwd=ROOT, env=env, check=True, capture_output=True, timeout=60)
        results: dict[str, object] = {"bytecode": args.bytecode, "help": timed(["--help"], env, args.repeats, warm),
                                      "id": timed(["id"], env, args.repeats, warm)}
        relay = subprocess.Popen([*DEDLOC, "relay", "--listen", "/ip4/127.0.0.1/tcp/0", "--ephemeral", "--json",
                                  "--status-interval", "0"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, text=True)
        try:
            assert relay.stdout is not None
            address = json.loads(relay.stdout.readline())["addrs"][0]
            time.sleep(2.0)
            status = Path(f"/proc/{relay.pid}/status").read_text()
            results["relay_rss_mib"] = int(next(x for x in status.splitlines()
                                                if x.startswith("VmRSS:")).split()[1]) / 1024
            results["ping"] = timed(["ping", "-c", "1", address], env, args.repeats, warm)
        finally:
            relay.terminate()
            relay.wait(timeout=20)
    if args.json:
        print(json.dumps(results))
        return
    print(f"bytecode: {args.bytecode}")
    for name in ("help", "id", "ping"):
        r = results[name]
        assert isinstance(r, dict)
        print(f"dedloc {name:<5} min {r['min_s']:.2f} s, median {r['median_s']:.2f} s")
    print(f"idle relay: {results['relay_rss_mib']:.0f} MiB resident")


if __name__ == "__main__":
    main()
