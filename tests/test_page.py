"""The live page in a real browser (Debian's chromium, headless): a local swarm trains, the backbone
serves the page, and what the page shows is checked against the swarm's own figures."""

from __future__ import annotations

import os
import re
import shutil
from contextlib import AsyncExitStack
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
import trio

from nat import Peer
from nat.dashboard import Dashboard
from training.monitor import Monitor
from training.metrics import TrainingMetrics
from training.optimizer import CollaborativeOptimizer, TrainingConfig
from training.progress import ProgressTracker

from .kit import loopback_peer_config
from .test_averaging import public

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(240),
    pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (make test installs it as root)"),
]

STEPS = 3


class Page(HTMLParser):
    """The rendered DOM: text by element id and by data-* attribute, the SVG polylines."""

    def __init__(self) -> None:
        super().__init__()
        self.by_attr: dict[tuple[str, str], str] = {}
        self.attrs_of: dict[str, dict[str, str]] = {}
        self.polylines: dict[str, list[str]] = {}
        self._open: list[tuple[str, str] | None] = []
        self._svg: str | None = None
        self.text = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if "id" in a:
            self.attrs_of[a["id"]] = a
        if tag == "svg":
            self._svg = a.get("id")
        if tag == "polyline" and self._svg:
            self.polylines.setdefault(self._svg, []).append(a.get("points", ""))
        key = next(((k, v) for k, v in a.items() if k.startswith("data-") and k != "data-loaded"), None)
        if key is None and "id" in a:
            key = ("id", a["id"])
        if tag not in ("polyline", "line", "meta", "link", "br", "img", "input"):
            self._open.append(key)

    def handle_endtag(self, tag: str) -> None:
        if tag == "svg":
            self._svg = None
        if tag not in ("polyline", "line", "meta", "link", "br", "img", "input") and self._open:
            self._open.pop()

    def handle_data(self, data: str) -> None:
        self.text += data
        for key in self._open:
            if key is not None:
                self.by_attr[key] = self.by_attr.get(key, "") + data

    def get(self, attr: str, value: str) -> str:
        return self.by_attr.get((attr, value), "").strip()


def number(text: str) -> float:
    return float(text.replace(",", ""))


async def chromium(*args: str) -> bytes:
    assert CHROMIUM is not None
    result = await trio.run_process(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         "--virtual-time-budget=5000", *args], capture_stdout=True, capture_stderr=True, check=True)
    return result.stdout


