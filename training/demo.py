"""``dedloc demo``: a live swarm, one process per node, behind real NATs or on loopback.

It runs the very commands a user would (``dedloc relay``, ``dedloc average``
and ``dedloc dht``, each with ``--json``) and follows their event lines, so
the demo exercises the product, not a special path.

Two networks (``network=``): as root, where network namespaces work, every node
gets its own namespace of the NAT lab (:mod:`nat.lab`): the bootstrap node on a
public address, peer 1 public, the others behind NATs of different kinds (an
endpoint-independent one, one that changes the port, a symmetric one that no hole
punch gets through, then the rest of the lab's kinds), so what the demo shows is
AutoNAT finding each peer's NAT, relay slots, hole punches and relayed peers taking
part as senders. Elsewhere everything binds to 127.0.0.1 and two roles stand in for
the NATs: the last peer is outbound-only, as behind a firewall, and only dials; with
three or more peers the one before it listens nowhere, as behind a NAT that maps
nothing, and others reach it only through its slot on the relay.

The swarm forms (every regular peer meets every other), the DHT stores and returns
a value, and the peers average tensors: peer *i* holds the value *i* every
round, so the demo checks each round's result against the exact mean of the
group's values. Then the averaging peers stop and as many ``dedloc train``
peers (the same roles) train the example model (:mod:`training.mlm`) together
for ``train_time`` seconds (with ``until_shown``, only until it has shown that:
scripts and the tests), beside the run's backbone (``dedloc backbone``, which
they joined through: it saves the run's state every few steps); the demo prints
the run's progress. Then every trainer leaves, and a newcomer that joins through
the backbone takes the run up from its checkpoint, not from step 0 (DeDLOC 3.1:
the backbone keeps the run while nobody trains). The demo succeeds when the
swarm took global steps together, its loss fell, and the newcomer took the run
up where the backbone kept it.

Every node is a process of its own, started as its command line (``python -m training.commands
...``); where it can, the demo forks each from one process that imported the commands' modules once
(:class:`p2p.forkserver.ForkServer`: torch, py-libp2p, transformers' ALBERT, ~10 s of CPU), not a fresh
interpreter that pays them again (~4 s for a peer, ~9 s for a trainer; a dozen processes). Each is still
its own process, in its own namespace, with its own pipes, signals and exit status.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import trio

from nat.lab import Host, Lab, NatKind, netns_unavailable_reason
from p2p.forkserver import ForkServer, ForkServerError
from p2p.output import Output
from p2p.trio_util import read_lines

from .events import bar, count

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
START_TIMEOUT = 60.0
#: the lab's public addresses: they look globally routed, so the nodes treat them as public; no
#: packet can leave the namespaces
LAB_PUBLIC_NET = "11.0.0.0/15"
LAB_PORT = 4001
#: the NATs peers 1, 2, ... sit behind in the lab (then round again)
LAB_KINDS = (NatKind.PUBLIC, NatKind.EIM_PRESERVING, NatKind.EIM_CHANGING, NatKind.SYMMETRIC,
             NatKind.DOUBLE, NatKind.FIREWALL, NatKind.UDP_BLOCKED)


@dataclass
class _Member:
    name: str
    process: trio.Process
    peer_id: str = ""
    addrs: list[str] = field(default_factory=list)
    #: Open connections per peer: a peer often has two (a dial-back, a relayed one being upgraded).
    connections: Counter[str] = field(default_factory=Counter)
    heard_from: set[str] = field(default_factory=set)

    @property
    def connected(self) -> set[str]:
        return {peer for peer, n in self.connections.items() if n > 0}


#: torch and every module of the four packages (``.*``: a package and all its modules): what the
#: commands (``average``, ``serve-experts``) import as they run.
PACKAGES = ("torch", "p2p.*", "nat.*", "averaging.*", "training.*")
#: What the demo's fork server imports: the packages, transformers' ALBERT and its tokenizer
#: (transformers imports its model classes only as they are named): all that the demo's commands
#: import as they run, ``train`` and ``backbone`` too. ~10 s of CPU, once.
PRELOAD = (*PACKAGES, "transformers.models.albert.modeling_albert", "transformers.tokenization_utils_fast")
#: The module every node runs (``dedloc``'s entry point).
ENTRY = "training.commands"


class _Launcher:
    """The command line of a ``dedloc`` command: through the demo's fork server where it started, a
    fresh interpreter where not (no server asked, or it failed: the demo says why and goes on)."""

    def __init__(self, forks: ForkServer | None) -> None:
        self.forks = forks

    async def ready(self, say: _Say) -> None:
        if self.forks is None:
            return
        try:
            await self.forks.ready()
        except ForkServerError as e:
            say(f"each node a fresh interpreter: {e}")
            self.forks = None

    def __call__(self, *args: str) -> list[str]:
        if self.forks is None:
            return [sys.executable, "-m", ENTRY, *args]
        return self.forks.argv(ENTRY, *args)


@asynccontextmanager
async def _launcher(say: _Say) -> AsyncIterator[_Launcher]:
    """Start the fork server (it imports while the caller builds the network) where it can work
    (Linux: ``prctl``, ``setns``)."""
    if sys.platform != "linux":
        yield _Launcher(None)
        return
    say("importing the commands' modules once (torch, py-libp2p, transformers): each node's process is forked "
        "from that one")
    async with ForkServer.open(PRELOAD) as forks:
        yield _Launcher(forks)


class _Network(Protocol):
    """Where the demo's nodes run: what differs between loopback and the NAT lab."""

    #: the peer that only dials (None: none), the one reachable only through the relay
    client: str | None
    relayed: str | None

    def describe(self, peers: int) -> str: ...

    async def spawn(self, name: str, argv: Sequence[str]) -> trio.Process: ...

    def options(self, name: str, index: int) -> list[str]:
        """Listen and role options of node ``name`` (``index``: 1, 2, ... for peers, 0 otherwise)."""
        ...

    def addr_of(self, member: _Member) -> str:
        """Where the others dial a public node (the bootstrap node, the backbone)."""
        ...

    async def run_tool(self, argv: Sequence[str]) -> tuple[int, str, str]:
        """Run a short command (``dedloc dht ...``) as a user on the network would, to completion."""
        ...


