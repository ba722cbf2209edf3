"""What a peer that has left costs its relay: CONNECTs asked for it, with the dial backoff and without.

    .venv/bin/python bench/departed_peer.py [--seconds 30] [--every 2] [--json]

A relay, a peer reachable only through its slot there (``listen=[]``, as ``dedloc peer --no-listen``)
and a caller that knows its circuit address, all on loopback. The peer leaves; the caller goes on
wanting it every ``--every`` seconds for ``--seconds`` (as a dataset fetcher did while the tracker
still listed a seeder that had left), first with the Node's dial backoff (``p2p/dial_backoff.py``:
go-libp2p's 5 s growing by 1 s x tries squared), then with it off. Printed: the CONNECTs the relay
refused for want of a reservation, and how long the caller's failed attempts took.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from contextlib import AsyncExitStack
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nat import NatConfig, NatService  # noqa: E402
from nat.port_mapping import PortMappingConfig  # noqa: E402
from p2p import DialError, Node, NodeConfig  # noqa: E402
from p2p.addresses import is_relayed  # noqa: E402
from p2p.dial_backoff import BackoffConfig  # noqa: E402

NO_BACKOFF = BackoffConfig(base=0.0, coef=0.0, max=0.0)


def _nat(**overrides: object) -> NatConfig:
    return NatConfig(port_mapping=PortMappingConfig(enabled=False), **overrides)  # type: ignore[arg-type]


async def one_run(seconds: float, every: float, backoff: BackoffConfig) -> dict[str, float]:
    listen = ["/ip4/127.0.0.1/tcp/0"]
    async with AsyncExitStack() as stack:
        relay = await stack.enter_async_context(Node.open(NodeConfig(listen=listen)))
        relay_nat = await stack.enter_async_context(NatService.attach(relay, _nat(relay_service=True)))
        caller = await stack.enter_async_context(Node.open(NodeConfig(listen=listen, dial_backoff=backoff)))
        await stack.enter_async_context(NatService.attach(caller, _nat()))
        circuit = None
        async with Node.open(NodeConfig(listen=[])) as peer, NatService.attach(peer, _nat()):
            await peer.connect(relay.addrs[0])
            with trio.fail_after(30):
                while not (circuit := [a for a in peer.addrs if is_relayed(a)]):
                    await trio.sleep(0.05)
            await caller.connect(circuit)  # the caller reached it once, through the relay
            gone = peer.peer_id
        with trio.fail_after(30):
            while caller.has_connection(gone):
                await trio.sleep(0.05)
        assert relay_nat.relay_service is not None
        before = relay_nat.relay_service.stats.refused["no reservation"]
        took: list[float] = []
        deadline = trio.current_time() + seconds
        while trio.current_time() < deadline:
            started = trio.current_time()
            try:
                await caller.connect(gone, timeout=5)
            except DialError:
                took.append(trio.current_time() - started)
            await trio.sleep(every)
        return {"attempts": len(took),
                "connects_at_relay": relay_nat.relay_service.stats.refused["no reservation"] - before,
                "failure_ms_median": 1000 * statistics.median(took) if took else 0.0}


async def measure(seconds: float, every: float) -> dict[str, object]:
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    on = await one_run(seconds, every, BackoffConfig())
    off = await one_run(seconds, every, NO_BACKOFF)
    return {"seconds": seconds, "every": every, "backoff": on, "no_backoff": off,
            "ratio_connects": on["connects_at_relay"] / max(1.0, off["connects_at_relay"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="how long the caller goes on wanting the peer")
    parser.add_argument("--every", type=float, default=2.0, help="seconds between its attempts")
    parser.add_argument("--json", action="store_true", help="one JSON line")
    args = parser.parse_args()
    figures = trio.run(measure, args.seconds, args.every)
    if args.json:
        print(json.dumps(figures))
        return
    for label in ("backoff", "no_backoff"):
        row = figures[label]
        assert isinstance(row, dict)
        print(f"{label:>10}: {row['attempts']} attempts in {args.seconds:g} s, {row['connects_at_relay']} CONNECTs "
              f"at the relay, a failure in {row['failure_ms_median']:.1f} ms (median)")
    print(f"CONNECTs with the backoff / without: {figures['ratio_connects']:.2f}")


if __name__ == "__main__":
    main()