async def train(peer: Peer, model: torch.nn.Module, config: TrainingConfig, seed: int, stay: trio.Event) -> None:
    """``STEPS`` steps, then in the run (reporting) until ``stay`` is set: the block's end says it left."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    async with CollaborativeOptimizer.open(peer, optimizer, config) as opt:
        while opt.local_step < STEPS:
            x = torch.randn(8, 4, generator=generator)
            loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
            loss.backward()
            await trio.sleep(0.15)  # a batch's compute time: the backbone reads reports every 0.2 s
            await opt.step(8, loss=loss.item())
        await stay.wait()


async def test_the_live_page_shows_the_swarm_and_the_run_as_they_are(tmp_path: Path) -> None:
    config = TrainingConfig(run_id="page-run", target_batch_size=32, report_interval=0.2)
    async with AsyncExitStack() as stack:
        backbone = await stack.enter_async_context(Peer.open(loopback_peer_config(relay=True)))
        dashboard = await stack.enter_async_context(Dashboard.serve(backbone, "127.0.0.1:0", role="backbone"))
        boot = [str(backbone.addrs[0])]
        trainers = [await stack.enter_async_context(Peer.open(loopback_peer_config(initial_peers=boot)))
                    for _ in range(2)]
        await public(trainers)
        # the backbone's side, as `dedloc backbone` wires it (training/cli.py)
        monitor = Monitor(tmp_path / "run")
        tracker = ProgressTracker(backbone, config.run_id, config.target_batch_size, client=False)
        dashboard.registry.register(TrainingMetrics(tracker))
        dashboard.sections["run"] = lambda: monitor.page(tracker, config.run_id)
        monitor.checkpoint = {"step": 2, "path": str(tmp_path / "run" / "checkpoint-000002.pt"), "time": 0.0}
        # credit for data, as `backbone --datasets` reads it from the trackers: trainer 0 served 3 MiB and
        # added 2 shards
        dataset = b"\x01" * 32
        monitor.data.observe_served(dataset, {trainers[0].peer_id: 0}, 0.0)
        monitor.data.observe_served(dataset, {trainers[0].peer_id: 3 << 20}, 100.0)
        monitor.data.observe_shards(dataset, {trainers[0].peer_id: 2})

        async def watch() -> None:
            while True:
                await tracker.fetch()
                monitor.observe(tracker)
                await trio.sleep(0.2)

        models = [torch.nn.Linear(4, 1) for _ in trainers]
        assert dashboard.address is not None
        url = f"http://127.0.0.1:{dashboard.address[1]}/"
        shot = tmp_path / "live-page.png"
        stay = trio.Event()
        with trio.fail_after(150):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch)
                async with trio.open_nursery() as training:
                    for i, peer in enumerate(trainers):
                        training.start_soon(train, peer, models[i], config, i, stay)
                    # the trainers' reports at the last step reach the backbone, the two of them still in the run
                    while (tracker.last is None or tracker.last.step < STEPS or tracker.last.peers < 2
                           or monitor.last_step < STEPS):
                        await trio.sleep(0.2)
                    # the page, read while the backbone goes on reading the run
                    dom = (await chromium("--dump-dom", url)).decode()
                    status = dashboard.status()  # what the swarm says of itself, read just after the page did
                    await chromium(f"--screenshot={shot}", "--window-size=1280,1700", "--hide-scrollbars", url)
                    stay.set()  # they leave
                # the backbone reads the run they all left at the step they left it, with nobody in it
                while tracker.last.peers:
                    await trio.sleep(0.2)
                nursery.cancel_scope.cancel()
        after = dashboard.status()["run"]
        assert (after["step"], after["peers"], monitor.last_step) == (STEPS, 0, STEPS), after

    page = Page()
    page.feed(dom)
    assert 'data-loaded="1"' in dom, "the page's script did not run or could not read /api/status"
    # this node
    assert page.attrs_of["node"]["data-peer-id"] == str(backbone.peer_id)
    assert page.get("id", "role") == "backbone"
    assert page.get("data-key", "reachability") == status["node"]["reachability"]
    # the peers it sees, and how
    for peer in trainers:
        assert (f'data-peer="{peer.peer_id}"') in dom
    assert number(page.get("data-key", "direct")) == status["links"]["direct"] >= 2
    assert number(page.get("data-key", "relayed")) == status["links"]["relayed"]
    assert page.get("id", "peer-count") == f"({len(status['peers'])})"
    # the hole-punch funnel and the relay's service
    assert number(page.get("data-key", "punch_attempts")) == status["funnel"]["punch_attempts"]
    assert number(page.get("data-key", "relay_reservations")) == status["relay"]["reservations"]
    # usage against limits
    rows = {r["name"]: r for r in status["resources"]}
    assert "inbound connections" in rows and rows["inbound connections"]["limit"] == 4096
    for name in rows:
        assert page.get("data-resource", name) == name
    # sizes as a person reads them: 64 MiB, not 67,108,864
    assert re.fullmatch(r"[\d.,]+ (MiB|GiB)", page.get("data-limit", "memory in flight")), page.get("data-limit", "memory in flight")
    assert re.fullmatch(r"[\d.,]+ (MiB|GiB)", page.get("data-used", "memory in flight"))
    assert page.get("data-limit", "inbound connections") == "4,096"
    # the run: step, loss, samples per second per volunteer, contributions, checkpoint, the curve
    run = status["run"]
    assert number(page.get("data-key", "step")) == run["step"] == STEPS
    assert abs(number(page.get("data-key", "loss")) - run["loss"]) < 1e-3
    assert run["peers"] == 2 and len(run["volunteers"]) == 2
    for v in run["volunteers"]:
        assert number(page.get("data-samples", v["peer_id"])) == v["samples"] > 0
        assert abs(number(page.get("data-rate", v["peer_id"])) - v["samples_per_second"]) < 0.06
    assert {v["peer_id"]: v["samples"] for v in run["volunteers"]} == {
        p: c["samples"] for p, c in monitor.contributions().items()}
    served = {v["peer_id"]: (page.get("data-served", v["peer_id"]), page.get("data-shards", v["peer_id"]))
              for v in run["volunteers"]}
    assert sorted(served.values()) == [("0 MiB", "0"), ("3 MiB", "2")]  # sizes as a person reads them
    assert "last checkpoint: step 2" in page.get("id", "checkpoint")
    points = page.polylines["loss-chart"][0].split()
    assert len(points) == len([c for c in run["curve"] if c["loss"] is not None]) >= STEPS
    # the loss axis fits the data (not drawn from 0, where a fall from 4.3 to 3.7 looks flat): the curve
    # spans most of the plot's 188 px of height
    ys = [float(p.split(",")[1]) for p in points]
    assert max(ys) - min(ys) > 0.8 * 188, ys
    assert shot.stat().st_size > 20_000
    keep = os.environ.get("DEDLOC_PAGE_SCREENSHOT")
    if keep:
        shutil.copy(shot, keep)
    assert re.search(r"updated \d", dom)
