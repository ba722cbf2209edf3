"""``dedloc dht``: one store or get against a running swarm (its options: p2p/commands.py, which also holds
``id`` and the dispatcher every layer's commands go through; what commands print: p2p/output.py).
"""

from __future__ import annotations

import argparse
import time

from .config import NodeConfig
from .dht import DHT, DHTConfig, DHTMode
from .node import Node
from .output import Output


async def cmd_dht(args: argparse.Namespace, out: Output) -> int:
    """One store or get against a running swarm, as a short-lived DHT client."""
    config = NodeConfig(listen=args.listen or ["/ip4/0.0.0.0/tcp/0"], initial_peers=args.initial_peers,
                        dial_timeout=args.timeout, bootstrap_timeout=args.timeout)
    async with Node.open(config) as node:
        async with DHT.open(node, DHTConfig(mode=DHTMode.CLIENT, bootstrap_timeout=args.timeout)) as dht:
            if args.dht_command == "store":
                expiration = time.time() + args.ttl
                ok = await dht.store(args.key, args.value.encode(), expiration, subkey=args.subkey, timeout=args.timeout)
                out.info(f"stored {args.key!r} until {_when(expiration)}" if ok else
                         f"not stored: no replica took {args.key!r} (unreachable, or it holds a newer value)",
                         key=args.key, stored=ok, expiration=expiration)
                return 0 if ok else 1
            found = await dht.get(args.key, latest=args.latest, timeout=args.timeout)
    if found is None:
        out.info(f"{args.key!r}: not found", key=args.key, found=False)
        return 1
    if isinstance(found.value, bytes):
        out.info(f"{_text(found.value)}  (expires {_when(found.expiration)})", key=args.key, found=True,
                 value=_text(found.value), expiration=found.expiration)
    else:
        entries = {_text(sub) if isinstance(sub, bytes) else str(sub):
                   {"value": _text(v.value) if isinstance(v.value, bytes) else None, "expiration": v.expiration}
                   for sub, v in found.value.items()}
        lines = [f"{sub}: {e['value']}  (expires {_when(float(e['expiration'] or 0))})" for sub, e in entries.items()]
        out.info("\n".join(lines) or "(no subkeys)", key=args.key, found=True, subkeys=entries)
    return 0


def _text(value: bytes) -> str:
    """Values are bytes: show them as text when they are UTF-8, else as hex."""
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return "0x" + value.hex()


def _when(expiration: float) -> str:
    return f"{time.strftime('%H:%M:%S', time.localtime(expiration))}, in {expiration - time.time():.0f}s"


# ---------------------------------------------------------------------- parser


async def cmd_authority(args: argparse.Namespace, out: Output) -> int:
    """``dedloc authority add|revoke|show``: the allowlist and key of a closed run (p2p/authority.py)."""
    import json

    from .authority import ALLOWLIST_FILE, KEY_FILE, AllowList, load_or_create_key

    key = load_or_create_key(args.dir / KEY_FILE)
    authority = bytes(key.verify_key).hex()
    allowlist = AllowList.load(args.dir / ALLOWLIST_FILE)
    result: dict[str, object] = {"authority": authority}
    if args.authority_command == "add":
        secret = allowlist.add(args.username)
        allowlist.save()
        result.update(username=args.username, secret=secret.hex())
    elif args.authority_command == "revoke":
        allowlist.revoke(args.username)
        allowlist.save()
        result.update(revoked=args.username)
    else:
        result["users"] = {u: "revoked" if e.get("revoked") else "allowed" for u, e in sorted(allowlist.users.items())}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"authority key: {authority}")
    if args.authority_command == "add":
        print(f"added {args.username}; their secret (shown once, give it to them):\n  {result['secret']}")
        print(f"they join with:\n  echo {result['secret']} > {args.username}.secret\n"
              f"  dedloc peer --initial-peers <relay address> --authority {authority} "
              f"--username {args.username} --secret-file {args.username}.secret")
    elif args.authority_command == "revoke":
        print(f"revoked {args.username}: their pass is not renewed (out within 15 min; at once on the authority's node)")
    else:
        for user, state in dict(result["users"]).items():  # type: ignore[call-overload]
            print(f"  {user}: {state}")
    return 0