class _Loopback:
    """Every node on 127.0.0.1; two roles stand in for NATs (see the module docstring)."""

    def __init__(self, peers: int) -> None:
        self.peers = peers
        self.client: str | None = f"peer-{peers}"  # outbound only: dials, never dialed, never reduces
        # reachable only through the relay (no listen socket): sends, never reduces (relay limits make it slow)
        self.relayed: str | None = f"peer-{peers - 1}" if peers >= 3 else None

    def describe(self, peers: int) -> str:
        behind = f"{self.client} outbound-only" + (f", {self.relayed} reachable only through the relay"
                                                   if self.relayed else "")
        return f"on 127.0.0.1 ({behind})"

    async def spawn(self, name: str, argv: Sequence[str]) -> trio.Process:
        return await trio.lowlevel.open_process(list(argv), stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)

    def options(self, name: str, index: int) -> list[str]:
        if index and index == self.peers:
            return ["--client", "--listen", LOOPBACK]
        if index and self.relayed is not None and index == self.peers - 1:
            # no listen socket: AutoNAT has nothing to dial back, so it is private and reserves a
            # slot on the relay, as behind a NAT. --allow-private all the same: the others' 127.0.0.1
            # stands for their public addresses, and without it a connection another peer opened
            # to it through the relay had no address to upgrade to (its DCUtR reversal skips
            # 127.0.0.1 as no public address: it stayed relayed, and a CI run's demo averaged nothing)
            return ["--allow-private", "--no-listen"]
        # with --allow-private 127.0.0.1 counts as reachable: the peers serve the DHT once AutoNAT
        # has confirmed them (they are DHT clients until then)
        return ["--allow-private", "--listen", LOOPBACK]

    def addr_of(self, member: _Member) -> str:
        return next(a for a in member.addrs if "/ip4/127.0.0.1/" in a)

    async def run_tool(self, argv: Sequence[str]) -> tuple[int, str, str]:
        done = await trio.run_process([*argv, "--listen", LOOPBACK], capture_stdout=True,
                                      capture_stderr=True, check=False)
        return done.returncode, done.stdout.decode(), done.stderr.decode()


#: one-way delay on each lab peer's access line and on the bootstrap node's: a swarm within one
#: continent (80 ms between two peers, 60 ms to the bootstrap node)
PEER_DELAY_MS = 20.0
BOOT_DELAY_MS = 10.0


