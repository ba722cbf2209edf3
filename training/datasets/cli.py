"""``dedloc dataset create|add|get|seed|list|show|retract``: datasets carried by the swarm (options: training/commands.py)."""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import trio

from nat import Peer, PeerConfig
from nat.cli import peer_config, run_peer
from nat.dashboard import Dashboard
from p2p.errors import ConfigError
from p2p.output import Output

from .fetch import FetchConfig
from .manifest import DatasetError, check_name
from .picker import TableConfig
from .service import Datasets, DatasetsConfig, shard_files
from .store import LocalDataset, stored_manifest


def datasets_config(args: argparse.Namespace) -> DatasetsConfig:
    rate = getattr(args, "upload_rate_mbit", None)
    if rate is not None and not (math.isfinite(rate) and rate >= 0):
        raise ConfigError(f"--upload-rate-mbit must be a number of Mbit/s, 0 or more (0: no cap), not {rate}")
    config = DatasetsConfig(piece_size=int(getattr(args, "piece_size_kib", 1024)) * 1024,
                            upload_rate=None if not rate else rate * 1e6 / 8)
    config.validate()
    return config


def fetch_config(args: argparse.Namespace) -> FetchConfig:
    if args.max_seeders < 1:
        raise ConfigError("--max-seeders must be at least 1")
    return FetchConfig(table=TableConfig(max_connected=args.max_seeders, allow_relayed=args.allow_relayed))


async def cmd_dataset(args: argparse.Namespace, out: Output) -> int:
    config = datasets_config(args)
    action = args.dataset_command
    name = getattr(args, "name", None)
    if name is not None:  # a bad name fails before the peer starts, not after it joined
        check_name(name if action == "create" else name.partition("@")[0])  # the others take NAME@CREATOR
    # what is on this disk is checked before the peer starts (create and add repeat it when they run)
    if action == "create":
        shard_files(Path(args.directory))
    elif action == "add":
        for f in args.files:
            if not Path(f).is_file():
                raise DatasetError(f"{f}: no such file")
    elif action == "seed":
        for d in args.directories:
            stored_manifest(Path(d))
    fetch = fetch_config(args) if action == "get" else None
    code = 0

    async def work(peer: Peer, dashboard: Dashboard | None) -> None:
        nonlocal code
        async with Datasets.open(peer, config) as datasets:
            if action == "create":
                await datasets.create(args.name, Path(args.directory), schema=args.schema, text_field=args.text_field)
                await _seed_forever(datasets, out)
            elif action == "add":
                await datasets.add(args.name, [Path(f) for f in args.files], Path(args.dir or args.name))
                await _seed_forever(datasets, out)
            elif action == "get":
                await datasets.get(args.name, Path(args.directory), config=fetch, seed=not args.no_seed)
                if not args.no_seed:
                    await _seed_forever(datasets, out)
            elif action == "seed":
                for directory in args.directories:
                    local = await trio.to_thread.run_sync(LocalDataset.load, Path(directory), datasets.authority)
                    datasets.seed(local)
                await _seed_forever(datasets, out)
            elif action == "list":
                headers = await datasets.headers()
                if not headers:
                    out.info("no datasets in the swarm", datasets=[])
                    code = 1
                rows = sorted(headers, key=lambda h: (h.name, h.created))
                out.info("\n".join(f"{h.label}  {h.schema}  id {h.id.hex()[:16]}  created "
                                   f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(h.created))}" for h in rows),
                         datasets=[{"name": h.name, "id": h.id.hex(), "creator": str(h.creator), "schema": h.schema,
                                    "created": h.created} for h in rows])
            elif action == "show":
                show = await datasets.show(args.name)
                header = show.manifest.header
                shards = show.manifest.shards()
                lines = [f"{header.label}: {len(shards)} shards, {show.manifest.size / (1 << 20):.1f} MiB, "
                         f"{header.schema}, pieces of {header.piece_size // 1024} KiB, id {header.id.hex()}",
                         f"seeders: {len(show.seeders)}; every shard held whole somewhere: "
                         f"{'yes' if show.complete else 'no'}"]
                lines += [f"  {s.path}  {s.size / (1 << 20):.1f} MiB  whole at {show.whole[s.root]}, "
                          f"partly at {show.partial[s.root]}" for s in shards]
                lines += [f"  refused: {what}: {why}" for what, why in show.manifest.refused]
                out.info("\n".join(lines), name=header.name, id=header.id.hex(), creator=str(header.creator),
                         complete=show.complete, seeders=[str(s.peer_id) for s in show.seeders],
                         shards=[{"path": s.path, "size": s.size, "root": s.root.hex(), "whole": show.whole[s.root],
                                  "partial": show.partial[s.root]} for s in shards],
                         entries=[{"id": e.id.hex(), "author": str(e.author), "shards": len(e.shards)}
                                  for e in show.manifest.entries.values()],
                         refused=[list(r) for r in show.manifest.refused])
                code = 0 if show.complete else 1
            elif action == "retract":
                wanted = [t.lower() for t in args.entries]
                for text in wanted:
                    if len(text) < 4 or any(c not in "0123456789abcdef" for c in text):
                        raise ConfigError(f"{text!r} is not an entry id (its hex, or 4 digits of it at least, as "
                                          "`dataset show --json` prints)")
                manifest = await datasets.find(args.name)
                full = [e.id for e in manifest.entries.values() if any(e.id.hex().startswith(t) for t in wanted)]
                if len(full) != len(wanted):
                    raise DatasetError("not every id names one entry of the dataset (`dataset show` lists them)")
                key = None
                if args.authority_dir is not None:  # a closed swarm's authority retracts
                    from p2p.authority import KEY_FILE, load_or_create_key

                    key_file = Path(args.authority_dir) / KEY_FILE
                    if not key_file.exists():
                        raise ConfigError(f"{key_file}: no authority key there")
                    key = load_or_create_key(key_file)
                rid = await datasets.retract(args.name, full, authority_key=key)
                out.info(f"retracted {len(full)} entries (retraction {rid.hex()[:12]})",
                         retracted=[i.hex() for i in full], retraction=rid.hex())

    await run_peer(args, out, config=dataset_peer_config(args), work=work, role="datasets",
                   quiet=action in ONE_SHOT)
    return code


#: The actions that ask and leave: they print their answer alone (not the peer's events).
ONE_SHOT = ("list", "show", "retract")


def dataset_peer_config(args: argparse.Namespace) -> PeerConfig:
    """The peer of a ``dataset`` action: a one-shot one is a client (``--client``: it takes no relay
    slot from a relay and serves no AutoNAT for the seconds it lives), unless the options say otherwise."""
    if args.dataset_command in ONE_SHOT and not (args.no_listen or args.serve_relay):
        args.client = True
    return peer_config(args, relay=False)


async def _seed_forever(datasets: Datasets, out: Output) -> None:
    from .events import Seeding

    while True:
        for held in datasets.held.values():
            h = held.local.manifest.header
            datasets.peer.emit(Seeding(name=h.name, dataset=h.id.hex(), shards=len(held.local.whole),
                                       bytes=held.local.held_bytes, served=held.served))
        await trio.sleep(30.0)
