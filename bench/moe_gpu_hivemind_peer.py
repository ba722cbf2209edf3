"""hivemind.moe 1.1.12's side of bench/moe_gpu.py (runs in .venv-hivemind): the same two roles as
bench/moe_gpu_peer.py.

    python bench/moe_gpu_hivemind_peer.py --serve --device cuda --experts 16 --hidden 1024
    python bench/moe_gpu_hivemind_peer.py --client '<the server's JSON line>' --batch 1024 --callers 4

--serve: hivemind's Server.create with --experts experts of --expert-cls (ffn, nop) of --hidden on
--device (Adam, its default optimizer; max_batch_size --max-batch), its DHT on 127.0.0.1; prints its
peer id and addresses as one JSON line. --client: a client-mode DHT joined to the server,
RemoteExperts for its experts, --callers threads each running forward and backward of --batch rows,
the experts in turn; warm-up, ``{"ready": ...}``, a line on stdin, --seconds of calls,
``{"pairs": ..., "elapsed_s": ...}``.
A call that never returns is not waited for past --seconds + 30 s (RemoteExpert has no timeout).
One JSON line per message on stdout (fd 1 is kept for them; hivemind's logs go to stderr).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_common import call_loop, server_parser  # noqa: E402


def main() -> None:
    p = server_parser()
    args = p.parse_args()  # first: --help needs no hivemind
    stdout = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # hivemind, p2pd and stray prints go to stderr

    import torch
    from hivemind import DHT
    from hivemind.moe.client.expert import create_remote_experts
    from hivemind.moe.expert_uid import ExpertInfo
    from hivemind.moe.server import Server
    from hivemind.p2p import PeerID
    from dht_hivemind_peer import NETWORK_KWARGS

    def say(message: dict[str, object]) -> None:
        print(json.dumps(message), file=stdout, flush=True)

    uids = [f"ffn.0.{j}" for j in range(args.experts)]
    if args.serve:
        torch.manual_seed(0)
        server = Server.create(expert_uids=uids, expert_cls=args.expert_cls, hidden_dim=args.hidden,
                               max_batch_size=args.max_batch, device=args.device, start=True, **NETWORK_KWARGS)
        server.ready.wait(120)
        name = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
        say({"peer_id": server.dht.peer_id.to_base58(), "addrs": [str(a) for a in server.dht.get_visible_maddrs()],
             "device_name": name})
        threading.Event().wait()  # until killed
        return

    torch.set_num_threads(1)
    where = json.loads(args.client)
    dht = DHT(initial_peers=where["addrs"], start=True, client_mode=True, **NETWORK_KWARGS)
    peer = PeerID.from_base58(where["peer_id"])
    experts = create_remote_experts([ExpertInfo(uid, peer) for uid in uids], dht)
    for expert in experts:
        expert(torch.randn(args.batch, args.hidden, requires_grad=True)).sum().backward()
    say({"ready": args.index})
    sys.stdin.readline()
    pairs, failed = [0] * args.callers, [0] * args.callers
    stop_at = time.perf_counter() + args.seconds

    def caller(i: int) -> None:
        x = torch.randn(args.batch, args.hidden, requires_grad=True)
        # any exception: a failed call is counted, as dedloc's side does
        pairs[i], failed[i] = call_loop(lambda turn: experts[turn % len(experts)](x).sum().backward(),
                                        args.index * args.callers + i, stop_at, (Exception,))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=caller, args=(i,), daemon=True) for i in range(args.callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, stop_at + 30 - time.perf_counter()))
    stuck = sum(t.is_alive() for t in threads)
    say({"pairs": sum(pairs), "failed": sum(failed) + stuck, "elapsed_s": time.perf_counter() - t0 if not stuck
         else args.seconds})
    os._exit(0)  # hivemind's background processes: the result is out


if __name__ == "__main__":
    main()