class _Namespaces:
    """Every node in its own namespace of the NAT lab: peer i behind ``LAB_KINDS[i - 1]``."""

    def __init__(self, lab: Lab, peers: int) -> None:
        self.lab = lab
        self.kinds = {i: LAB_KINDS[(i - 1) % len(LAB_KINDS)] for i in range(1, peers + 1)}
        self.client: str | None = None  # the NATs decide who is reachable how
        symmetric = [i for i, kind in self.kinds.items() if kind is NatKind.SYMMETRIC]
        self.relayed: str | None = f"peer-{symmetric[0]}" if symmetric else None
        self.hosts: dict[str, Host] = {}
        self._building = trio.Lock()  # the lab's address plan is built one host at a time

    def describe(self, peers: int) -> str:
        kinds = ", ".join(f"peer-{i} {_KIND_WORDS[kind]}" for i, kind in self.kinds.items())
        how = "tc netem" if self.lab.netem else "a userspace delay wire: this kernel has no netem"
        delay = (f"{PEER_DELAY_MS:g} ms one-way on each peer's line, {BOOT_DELAY_MS:g} ms on the bootstrap "
                 f"node's, by {how}")
        return f"in network namespaces ({kinds}; {delay})"

    async def host(self, name: str, index: int) -> Host:
        async with self._building:
            if name not in self.hosts:
                short = "boot" if name == "bootstrap" else name[0] + str(index) if index else name[:12]
                if index:
                    self.hosts[name] = await self.lab.peer(short, self.kinds[index], delay_ms=PEER_DELAY_MS)
                else:
                    self.hosts[name] = await self.lab.public_host(short, delay_ms=BOOT_DELAY_MS)
            return self.hosts[name]

    async def spawn(self, name: str, argv: Sequence[str]) -> trio.Process:
        index = int(name.rsplit("-", 1)[1]) if name[-1].isdigit() else 0
        host = await self.host(name, index)
        return await host.spawn(list(argv), stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)

    def options(self, name: str, index: int) -> list[str]:
        # a lab router maps no ports on request: skip the UPnP/NAT-PMP/PCP probes
        return ["--listen", f"/ip4/0.0.0.0/tcp/{LAB_PORT}", "--no-port-mapping"]

    def addr_of(self, member: _Member) -> str:
        return f"/ip4/{self.hosts[member.name].ip}/tcp/{LAB_PORT}/p2p/{member.peer_id}"

    async def run_tool(self, argv: Sequence[str]) -> tuple[int, str, str]:
        user = await self._user()
        done = await user.run([*argv, "--listen", "/ip4/0.0.0.0/tcp/0"], timeout=60)
        return done.rc, done.stdout, done.stderr

    async def _user(self) -> Host:
        async with self._building:
            if "user" not in self.hosts:  # a user's machine behind a home NAT
                self.hosts["user"] = await self.lab.peer("user", NatKind.EIM_PRESERVING)
            return self.hosts["user"]


_KIND_WORDS = {
    NatKind.PUBLIC: "public",
    NatKind.EIM_PRESERVING: "behind a port-preserving cone NAT",
    NatKind.EIM_CHANGING: "behind a port-changing cone NAT",
    NatKind.SYMMETRIC: "behind a symmetric NAT",
    NatKind.DOUBLE: "behind two NATs (home router and CGNAT)",
    NatKind.FIREWALL: "behind a firewall",
    NatKind.UDP_BLOCKED: "behind a NAT that blocks UDP",
}


def choose_network(asked: str) -> tuple[str, str]:
    """``(network, why)``: "namespaces" as root where the lab works, otherwise "loopback"."""
    if asked == "loopback":
        return "loopback", "as asked"
    reason = "not root" if os.geteuid() != 0 else netns_unavailable_reason()
    if reason is None:
        return "namespaces", "root, and network namespaces work here"
    if asked == "namespaces":
        raise ValueError(f"--network namespaces: the NAT lab is unusable here: {reason}")
    return "loopback", f"no NAT lab ({reason})"


@asynccontextmanager
async def _network(kind: str, peers: int) -> AsyncIterator[_Network]:
    if kind == "loopback":
        yield _Loopback(peers)
        return
    # links get their delay from netem, or from the lab's userspace wire where the kernel has none
    async with Lab(prefix="ddemo", public_net=LAB_PUBLIC_NET) as lab:
        yield _Namespaces(lab, peers)


#: rounds each peer must average correctly, one of them with the whole swarm, for the demo to succeed
ROUNDS_WANTED = 2
#: float32 values averaged each round (4 MB)
TENSOR_SIZE = 1_000_000


