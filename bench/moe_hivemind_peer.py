"""hivemind.moe 1.1.12's side of bench/moe.py (runs in .venv-hivemind): the same three parts as bench/moe_peer.py.

    .venv-hivemind/bin/python bench/moe_hivemind_peer.py --experts 64 [--servers 20] [--dead 0.1] ...

1. Search: --servers hivemind DHT nodes declare --experts experts (hivemind's declare_experts), those
   of --dead of them then shut down; a client DHT runs MoEBeamSearcher.batch_find_best_experts
   (batch 16, beam 4, random scores): cold (a new searcher each time, on a client DHT with
   cache_locally=False) and warm (one searcher, a client with hivemind's defaults). Negative caching
   is off: with it on (the default), batch_find_best_experts raises TypeError in 1.1.12 (it adds
   None to a float: _get_active_successors is called without cache_expiration).
2. Calls: hivemind's Server with 4 --expert-cls experts of --hidden; --callers threads run forward and
   backward of --batch rows through RemoteExpert for --seconds.
3. Faults: a call to a server shut down in the middle of it (RemoteExpert has no timeout of its own:
   the time it takes to fail, capped at 10 s, is what is reported).

Everything listens on 127.0.0.1 only (bench/dht_hivemind_peer.py's NETWORK_KWARGS). One JSON line on
stdout (fd 1 is kept for it; hivemind's logs go to stderr).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_common import assignment, parser, percentile, search_figures  # noqa: E402


def main() -> None:
    args = parser().parse_args()  # first: --help needs no hivemind (tests/test_bench_smoke.py runs it from .venv)
    stdout = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # hivemind, p2pd and stray prints go to stderr

    import torch
    from hivemind import DHT
    from hivemind.moe.client.beam_search import MoEBeamSearcher
    from hivemind.moe.client.expert import create_remote_experts
    from hivemind.moe.expert_uid import ExpertInfo
    from hivemind.moe.server import Server
    from hivemind.moe.server.dht_handler import declare_experts
    from hivemind.utils.timed_storage import get_dht_time
    from dht_hivemind_peer import NETWORK_KWARGS

    torch.set_num_threads(1)
    side, plan = assignment(args)
    result: dict[str, object] = {"experts": side * side, "servers": len(plan),
                                 "dead_experts": sum(len(c) for dead, c in plan if dead)}
    setup = time.perf_counter()
    boot = DHT(start=True, **NETWORK_KWARGS)
    initial = [str(a) for a in boot.get_visible_maddrs()]
    dhts = []
    for dead, coords in plan:
        dht = DHT(initial_peers=initial, start=True, **NETWORK_KWARGS)
        declare_experts(dht, [f"ffn.{i}.{j}" for i, j in coords], expiration_time=get_dht_time() + 900)
        dhts.append((dead, dht))
    for dead, dht in dhts:
        if dead:
            dht.shutdown()
    time.sleep(1.0)
    result["setup_s"] = time.perf_counter() - setup
    client = DHT(initial_peers=initial, start=True, client_mode=True, **NETWORK_KWARGS)
    gen = torch.Generator().manual_seed(1)

    def timed(searcher: MoEBeamSearcher) -> tuple[float, int]:
        scores = [torch.randn(16, side, generator=gen).numpy(), torch.randn(16, side, generator=gen).numpy()]
        t0 = time.perf_counter()
        found = searcher.batch_find_best_experts(scores, beam_size=4)
        return (time.perf_counter() - t0) * 1e3, sum(len(f) for f in found)

    # cold: a client DHT that keeps no copies of what it read, and a new searcher each time
    cold_client = DHT(initial_peers=initial, start=True, client_mode=True, cache_locally=False, **NETWORK_KWARGS)
    cold, warm, found = [], [], []
    timed(MoEBeamSearcher(cold_client, "ffn.", (side, side), negative_caching=False))  # its connections
    for _ in range(args.searches):
        ms, n = timed(MoEBeamSearcher(cold_client, "ffn.", (side, side), negative_caching=False))
        cold.append(ms)
        found.append(n)
    searcher = MoEBeamSearcher(client, "ffn.", (side, side), negative_caching=False)
    timed(searcher)
    for _ in range(args.searches):
        warm.append(timed(searcher)[0])
    result["search"] = search_figures(cold, warm, found)
    result["search_p99_ms"] = percentile(cold, 99)

    # ---- calls per second: hivemind's Server with 4 ffn experts
    server = Server.create(expert_uids=[f"calls.0.{j}" for j in range(4)], expert_cls=args.expert_cls, hidden_dim=args.hidden,
                           initial_peers=initial, start=True, device="cpu", **NETWORK_KWARGS)
    server.ready.wait(60)
    infos = [ExpertInfo(f"calls.0.{j}", server.dht.peer_id) for j in range(4)]
    experts = create_remote_experts(infos, client)
    steps = [0] * args.callers
    for e in experts:
        e(torch.randn(2, args.hidden))
    stop_at = time.perf_counter() + args.seconds
    t0 = time.perf_counter()

    def caller(i: int) -> None:
        x = torch.randn(args.batch, args.hidden, requires_grad=True)
        while time.perf_counter() < stop_at:
            experts[(i + steps[i]) % 4](x).sum().backward()
            steps[i] += 1

    threads = [threading.Thread(target=caller, args=(i,), daemon=True) for i in range(args.callers)]
    for t in threads:
        t.start()
    for t in threads:  # a RemoteExpert call has no timeout: one that never returns is counted, not waited for
        t.join(max(0.0, stop_at + 30 - time.perf_counter()))
    elapsed = time.perf_counter() - t0 if not any(t.is_alive() for t in threads) else args.seconds
    total = sum(steps)
    result["calls"] = {"forward_backward_per_s": total / elapsed, "calls_per_s": 2 * total / elapsed,
                       "samples_per_s": total * args.batch / elapsed,
                       "callers_stuck_30s_past_the_end": sum(t.is_alive() for t in threads)}
    result["calls_per_s"] = 2 * total / elapsed

    # ---- a server shut down in the middle of a call (hivemind's nop_delay expert: 0.5 s per batch)
    server.shutdown()
    slow = Server.create(expert_uids=["slow.0.0"], expert_cls="nop_delay", hidden_dim=args.hidden,
                         initial_peers=initial, start=True, device="cpu", **NETWORK_KWARGS)
    slow.ready.wait(60)
    (doomed,) = create_remote_experts([ExpertInfo("slow.0.0", slow.dht.peer_id)], client)
    doomed(torch.randn(2, args.hidden))
    outcome: dict[str, object] = {}

    def doomed_call() -> None:
        t = time.perf_counter()
        try:
            doomed(torch.randn(2, args.hidden))
            outcome["result"] = "answered"
        except Exception as e:  # noqa: BLE001 (what it raises is what is measured)
            outcome["result"] = f"{type(e).__name__}"
        outcome["s"] = time.perf_counter() - t

    t = threading.Thread(target=doomed_call, daemon=True)
    t.start()
    time.sleep(0.2)
    threading.Thread(target=slow.shutdown, daemon=True).start()
    t.join(10.0)
    result["faults"] = {"killed_mid_call": outcome.get("result", "still waiting after 10 s"),
                        "ended_after_s": outcome.get("s", 10.0)}
    print(json.dumps(result), file=stdout, flush=True)
    os._exit(0)  # hivemind's background processes: the result is out


if __name__ == "__main__":
    main()
