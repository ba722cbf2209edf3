"""How long a peer behind each kind of NAT waits for the NAT layer's reachability verdict.

    sudo .venv/bin/python bench/nat_verdict.py [--rounds 2] [--json FILE]

In the NAT lab (``nat/lab.py``: network namespaces, root): two public relays (``dedloc relay``), three
public peers (AutoNAT servers, 10 ms away) and five peers behind NATs (two symmetric, two
endpoint-independent that change the port, one that keeps it; 50 ms away), each a ``tests/nat_agent.py``
process, as ``dedloc peer`` runs. Each NATed peer bootstraps through both relays, then connects to the
three public peers, as a trainer meets its swarm; the time from its start to its verdict (``private``
for all of them) is printed per NAT kind, min and median over the rounds.

Why it matters: the averager declares no role before the verdict (a peer that might be public must
not declare itself a sender), so a trainer that waits for it misses the swarm's steps. A dial-back to
an address behind a NAT times out (the NAT drops the SYN; 10 s, go-libp2p's figure too), so the
verdict costs as many timeouts as requests the peer makes one after the other.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nat.lab import Lab, NatKind, netns_unavailable_reason  # noqa: E402
from tests.test_nat_matrix import PORT, PUBLIC_NET, Agent, start_agent, start_relay  # noqa: E402

KINDS = [NatKind.SYMMETRIC, NatKind.EIM_CHANGING, NatKind.EIM_PRESERVING, NatKind.SYMMETRIC, NatKind.EIM_CHANGING]
#: Longest one peer may wait for its verdict.
LIMIT = 90.0


async def one_round(results: dict[str, list[float | None]]) -> None:
    async with Lab(prefix="dnv", public_net=PUBLIC_NET) as lab:
        _, relay1 = await start_relay(lab)
        _, relay2 = await start_relay(lab, "relay2")
        public: list[tuple[Agent, list[str]]] = []
        nated: list[tuple[NatKind, Agent, float]] = []
        try:
            for i in range(3):
                agent = await start_agent(await lab.peer(f"p{i}", NatKind.PUBLIC, listen_port=PORT, delay_ms=10),
                                          [relay1, relay2])
                public.append((agent, (await agent.ask("wait_mode", timeout=30))["addrs"]))
            for i, kind in enumerate(KINDS):
                host = await lab.peer(f"n{i}", kind, listen_port=PORT, delay_ms=50)
                nated.append((kind, await start_agent(host, [relay1, relay2]), time.monotonic()))

            async def follow(kind: NatKind, agent: Agent, started: float) -> None:
                for _, addrs in public:
                    await agent.ask("connect", addrs=addrs, timeout=20)
                while time.monotonic() - started < LIMIT:
                    if (await agent.ask("state"))["reachability"] != "unknown":
                        results[kind.name].append(time.monotonic() - started)
                        return
                    await trio.sleep(0.25)
                results[kind.name].append(None)

            async with trio.open_nursery() as nursery:
                for kind, agent, started in nated:
                    nursery.start_soon(follow, kind, agent, started)
        finally:
            for agent in [a for _, a, _ in nated] + [a for a, _ in public]:
                await agent.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the figures there")
    args = parser.parse_args()
    if (why := netns_unavailable_reason()) is not None:
        sys.exit(f"nat_verdict: needs the NAT lab ({why})")
    results: dict[str, list[float | None]] = {k.name: [] for k in KINDS}
    for _ in range(args.rounds):
        trio.run(one_round, results)
    summary = {}
    for kind, times in results.items():
        done = sorted(t for t in times if t is not None)
        summary[kind] = {"peers": len(times), "no_verdict": len(times) - len(done),
                         "min_s": round(done[0], 1) if done else None,
                         "median_s": round(statistics.median(done), 1) if done else None}
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    for kind, row in summary.items():
        print(f"{kind:<16} {row['peers']} peers: verdict after min {row['min_s']} s, median {row['median_s']} s"
              + (f", {row['no_verdict']} without one after {LIMIT:g} s" if row["no_verdict"] else ""))


if __name__ == "__main__":
    main()