#: training: the global batch, each peer's local batch
TRAIN_TARGET = 128
#: the dataset the publisher puts in the swarm and the trainers fetch
DATASET = "demo-corpus"
TRAIN_BATCH = 16
#: the swarm's loss must end below this share of where it started: a tenth off shows in 5-6 global steps
#: of 128 samples (a fifth took 9, ~10 s more of four trainers in the namespace demo's test)
LOSS_FALL = 0.9
#: global steps the swarm must take
STEPS_WANTED = 5
#: the backbone's checkpoint interval, in global steps; the take-up needs a checkpoint past step 1 (an
#: archive counts only when the swarm is more than a step behind it: training/progress.py)
CHECKPOINT_EVERY = 2
#: seconds to wait for the backbone's next checkpoint once the training has shown what it shows
CHECKPOINT_WAIT = 30.0
#: seconds the newcomer has to take the run up, from its start: 9.4 s in the NAT lab, where the trainers
#: that stop say they left; 63.3 s when they did not (until their last reports expired), so the demo
#: fails without it
TAKE_UP_TIMEOUT = 40.0


async def cmd_demo(args: argparse.Namespace, out: Output) -> int:
    """``dedloc demo``: its own module, so that the demo's process imports neither torch nor py-libp2p
    (its nodes do; 4 s of CPU before its first line, otherwise)."""
    try:
        network, why = choose_network(args.network)
    except ValueError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 2
    if not out.json_mode:
        print(f"network: {network} ({why})", flush=True)
    return await run_demo(peers=args.peers, duration=args.duration, train_time=args.train_time, out=out,
                          network=network, until_shown=args.until_shown)


async def run_demo(*, peers: int, duration: float, out: Any, train_time: float = 0.0,
                   network: str = "loopback", until_shown: bool = False) -> int:
    """Start a bootstrap node and ``peers`` peers; 0 once they formed a swarm, used the DHT, averaged
    (and trained, with ``train_time``: at most that long with ``until_shown``, which ends the training
    once the verdict holds). ``network``: "loopback" or "namespaces" (the NAT lab, as root)."""
    if peers < 2:
        print("demo: need at least two peers (averaging takes two)", file=sys.stderr)
        return 2
    say = _Say(out.json_mode)
    async with _launcher(say) as command, _network(network, peers) as where:
        await command.ready(say)
        return await _run_demo(where, command, say, peers=peers, duration=duration, out=out,
                               train_time=train_time, until_shown=until_shown)


