"""The run as the backbone keeps it (:class:`Monitor`): the learning curve and what each volunteer contributed.

``dedloc backbone`` (``training/cli.py``) feeds it the tracker's reads and the
run's datasets, and serves :meth:`Monitor.page` on the live page. The credit is
``training/contributions.py``'s (pure); this module is its files: ``curve.jsonl``
and ``contributions.json`` under the checkpoint directory, each taken up again
when a backbone starts where another left.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from libp2p.peer.id import ID

from p2p.errors import DedlocError

from .contributions import Contributions, DataContributions, board_from_json, carried
from .progress import ProgressTracker

if TYPE_CHECKING:
    from .datasets import Datasets
    from .datasets.manifest import Manifest

log = logging.getLogger(__name__)


class Monitor:
    """The run as the backbone keeps it: the learning curve and each peer's contributions.

    A trainer's contribution to a step is the most samples it reported toward
    that step, credited only as far as the time the backbone watched makes
    plausible (``training/contributions.py``: no faster than a few times the
    swarm's median peer). An auxiliary peer brings no samples: what it gives is
    its share of the reduction, credited as the steps it reported itself present
    at. Written as JSON files that a page or a metrics exporter can read:
    ``curve.jsonl`` (a line per global step) and ``contributions.json`` (peer id
    -> ``{"samples": credited, "claimed": n, "auxiliary_steps": k}``, and
    ``"username"`` in a closed run).

    A backbone started on a directory another one left takes up what it left
    (:meth:`_take_up`): the curve goes on where it stopped and the leaderboard
    adds to the one it saved, as a restart wiped every volunteer's credit before.
    """

    #: Points of the learning curve kept in memory for the live page (the file keeps them all).
    MAX_CURVE = 5000

    def __init__(self, directory: Path, target: int = 1 << 30) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.credits = Contributions(target)
        self.last_step = -1
        self.curve: list[dict[str, Any]] = []
        #: The last checkpoint saved: ``{"step": n, "path": ..., "time": ...}``.
        self.checkpoint: dict[str, Any] | None = None
        #: Usernames of peers (a closed run: from their passes).
        self.usernames: dict[ID, str] = {}
        #: Credit for data: bytes served of the run's datasets, shards added (``--datasets``).
        self.data = DataContributions()
        #: Each dataset's manifest as every read so far made it (dataset id -> manifest).
        self._manifests: dict[bytes, Manifest] = {}
        #: The leaderboard a backbone before us saved here (this one's credit adds to it).
        self.earlier: dict[str, dict[str, Any]] = {}
        self._take_up()

    def _take_up(self) -> None:
        """Read back what a backbone that ran here before left: the curve (its last :data:`MAX_CURVE`
        points in memory, the step it reached) and the leaderboard. A line the crash of that backbone
        tore is passed over (and the file ended, so the next line is not glued to it); a leaderboard
        that does not read is moved aside with a warning (kept, not lost), and the board starts anew."""
        curve = self.directory / "curve.jsonl"
        if curve.exists():
            text = curve.read_text(errors="replace")
            points = []
            for line in text.splitlines():
                try:
                    point = json.loads(line)
                except ValueError:
                    continue
                if isinstance(point, dict) and type(point.get("step")) is int:
                    points.append(point)
            if text and not text.endswith("\n"):
                with curve.open("a") as f:
                    f.write("\n")
            self.curve = points[-self.MAX_CURVE:]
            self.last_step = max((p["step"] for p in points), default=-1)
            # the steps the saved board credited already; the step under way when it stopped counts on
            self.credits.after = self.last_step - 1
        board = self.directory / "contributions.json"
        if board.exists():
            try:
                self.earlier = board_from_json(board.read_text(errors="replace"))
            except ValueError as e:
                aside = board.with_name(f"contributions.unreadable-{int(time.time())}.json")
                board.replace(aside)
                log.warning("backbone: %s does not read as a leaderboard (%s): moved to %s; the board starts anew",
                            board, e, aside.name)

    def observe(self, tracker: ProgressTracker, now: float | None = None) -> None:
        self.credits.observe(tracker.reports, time.monotonic() if now is None else now)
        p = tracker.last
        # an empty swarm is no point of the curve: nobody trains (every trainer left, or none came yet),
        # and its step reads 0, which would take the curve back to the start
        if p is None or p.step == self.last_step or p.peers == 0:
            return
        self.last_step = p.step
        line = {"step": p.step, "time": p.time, "loss": p.loss, "samples_per_second": p.samples_per_second,
                "peers": p.peers}
        with (self.directory / "curve.jsonl").open("a") as f:
            f.write(json.dumps(line) + "\n")
        self.curve.append(line)
        del self.curve[: -self.MAX_CURVE]
        board = self.directory / "contributions.json"
        partial = board.with_name(board.name + ".partial")
        partial.write_text(json.dumps(self.contributions(), indent=1))
        partial.replace(board)  # whole or not at all: a crash mid-write left a torn board

    def page(self, tracker: ProgressTracker, run_id: str) -> dict[str, Any]:
        """The ``run`` section of the live page (``nat/dashboard.py``): the run's figures, the curve, and
        per volunteer its rate and step (its last report) and what it contributed."""
        p = tracker.last
        contributions = self.contributions()
        reports = {r.peer_id.to_base58(): r for r in tracker.reports}
        volunteers = []
        for peer in sorted(set(contributions) | set(reports)):
            r = reports.get(peer)
            c = contributions.get(peer, {"samples": 0, "claimed": 0, "auxiliary_steps": 0})
            volunteers.append({"peer_id": peer, "samples": c["samples"], "claimed": c["claimed"],
                               "auxiliary_steps": c["auxiliary_steps"], "username": c.get("username"),
                               "bytes_served": c.get("bytes_served", 0), "shards_added": c.get("shards_added", 0),
                               "samples_per_second": r.samples_per_second if r is not None else None,
                               "step": r.step if r is not None else None,
                               "auxiliary": bool(r is not None and r.auxiliary)})
        return {"run_id": run_id, "step": p.step if p else None, "loss": p.loss if p else None,
                "samples_per_second": p.samples_per_second if p else None, "peers": p.peers if p else 0,
                "samples": p.samples if p else 0, "target": tracker.target, "curve": self.curve,
                "volunteers": volunteers, "checkpoint": self.checkpoint}

    def contributions(self) -> dict[str, dict[str, Any]]:
        """The leaderboard (``contributions.json``): credited and claimed samples, auxiliary steps, user; and
        for data, bytes served of the run's datasets and shards added."""
        board: dict[str, dict[str, Any]] = dict(self.credits.leaderboard(self.usernames))
        for peer, data in self.data.leaderboard().items():
            row = board.setdefault(peer, {"samples": 0, "claimed": 0, "auxiliary_steps": 0})
            row.update(data)
        return carried(self.earlier, board)

    async def observe_datasets(self, datasets: Datasets, names: Sequence[str], now: float | None = None) -> None:
        """Read the run's datasets: each seeder's bytes served (its tracker record) and who added which shards."""
        now = time.monotonic() if now is None else now
        for name in names:
            try:
                manifest = await datasets.find(name)
                seeders = await datasets.seeders(manifest.header.id)
            except DedlocError as e:
                log.info("backbone: reading dataset %s failed: %s", name, e)
                continue
            did = manifest.header.id
            # a grow-only set: a read that missed an entry (a replica behind, a read cut short by its
            # timeout) takes no credit back; a retraction is itself an entry, and is kept too
            known = self._manifests.get(did)
            if known is not None:
                manifest.merge(known)
            self._manifests[did] = manifest
            self.data.observe_served(did, {s.peer_id: s.bytes_served for s in seeders}, now)
            self.data.observe_shards(did, manifest.authors())


__all__ = ["Monitor"]
