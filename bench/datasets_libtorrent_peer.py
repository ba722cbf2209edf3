"""One libtorrent peer per process for bench/datasets.py (runs in .venv-libtorrent: bench/setup_libtorrent.sh).

    .venv-libtorrent/bin/python bench/datasets_libtorrent_peer.py --listen IP --port PORT

The comparison peer: libtorrent-rasterbar 2.1.1's Python binding with its defaults, except what the lab
needs: no DHT, local discovery, UPnP or NAT-PMP (nothing to find and no router to ask: peers learn each
other from the driver, as a tracker would tell them, and from each other by peer exchange), and
listening on the lab address. The protocol is bench/datasets_peer.py's:

  stdout, once:  {"ready": true, "peer_id": "ip:port", "addrs": ["ip:port"]}
  stdin, lines:  {"op": "seed", "name": N, "dir": D, "torrent": FILE}   make FILE from D (if absent), seed D
                 {"op": "get", "name": N, "dir": D, "torrent": FILE, "peers": [[ip, port], ...]}
                 {"op": "peers", "peers": [[ip, port], ...]}             connect to these (a tracker's answer)
                 {"op": "quit"}
  stdout, lines: {"op": "seeding", "seconds": T} / {"op": "progress", ...} / {"op": "done", "seconds": T, "bytes": B}
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
import time
from pathlib import Path
from typing import Any

try:
    import libtorrent as lt
except ImportError:  # the project's venv: only --help works (the bench runs this in .venv-libtorrent)
    lt = None


def say(**message: Any) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def session(ip: str, port: int) -> Any:
    return lt.session({
        "listen_interfaces": f"{ip}:{port}",
        "enable_dht": False,
        "enable_lsd": False,
        "enable_upnp": False,
        "enable_natpmp": False,
        "alert_mask": lt.alert.category_t.status_notification | lt.alert.category_t.error_notification,
    })


def make_torrent(directory: Path, torrent: Path, piece_size: int) -> None:
    fs = lt.file_storage()
    lt.add_files(fs, str(directory))
    t = lt.create_torrent(fs, piece_size)
    lt.set_piece_hashes(t, str(directory.parent))
    tmp = torrent.with_suffix(".partial")
    tmp.write_bytes(lt.bencode(t.generate()))
    os.replace(tmp, torrent)


def main(args: argparse.Namespace) -> None:
    ses = session(args.listen, args.port)
    say(ready=True, peer_id=f"{args.listen}:{args.port}", addrs=[f"{args.listen}:{args.port}"])
    handle: Any = None
    started = 0.0
    mode = ""
    last = 0.0
    buffer = b""
    while True:
        ready, _, _ = select.select([0], [], [], 0.2)
        if ready:
            data = os.read(0, 65536)
            if not data:
                return
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                if not line.strip():
                    continue
                cmd = json.loads(line)
                if cmd["op"] == "quit":
                    return
                if cmd["op"] == "peers" and handle is not None:
                    for ip, port in cmd["peers"]:
                        handle.connect_peer((ip, int(port)))
                    continue
                started = time.monotonic()
                directory, torrent = Path(cmd["dir"]), Path(cmd["torrent"])
                if cmd["op"] == "seed" and not torrent.exists():
                    make_torrent(directory, torrent, args.piece_kib * 1024)
                atp = lt.add_torrent_params()
                atp.ti = lt.torrent_info(str(torrent))
                atp.save_path = str(directory.parent)
                handle = ses.add_torrent(atp)
                for ip, port in cmd.get("peers", []):
                    handle.connect_peer((ip, int(port)))
                mode = cmd["op"]
        for _ in ses.pop_alerts():
            pass
        if handle is None or not mode:
            continue
        status = handle.status()
        now = time.monotonic()
        if mode == "get" and now - last >= 1.0:
            last = now
            say(op="progress", held=status.total_wanted_done, t=now - started, peers=status.num_peers)
        if status.is_seeding:
            if mode == "seed":
                say(op="seeding", seconds=now - started)
            else:
                say(op="done", seconds=now - started, bytes=status.total_payload_download,
                    redundant=status.total_redundant_bytes, failed=status.total_failed_bytes)
            mode = ""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--listen", required=True, help="the lab address to listen on")
    p.add_argument("--port", type=int, default=6881)
    p.add_argument("--piece-kib", type=int, default=1024)
    return p


if __name__ == "__main__":
    args = parser().parse_args()
    if lt is None:
        sys.exit("datasets_libtorrent_peer.py: no libtorrent here: run it with .venv-libtorrent/bin/python "
                 "(bench/setup_libtorrent.sh)")
    main(args)