async def _run_demo(where: _Network, command: _Launcher, say: _Say, *, peers: int, duration: float, out: Any,
                    train_time: float, until_shown: bool) -> int:
    members: dict[str, _Member] = {}
    names: dict[str, str] = {}  # peer id -> name
    values: dict[str, float] = {}  # peer id -> the value it averages
    client, relayed = where.client, where.relayed
    rounds_ok: Counter[str] = Counter()
    whole_swarm: set[str] = set()
    wrong: list[str] = []
    stopping: set[str] = set()  # averaging peers the demo is stopping: the rounds they cut are no fault
    meshed, averaged = trio.Event(), trio.Event()

    def mesh_complete() -> bool:
        regular = [m for m in members.values() if m.name not in ("bootstrap", client)]
        if len(regular) < peers - 1 or not all(m.peer_id for m in regular):
            return False
        everyone = {m.peer_id for m in members.values() if m.name != client}
        others = {m.peer_id for m in regular}
        return all(
            (everyone - {m.peer_id}) <= m.connected and (others - {m.peer_id}) <= m.heard_from
            for m in regular
        )

    def on_averaged(member: _Member, event: dict[str, Any]) -> None:
        group = [names.get(p, p[-8:]) for p in event["members"]]
        known = [values[p] for p in event["members"] if p in values]
        exact = sum(known) / len(known) if len(known) == len(group) else None
        line = (f"{member.name:>9} avg  round {event['round']}: group {'+'.join(sorted(group))} as {event['role']} "
                f"(share {event['fraction']:.0%}), {event['bytes_sent'] / 1e6:.1f} MB out in {event['elapsed']:.2f} s: "
                f"{event['value']:g} -> {event['mean']:.4f}")
        if not event["complete"]:
            if member.name in stopping or any(names.get(p) in stopping for p in event["members"]):
                say(line + "  cut short: the demo is stopping the averaging peers")
            else:
                say(line + f"  PARTIAL, reported: {event['summary']}")
            return
        if exact is None:
            say(line)
            return
        if abs(event["mean"] - exact) > 1e-4:
            wrong.append(f"{member.name} round {event['round']}: {event['mean']} != {exact}")
            say(line + f"  WRONG, exact mean {exact:.4f}")
            return
        say(line + f"  = exact mean {exact:.4f}")
        rounds_ok[member.name] += 1
        if len(group) == peers:
            whole_swarm.add(member.name)
        peer_names = [m.name for m in members.values() if m.name != "bootstrap"]
        if len(peer_names) == peers and all(rounds_ok[n] >= ROUNDS_WANTED for n in peer_names) and \
                whole_swarm >= set(peer_names):
            averaged.set()

    async def follow(member: _Member, ready: trio.Event) -> None:
        assert member.process.stdout is not None
        async for line in read_lines(member.process.stdout):
            try:
                event = json.loads(line)
            except ValueError:
                continue
            kind = event.get("event")
            if out.json_mode:
                print(json.dumps({"node": member.name, **event}), flush=True)
            if kind == "listening":
                member.peer_id, member.addrs = event["peer_id"], event["addrs"]
                names[member.peer_id] = member.name
                if member.name.startswith("peer-"):
                    values[member.peer_id] = float(member.name.removeprefix("peer-"))
                ready.set()
                say(f"{member.name:>9} up   {member.peer_id}")
            elif kind == "connection_opened":
                member.connections[event["peer_id"]] += 1
                path = "" if event.get("kind", "direct") == "direct" else f", {event['kind']}"
                say(f"{member.name:>9} ⇄    {names.get(event['peer_id'], event['peer_id'][-8:])} ({event['direction']}{path})")
            elif kind == "connection_closed":
                member.connections[event["peer_id"]] -= 1
            elif kind == "message":
                member.heard_from.add(event["peer_id"])
                say(f"{member.name:>9} got  \"{event['text']}\" from {names.get(event['peer_id'], '?')}")
            elif kind == "relay_reserved":
                say(f"{member.name:>9} slot on relay {names.get(event['relay'], event['relay'][-8:])}: reachable at {event['addrs'][0]}/p2p/…")
            elif kind == "reachability" and event["reachability"] != "unknown":
                say(f"{member.name:>9} NAT  {event['reachability']}, mapping {event['mapping']}")
            elif kind == "hole_punch":
                other = names.get(event["peer_id"], event["peer_id"][-8:])
                outcome = f"direct at {event['addr']}" if event["success"] else "stays relayed"
                say(f"{member.name:>9} punch {other}: {outcome} ({event['method']}, {event['attempts']} attempt(s), "
                    f"{event['elapsed']:.2f} s)")
            elif kind == "nat_mode":
                say(f"{member.name:>9} mode {event['mode']}: {event['reason']}")
            elif kind == "dht_joined":
                say(f"{member.name:>9} DHT  joined as {event['mode']}, {event['peers']} servers known")
            elif kind == "dht_mode":
                say(f"{member.name:>9} DHT  now a {event['mode']}: {event['reason']}")
            elif kind == "averaged":
                on_averaged(member, event)
            elif kind == "average_failed" and meshed.is_set():
                say(f"{member.name:>9} avg  round {event['round']}: no average: {event['reason']}")
            elif kind in ("training_status", "global_step", "state_downloaded", "checkpointed"):
                training.on_event(member.name, event, say, peers)
            elif kind == "dataset_published":
                say(f"{member.name:>9} data published {event['name']}: {event['shards']} shards, "
                    f"{event['bytes'] / 1e6:.1f} MB (id {event['dataset'][:12]})")
                published.set()
            elif kind == "dataset_complete":
                sources = ", ".join(f"{names.get(p, p[-8:])} {n / 1e6:.2f} MB" for p, n in event["sources"].items())
                say(f"{member.name:>9} data {event['name']} complete in {event['seconds']:.1f} s from {sources}")
                training.fetched.add(member.name)
            elif kind == "error":
                say(f"{member.name:>9} error: {event['message']}")
            if mesh_complete():
                meshed.set()
            if training.shown(peers):
                shown.set()

    async def start(nursery: trio.Nursery, name: str, *args: str, index: int = 0) -> _Member:
        process = await where.spawn(name, command(*args, "--json", *where.options(name, index), "--ephemeral"))
        member = _Member(name, process)
        members[name] = member
        ready = trio.Event()
        nursery.start_soon(follow, member, ready)
        with trio.fail_after(START_TIMEOUT):
            await ready.wait()
        return member

    training = _Training(names)
    published, shown = trio.Event(), trio.Event()

    async def training_phase() -> bool:
        """Stop the averaging peers; train the example model with as many train peers for train_time."""
        averagers = [m for m in members.values() if m.name.startswith("peer-")]
        stopping.update(m.name for m in averagers)  # before any stops: a round it cuts is no fault
        for member in averagers:
            _stop(member.process)
        with trio.move_on_after(10):
            for member in averagers:
                await member.process.wait()
        workdir = Path(tempfile.mkdtemp(prefix="dedloc-demo-"))
        workdirs.append(workdir)
        from .corpus import prepare

        prepared = await trio.to_thread.run_sync(lambda: prepare(workdir))
        # one peer publishes the corpus; the trainers fetch it from the swarm (through their NATs) as they
        # train, each into a directory of its own, instead of each generating its own
        say(f"data: the publisher makes {len(prepared.corpus)} shards of a generated corpus a dataset of the swarm; "
            "the trainers fetch it from the swarm, each piece checked, and seed it to each other")
        await start(nursery_ref[0], "publisher", "dataset", "create", DATASET, str(prepared.corpus[0].parent),
                    "--initial-peers", boot_ref[0], "--piece-size-kib", "64", "--status-interval", "0")
        with trio.fail_after(START_TIMEOUT):
            await published.wait()
        the_run = ["--run-id", "demo", "--tokenizer", str(prepared.tokenizer), "--target-batch-size", str(TRAIN_TARGET),
                   "--status-interval", "0"]
        # the run's public node: the trainers join through it, so they trust the state it keeps
        backbone = await start(nursery_ref[0], "backbone", "backbone", "--initial-peers", boot_ref[0], *the_run,
                               "--workdir", str(workdir / "backbone"), "--checkpoint-dir", str(workdir / "checkpoints"),
                               "--checkpoint-every", str(CHECKPOINT_EVERY), "--keep-checkpoints", "2",
                               "--report-every", "1")
        join = ["--initial-peers", boot_ref[0], where.addr_of(backbone)]
        say(f"training: {peers} peers train a small ALBERT on swarm:{DATASET}, {TRAIN_TARGET} samples per global "
            f"step, for {train_time:g} s; the backbone saves the run's state every {CHECKPOINT_EVERY} steps")
        run = [*the_run, "--batch-size", str(TRAIN_BATCH), "--report-every", "3", "--group-size", str(peers),
               "--duration", str(train_time + TAKE_UP_TIMEOUT + 60), "--data", f"swarm:{DATASET}"]
        async with trio.open_nursery() as starters:
            for i in range(1, peers + 1):
                starters.start_soon(partial(start, nursery_ref[0], f"trainer-{i}", "train", *join,
                                            "--data-seed", str(i), "--workdir", str(workdir / f"trainer-{i}"), *run,
                                            index=i))
        started = trio.current_time()
        with trio.move_on_after(train_time):  # train the whole time (the loss goes on falling), or until shown
            await (shown.wait() if until_shown else trio.sleep_forever())
            say(f"training: shown after {trio.current_time() - started:.0f} s of the {train_time:g}: ending it "
                "(--until-shown)")
        return training.verdict(say, peers) and await take_up_phase(join, run, workdir)

    async def take_up_phase(join: list[str], run: list[str], workdir: Path) -> bool:
        """Every trainer leaves just after the backbone's next checkpoint; a newcomer joins through the
        backbone and must take the run up from that checkpoint."""
        training.checkpoint_saved = trio.Event()
        with trio.move_on_after(CHECKPOINT_WAIT):
            await training.checkpoint_saved.wait()
        saved = max(training.checkpoints, default=-1)
        if saved < CHECKPOINT_EVERY:
            say(f"take-up: the backbone saved no checkpoint past step 1 (saved: {training.checkpoints})")
            return False
        trainers = [m for m in members.values() if m.name.startswith("trainer-")]
        for member in trainers:
            _stop(member.process)  # each says it left as it stops (training/progress.py)
        with trio.move_on_after(15):
            for member in trainers:
                await member.process.wait()
        say(f"take-up: every trainer left, at step {training.last_step}; the backbone keeps the run's state of "
            f"step {saved}. A newcomer joins through it:")
        began = trio.current_time()
        await start(nursery_ref[0], "newcomer", "train", *join, "--data-seed", "99", "--workdir",
                    str(workdir / "newcomer"), *run)
        with trio.move_on_after(TAKE_UP_TIMEOUT):
            await training.newcomer_took.wait()
        took = trio.current_time() - began
        if training.newcomer_took.is_set():
            with trio.move_on_after(20):  # and trains on from there (alone: it shows its first step)
                await training.newcomer_stepped.wait()
        return training.take_up_verdict(say, saved, took)

    nursery_ref: list[trio.Nursery] = []
    boot_ref: list[str] = []
    workdirs: list[Path] = []  # the training phase's corpus, tokenizer and trainers' state: removed at the end
    say(f"starting a bootstrap node and {peers} peers {where.describe(peers)}; Ctrl-C stops")
    senders = ", ".join(n for n in (client, relayed) if n) or "none"
    ok = False
    try:
        async with trio.open_nursery() as nursery:
            try:
                boot = await start(nursery, "bootstrap", "relay", "--status-interval", "0")
                boot_addr = where.addr_of(boot)
                nursery_ref.append(nursery)
                boot_ref.append(boot_addr)
                averaging = ["--prefix", "demo", "--size", str(TENSOR_SIZE), "--group-size", str(peers),
                             "--min-size", "2", "--gather-time", "1.5", "--interval", "1", "--status-interval", "0"]
                async with trio.open_nursery() as starters:
                    for i in range(1, peers + 1):
                        name = f"peer-{i}"
                        # the outbound-only peer has no greeting: nobody could open a stream to it
                        greet = [] if name == client else ["--message", f"hello from {name}",
                                                           "--exchange-interval", "1"]
                        starters.start_soon(partial(start, nursery, name, "average", "--initial-peers", boot_addr,
                                                    "--value", str(i), *averaging, *greet, index=i))
                with trio.move_on_after(duration):
                    await meshed.wait()
                    say(f"swarm formed: {peers} peers and the bootstrap node; the regular peers all connected "
                        "and heard every greeting")
                    if await _dht_round_trip(say, where, command, boot_addr):
                        await averaged.wait()
                        say(f"averaging: every peer averaged {ROUNDS_WANTED}+ rounds exactly, each in a group "
                            f"of all {peers} at least once (senders only: {senders})")
                        ok = not wrong
                if ok and train_time > 0:
                    ok = await training_phase()
            finally:
                for member in members.values():
                    _stop(member.process)
                nursery.cancel_scope.cancel()
    finally:
        for member in members.values():
            with trio.CancelScope(shield=True), trio.move_on_after(10):
                await member.process.wait()
        for workdir in workdirs:  # a demo leaves nothing behind: each run made its own
            shutil.rmtree(workdir, ignore_errors=True)
    if ok:
        return 0
    if wrong:
        say(f"wrong averages: {wrong}")
    elif not meshed.is_set():
        missing = {m.name: sorted(names.get(p, p) for p in m.connected) for m in members.values()}
        say(f"swarm did not form within {duration:g}s; connections seen: {missing}")
    elif not averaged.is_set():
        say(f"averaging did not finish within {duration:g}s: exact rounds per peer {dict(rounds_ok)}, "
            f"in a group of all {peers}: {sorted(whole_swarm)}")
    return 1


