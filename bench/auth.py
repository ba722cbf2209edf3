"""What allowlist authentication costs: dedloc (a pass checked once per connection, p2p/auth.py) against
hivemind 1.1.12 (RSA-2048 signatures on every request and response, hivemind/utils/auth.py).

    .venv/bin/python bench/auth.py [--connections 30] [--requests 300] [--json OUT]

On loopback, one machine, one run:

* dedloc, per connection: a fresh node connects to a member and pings it, with and without an
  authenticated run (the difference is the Hello exchange: one round trip and one Ed25519
  verification each way); and ``verify_pass`` alone.
* dedloc, per request: RPC round trips on an open connection, with and without authentication
  (nothing is signed per request: the Noise session already authenticates every byte).
* hivemind, per request: ``sign_request``, ``validate_request``, ``sign_response``,
  ``validate_response`` around a DHT ping (``bench/auth_hivemind_peer.py`` in ``.venv-hivemind``,
  made by bench/setup_hivemind.sh): the CPU its authorizer adds to every call.

Reports min / median of each and the ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nacl.signing import SigningKey  # noqa: E402

from harness import HIVEMIND_PYTHON  # noqa: E402
from p2p.auth import AuthConfig, Authenticator, verify_pass  # noqa: E402
from p2p.authority import AllowList, Authority, SecretCheck  # noqa: E402
from p2p.config import NodeConfig  # noqa: E402
from p2p.node import Node  # noqa: E402
from p2p.proto import auth_pb2 as pb  # noqa: E402

HIVEMIND_PY = HIVEMIND_PYTHON


def stats(values: list[float]) -> dict[str, float]:
    return {"min_ms": min(values) * 1e3, "median_ms": statistics.median(values) * 1e3, "n": len(values)}


async def measure(connections: int, requests: int, authority: Authority | None) -> dict[str, dict[str, float]]:
    config = NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"])

    def auth(node: Node) -> Authenticator | None:
        if authority is None:
            return None
        return Authenticator(node, AuthConfig(authority=authority.public_key),
                             authority.sign("bench", node.peer_id, time.time()))

    async with Node.open(config) as server:
        a = auth(server)
        registration = server.authenticate(a) if a is not None else None

        async def echo(request: pb.Challenge, ctx: object) -> pb.Challenge:
            return request

        server.rpc.add_unary("bench.echo", pb.Challenge, echo)  # type: ignore[arg-type]
        connect: list[float] = []
        for _ in range(connections):
            async with Node.open(config) as client:
                c = auth(client)
                with client.authenticate(c) if c is not None else contextlib.nullcontext():
                    started = time.perf_counter()
                    await client.connect(str(server.addrs[0]))
                    await client.ping(server.peer_id, timeout=10)
                    connect.append(time.perf_counter() - started)
        async with Node.open(config) as client:
            c = auth(client)
            with client.authenticate(c) if c is not None else contextlib.nullcontext():
                await client.connect(str(server.addrs[0]))
                call: list[float] = []
                for i in range(requests + 10):
                    started = time.perf_counter()
                    await client.rpc.call(server.peer_id, "bench.echo", pb.Challenge(nonce=b"x" * 32), pb.Challenge,
                                          timeout=10)
                    if i >= 10:
                        call.append(time.perf_counter() - started)
        if registration is not None:
            registration.remove()
    return {"connect_and_ping": stats(connect), "request": stats(call)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connections", type=int, default=30)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    authority = Authority(SigningKey.generate(), SecretCheck(AllowList(Path("/nonexistent"))))
    out: dict[str, object] = {}
    out["open"] = trio.run(measure, args.connections, args.requests, None)
    out["authenticated"] = trio.run(measure, args.connections, args.requests, authority)
    from p2p.identity import new_identity, peer_id_of

    peer = peer_id_of(new_identity())
    access: pb.AccessPass = authority.sign("bench", peer, time.time())
    config = AuthConfig(authority=authority.public_key)
    verify = []
    for _ in range(2000):
        started = time.perf_counter()
        verify_pass(access, config, peer, time.time())
        verify.append(time.perf_counter() - started)
    out["verify_pass"] = stats(verify)
    if HIVEMIND_PY.exists():
        result = subprocess.run([str(HIVEMIND_PY), str(ROOT / "bench" / "auth_hivemind_peer.py"), str(args.requests)],
                                capture_output=True, text=True, check=True, timeout=600)
        out["hivemind_per_request"] = json.loads(result.stdout.strip().splitlines()[-1])
    o, a = out["open"], out["authenticated"]
    assert isinstance(o, dict) and isinstance(a, dict)
    per_connection = a["connect_and_ping"]["median_ms"] - o["connect_and_ping"]["median_ms"]
    per_request = a["request"]["median_ms"] - o["request"]["median_ms"]
    print(f"dedloc connect+ping: open {o['connect_and_ping']['median_ms']:.2f} ms, authenticated "
          f"{a['connect_and_ping']['median_ms']:.2f} ms (median of {args.connections}): +{per_connection:.2f} ms "
          f"per connection")
    print(f"dedloc RPC round trip: open {o['request']['median_ms']:.3f} ms, authenticated "
          f"{a['request']['median_ms']:.3f} ms (median of {args.requests}): {per_request:+.3f} ms per request")
    print(f"dedloc verify_pass: min {out['verify_pass']['min_ms'] * 1e3:.0f} us, "  # type: ignore[index]
          f"median {out['verify_pass']['median_ms'] * 1e3:.0f} us")  # type: ignore[index]
    hm = out.get("hivemind_per_request")
    if isinstance(hm, dict):
        print(f"hivemind 1.1.12 auth CPU per request (RSA-2048 sign + verify, both ways): min {hm['min_ms']:.3f} ms, "
              f"median {hm['median_ms']:.3f} ms")
        requests_to_break_even = per_connection / hm["median_ms"] if hm["median_ms"] > 0 else float("inf")
        print(f"dedloc's per-connection cost equals hivemind's cost of {requests_to_break_even:.1f} requests; "
              f"every request after that on the connection costs dedloc nothing extra")
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
