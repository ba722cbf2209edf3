"""The DHT across real NATs: who serves, who is only a client, and whether clients still read and write.

One public relay (``dedloc relay``), two PUBLIC peers and two NATed peers (one
behind a SYMMETRIC NAT, reachable only through the relay, one behind an
EIM_PRESERVING NAT), each a ``tests/nat_agent.py`` process in its own network
namespace running the NAT layer at its defaults and the DHT in ``auto`` mode
(``DHT.open(node, DHTConfig(mode="auto"))``, following the NAT layer's verdict through the Node). The test asserts:

* the public peers become public through AutoNAT and then serve the DHT, and
  each has the other in its routing table;
* the NATed peers become private and are DHT clients, and no server's routing
  table holds them (nor the relay's, when the relay serves the DHT and tells
  its table size through ``dedloc status``);
* the relay-only (symmetric) peer stores a value that the others read, and
  reads the values the others stored.

The public peers open their DHTs at the same time, each connected to the other
(two founders that list each other as initial peers): the relay may not serve
the DHT, and a DHT with initial peers refuses to open until some server answered.
Marked ``slow``; needs root (network namespaces), like the NAT matrix.
"""

from __future__ import annotations

import json
import time
from functools import partial
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio

from nat.lab import Host, Lab, NatKind
from tests.kit import requires_root_netns
from tests.forks import python_m
from tests.test_nat_matrix import PORT, PUBLIC_NET, Agent, start_agent, start_relay

pytestmark = [pytest.mark.slow, requires_root_netns, pytest.mark.timeout(150), pytest.mark.usefixtures("forks")]

#: The whole scenario, lab teardown excluded.
TEST_TIMEOUT = 90
TTL = 600


async def until(agent: Agent, cmd: str, done: Callable[[dict[str, Any]], bool], timeout: float,
                what: str, **fields: Any) -> dict[str, Any]:
    """Ask ``cmd`` every half second until ``done(reply)``; fail with the last reply after ``timeout``."""
    reply: dict[str, Any] = {}
    with trio.move_on_after(timeout):
        while True:
            reply = await agent.ask(cmd, timeout=10, **fields)
            if done(reply):
                return reply
            await trio.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout:g} s; last {cmd}: {reply}")


async def gather(*jobs: Callable[[], Awaitable[Any]]) -> list[Any]:
    """Run ``jobs`` concurrently; their results in order."""
    results: list[Any] = [None] * len(jobs)

    async def one(i: int) -> None:
        results[i] = await jobs[i]()

    async with trio.open_nursery() as nursery:
        for i in range(len(jobs)):
            nursery.start_soon(one, i)
    return results


def non_local(addrs: list[str]) -> list[str]:
    """Advertised addresses others could use: neither loopback nor the NAT's LAN (10/8)."""
    return [a for a in addrs if not (a.startswith("/ip4/127.") or a.startswith("/ip4/10."))]


async def relay_table_size(relay: Host, relay_addr: str) -> int | None:
    """The relay's DHT routing-table size from ``dedloc status`` (None if the relay does not serve the DHT)."""
    local = f"/ip4/127.0.0.1/tcp/{PORT}/p2p/{relay_addr.rsplit('/p2p/', 1)[1]}"
    res = await relay.run(python_m("nat.cli", "status", local, "--json", "--timeout", "5"), timeout=20)
    if res.rc != 0:
        raise AssertionError(f"dedloc status on the relay failed: {res.stderr!r}")
    status = json.loads(res.stdout)
    size = status.get("dht.routing_table")
    return None if size is None else int(size)