class _Training:
    """What the demo watches of the training run: steps, who averaged, the swarm's loss over time."""

    def __init__(self, names: dict[str, str]) -> None:
        self.names = names  # peer id -> name
        self.losses: list[tuple[int, float]] = []  # (step, swarm loss) from trainer-1's status lines
        self.steps: dict[str, int] = {}  # trainer -> global steps done with others
        self.fetched: set[str] = set()  # trainers that fetched the whole dataset from the swarm
        self.last_step = 0  # the highest global step a trainer took
        self.checkpoints: list[int] = []  # the steps the backbone saved
        self.checkpoint_saved = trio.Event()  # (replaced by the take-up phase: set at the next save)
        #: the newcomer's state download: (step, from whom)
        self.newcomer_state: tuple[int, str] | None = None
        self.newcomer_took, self.newcomer_stepped = trio.Event(), trio.Event()

    def on_event(self, name: str, event: dict[str, Any], say: _Say, peers: int) -> None:
        kind = event["event"]
        if kind == "training_status" and name == "trainer-1":
            if event.get("swarm_loss") is not None:
                self.losses.append((event["step"], event["swarm_loss"]))
            loss = "?" if event.get("swarm_loss") is None else f"{event['swarm_loss']:.3f}"
            filled = bar(event["swarm_samples"], event["target"], width=20)
            say(f"{'train':>9}      step {event['step']:>3} {filled} {count(event['swarm_samples'], event['target']):>9} "
                f"| {event['swarm_samples_per_second']:.0f} samples/s | loss {loss} | {event['peers']} peers")
        elif kind == "checkpointed":
            if event["step"] >= 0:
                self.checkpoints.append(event["step"])
                self.checkpoint_saved.set()
                say(f"{name:>9} saved the run's state of step {event['step']} "
                    f"(from {self.names.get(event['source'], event['source'][-8:])})")
        elif kind == "global_step" and name == "newcomer":
            self.newcomer_stepped.set()
            say(f"{name:>9} step {event['step']:>3} done: {event['samples']} samples, the run going on")
        elif kind == "global_step":
            self.last_step = max(self.last_step, event["step"] + 1)
            if event["averaged"] and not event["missed"]:
                self.steps[name] = self.steps.get(name, 0) + 1
            alone = not event["averaged"] and not event["missed"]
            unusual = event["missed"] or not event["complete"] or alone
            if name == "trainer-1" or unusual:
                state = "missed" if event["missed"] else ("PARTIAL" if not event["complete"] else
                                                          "alone" if alone else "done")
                # why a step was not averaged, from every trainer: a CI run's demo had all three alone at step 0
                # for the 30 s matchmaking timeout, and its output did not say why
                why = f": {event['summary']}" if unusual and not event.get("solo") else ""  # alone in the run: no failure
                say(f"{name:>9} step {event['step']:>3} {state}: {event['samples']} samples "
                    f"({event['local_samples']} its own), group of {event['group_size']} in {event['elapsed']:.2f} s{why}")
        elif kind == "state_downloaded":
            source = self.names.get(event.get("source", ""), "a peer")
            say(f"{name:>9} took the swarm's state at step {event['step']} from {source} in {event.get('seconds', 0):.2f} s")
            if name == "newcomer" and self.newcomer_state is None:
                self.newcomer_state = (event["step"], source)
                self.newcomer_took.set()

    def take_up_verdict(self, say: _Say, saved: int, seconds: float = 0.0) -> bool:
        """Whether the newcomer took the run up from the backbone's checkpoint (at ``saved`` or later),
        ``seconds`` after it was started."""
        if self.newcomer_state is None:
            say(f"take-up: the newcomer took no state within {TAKE_UP_TIMEOUT:g} s")
            return False
        step, source = self.newcomer_state
        if source != "backbone" or step < saved:
            say(f"take-up: the newcomer took the state of step {step} from {source}, not the backbone's of step {saved}")
            return False
        say(f"take-up: the newcomer went on from the backbone's checkpoint of step {step}, not from step 0 "
            f"({seconds:.1f} s after it was started)")
        return True

    def trained(self, peers: int) -> bool:
        """Steps were taken together by every one of ``peers`` trainers, and the swarm's loss fell."""
        fell = len(self.losses) >= 2 and self.losses[-1][1] < LOSS_FALL * self.losses[0][1]
        return fell and len(self.steps) == peers and min(self.steps.values()) >= 2 and \
            max(self.steps.values()) >= STEPS_WANTED

    def shown(self, peers: int) -> bool:
        """What :meth:`verdict` wants, all of it: every trainer fetched the dataset, and :meth:`trained`."""
        return len(self.fetched) >= peers and self.trained(peers)

    def verdict(self, say: _Say, peers: int) -> bool:
        """Whether the swarm trained on data it carried: every trainer fetched the dataset from the swarm,
        steps were taken together by every peer, the loss fell."""
        if len(self.fetched) < peers:
            say(f"data: only {sorted(self.fetched)} fetched the whole dataset from the swarm")
            return False
        say(f"data: every one of the {peers} trainers fetched the dataset from the swarm")
        if self.trained(peers):
            (s0, l0), (s1, l1) = self.losses[0], self.losses[-1]
            say(f"training: {max(self.steps.values())} global steps, every one of the {peers} peers averaged in "
                f"them; the swarm's loss fell {l0:.3f} (step {s0}) -> {l1:.3f} (step {s1})")
            return True
        say(f"training did not get far enough: global steps averaged per peer {self.steps}, swarm loss "
            f"{self.losses[0][1] if self.losses else '?'} -> {self.losses[-1][1] if self.losses else '?'}")
        return False


async def _dht_round_trip(say: _Say, where: _Network, command: _Launcher, boot_addr: str) -> bool:
    """Store a value with ``dedloc dht store`` and read it back with ``dedloc dht get``, as a user would."""
    boot = ["--initial-peers", boot_addr]
    rc1, out1, err1 = await where.run_tool(command("dht", "store", "demo:greeting", "hello, DHT", "--ttl", "60", *boot))
    say(f"      dht store demo:greeting → {out1.strip() or err1.strip()}")
    rc2, out2, err2 = await where.run_tool(command("dht", "get", "demo:greeting", *boot))
    say(f"      dht get demo:greeting   → {out2.strip() or err2.strip()}")
    return rc1 == 0 and rc2 == 0 and out2.startswith("hello, DHT")


def _stop(process: trio.Process) -> None:
    if process.returncode is None:
        try:
            process.terminate()
        except ProcessLookupError:
            pass


class _Say:
    """Progress for people; silent in --json mode (the events speak there)."""

    def __init__(self, json_mode: bool):
        self.json_mode = json_mode

    def __call__(self, text: str) -> None:
        if not self.json_mode:
            print(text, flush=True)