async def test_dht_clients_behind_nat() -> None:
    started = time.monotonic()
    async with Lab(prefix="ddht", public_net=PUBLIC_NET) as lab:
        relay, relay_addr = await start_relay(lab)
        hosts = {
            "pub1": await lab.peer("pub1", NatKind.PUBLIC, listen_port=PORT, delay_ms=20),
            "pub2": await lab.peer("pub2", NatKind.PUBLIC, listen_port=PORT, delay_ms=20),
            "sym": await lab.peer("sym", NatKind.SYMMETRIC, listen_port=PORT, delay_ms=20),
            "eim": await lab.peer("eim", NatKind.EIM_PRESERVING, listen_port=PORT, delay_ms=20),
        }
        agents: dict[str, Agent] = {}

        async def spawn(name: str) -> None:
            agents[name] = await start_agent(hosts[name], relay_addr)

        try:
            await gather(*[partial(spawn, n) for n in hosts])
            p1, p2, sym, eim = agents["pub1"], agents["pub2"], agents["sym"], agents["eim"]
            names = {a.peer_id: n for n, a in agents.items()}
            relay_id = relay_addr.rsplit("/p2p/", 1)[1]
            names[relay_id] = "relay"
            servers = {p1.peer_id, p2.peer_id, relay_id}  # the relay too, where it serves the DHT
            with trio.fail_after(TEST_TIMEOUT):
                # The public peers: AutoNAT (the relay and the other agents serve it) confirms them.
                s1, s2 = await gather(*[partial(until, a, "state", lambda r: r["reachability"] == "public", 45,
                                                f"{names[a.peer_id]} public") for a in (p1, p2)])
                print(f"public after {time.monotonic() - started:.1f} s")
                # Two founders, each connected to the other, open their DHTs together.
                o1, o2 = await gather(lambda: p1.ask("dht_open", timeout=40, mode="auto", peers=[s2["addrs"]]),
                                      lambda: p2.ask("dht_open", timeout=40, mode="auto", peers=[s1["addrs"]]))
                assert o1["server"] and o2["server"], (o1, o2)
                print(f"servers joined after {time.monotonic() - started:.1f} s")

                # The NATed peers: private (AutoNAT could not dial them back), then clients.
                for agent in (sym, eim):
                    await until(agent, "state", lambda r: r["reachability"] == "private", 45,
                                f"{names[agent.peer_id]} private")
                print(f"NATed peers private after {time.monotonic() - started:.1f} s")
                await gather(*[partial(a.ask, "dht_open", timeout=40, mode="auto", peers=[s1["addrs"]])
                               for a in (sym, eim)])
                for agent in (sym, eim):
                    info = await agent.ask("dht_info")
                    assert info["server"] is False and info["reachability"] == "private", (names[agent.peer_id], info)
                    assert info["table"], f"{names[agent.peer_id]} knows no DHT server: {info}"
                    assert set(info["table"]) <= servers, (names[agent.peer_id], info)
                # The symmetric peer is reachable only through the relay.
                sym_state = await until(sym, "state", lambda r: any("p2p-circuit" in a for a in r["addrs"]), 20,
                                        "sym advertises a relay circuit")
                assert all("p2p-circuit" in a for a in non_local(sym_state["addrs"])), sym_state
                print(f"clients joined after {time.monotonic() - started:.1f} s")

                # Writes from every kind of peer, the relay-only client's included.
                for agent, key in ((sym, "nat:sym"), (p1, "nat:pub1"), (eim, "nat:eim")):
                    reply = await agent.ask("dht_store", timeout=20, key=key, value=f"from {key}", ttl=TTL)
                    assert reply["stored"] is True, (key, reply)
                # The relay-only client reads what the others stored...
                for key in ("nat:pub1", "nat:eim"):
                    got = await sym.ask("dht_get", timeout=20, key=key)
                    assert got["value"] == f"from {key}", (key, got)
                # ... and the others read what it stored (latest=True: asks the replicas, not a local copy).
                for agent in (p1, p2, eim):
                    got = await agent.ask("dht_get", timeout=20, key="nat:sym", latest=True)
                    assert got["value"] == "from nat:sym", (names[agent.peer_id], got)
                print(f"values exchanged after {time.monotonic() - started:.1f} s")

                # After all that traffic: the servers route only to servers, never to the NATed clients.
                for agent, other in ((p1, p2), (p2, p1)):
                    info = await agent.ask("dht_info")
                    assert info["server"] is True, (names[agent.peer_id], info)
                    assert other.peer_id in info["table"], (names[agent.peer_id], info)
                    held = {names.get(p, p) for p in info["table"]} & {"sym", "eim"}
                    assert not held, f"{names[agent.peer_id]}'s routing table holds the NATed {held}: {info}"
                for agent in (sym, eim):
                    info = await agent.ask("dht_info")
                    assert info["server"] is False, (names[agent.peer_id], info)
                size = await relay_table_size(relay, relay_addr)
                if size is not None:  # the relay serves the DHT: the two public peers, nobody else
                    assert size == 2, f"the relay's routing table has {size} peers, expected the 2 public ones"
                print(f"relay routing table: {size if size is not None else 'no DHT on the relay'}; "
                      f"done after {time.monotonic() - started:.1f} s")
        finally:
            with trio.move_on_after(3):  # a clean exit closes the DHTs and NAT layers; then kill regardless
                async with trio.open_nursery() as nursery:
                    for agent in agents.values():
                        nursery.start_soon(quit_agent, agent)
            for agent in agents.values():
                agent.proc.kill()


async def quit_agent(agent: Agent) -> None:
    try:
        assert agent.proc.stdin is not None
        await agent.proc.stdin.send_all(b'{"cmd": "quit"}\n')
        await agent.proc.wait()
    except Exception:
        pass
