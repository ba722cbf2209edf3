"""Dual-stack peers in the NAT lab: IPv4 behind a NAT, and a global IPv6 address beside it.

About half of home lines have IPv6 (most behind the router's stateful filter, some open), and the
rest dial IPv4 only. Real dedloc processes (``dedloc relay``; ``tests/nat_agent.py``, what ``dedloc
peer`` runs) in network namespaces (``nat/lab.py`` with ``public_net6``):

* a peer reachable over IPv6 only (IPv4 behind a NAT, IPv6 open) is confirmed at its IPv6 address,
  which it advertises, and yet keeps its relay slot and stays private to the swarm: an IPv4-only
  peer reaches it, and a dual-stack peer dials it straight over IPv6 (libp2p/specs#614: one IPv6
  success made a node public, it dropped its relays, and IPv4-only peers lost it);
* two peers behind symmetric NATs, which TCP cannot punch over IPv4, whose IPv6 is behind the
  routers' filters, punch it over IPv6 and get a direct connection;
* a public dual-stack peer is public, and nobody asks an AutoNAT server without IPv6 (a relay, a
  peer) to judge an IPv6 address (it would refuse: dialing, it could only have failed).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import trio

from nat.holepunch import HolePunchConfig
from nat.lab import Ipv6, Lab, NatKind
from tests.kit import requires_root_netns
from tests.test_nat_matrix import PORT, PUBLIC_NET, Agent, start_agent, start_relay

pytestmark = [pytest.mark.slow, requires_root_netns, pytest.mark.timeout(300), pytest.mark.usefixtures("forks")]

#: An unallocated block of the global unicast range: public to the code under test, and like the
#: IPv4 PUBLIC_NET it never leaves the lab's namespaces.
PUBLIC_NET6 = "2011:dd::/48"
BOTH = [f"/ip4/0.0.0.0/tcp/{PORT}", f"/ip6/::/tcp/{PORT}"]


async def test_dual_stack_peers_stay_reachable_to_ipv4_and_punch_over_ipv6() -> None:
    async with Lab(prefix="d6", public_net=PUBLIC_NET, public_net6=PUBLIC_NET6) as lab:
        agents: list[Agent] = []
        try:
            _, relay1 = await start_relay(lab, "relay1", listen=BOTH)
            # a cheap relay on an IPv4-only host: asked about an IPv6 address, it would refuse
            _, relay2 = await start_relay(lab, "relay2", listen=BOTH, ipv6=Ipv6.NONE)
            relays = [relay1, relay2]

            async def agent(name: str, kind: NatKind, ipv6: Ipv6) -> Agent:
                host = await lab.peer(name, kind, ipv6=ipv6, listen_port=PORT, delay_ms=10)
                started = await start_agent(host, relays, listen=BOTH)
                agents.append(started)
                return started

            servers = [await agent(f"p{i}", NatKind.PUBLIC, Ipv6.OPEN) for i in range(2)]
            servers.append(await agent("p4only", NatKind.PUBLIC, Ipv6.NONE))  # no IPv6 either
            six_only = await agent("d", NatKind.EIM_PRESERVING, Ipv6.OPEN)
            four_only = await agent("v", NatKind.EIM_CHANGING, Ipv6.NONE)
            sym1 = await agent("s1", NatKind.SYMMETRIC, Ipv6.FIREWALLED)
            sym2 = await agent("s2", NatKind.SYMMETRIC, Ipv6.FIREWALLED)
            home6 = await agent("h", NatKind.EIM_CHANGING, Ipv6.FIREWALLED)  # meets nobody: dials d afresh
            d_host, s2_host = lab.hosts["d"], lab.hosts["s2"]

            public_addrs = [(await s.ask("wait_mode", timeout=40))["addrs"] for s in servers]
            nated = [six_only, four_only, sym1, sym2]
            async with trio.open_nursery() as nursery:  # each NATed peer meets the AutoNAT servers
                for a in nated:
                    async def meet(a: Agent = a) -> None:
                        for addrs in public_addrs:
                            await a.ask("connect", addrs=addrs, timeout=20)
                    nursery.start_soon(meet)

            async def state_once(a: Agent, done: Callable[[dict], bool]) -> dict:
                """The agent's state once ``done`` holds for it, or its last after 60 s."""
                with trio.move_on_after(60):
                    while not done(state := await a.ask("state")):
                        await trio.sleep(0.5)
                    return state
                return await a.ask("state")

            async def settled(a: Agent, want: str) -> dict:
                return await state_once(a, lambda s: s["reachability"] == want and s["mode"] != "starting")

            first = await settled(servers[0], "public")
            assert first["mode"] == "public", first

            # Reached over IPv6 only: confirmed there and advertised, yet private with a relay slot.
            d = await settled(six_only, "private")
            assert d["reachability"] == "private", d
            assert d["mode"] == "relayed", d
            assert any(f"/ip6/{d_host.ip6}/tcp/{PORT}" == c for c in d["confirmed"]), d
            assert any(f"/ip6/{d_host.ip6}/tcp/{PORT}/" in a for a in d["addrs"]), d
            assert any("/p2p-circuit" in a for a in d["addrs"]), d
            assert not any(c.startswith("/ip4/") for c in d["confirmed"]), d

            # An IPv4-only peer reaches it (by its relay; the punch over IPv4 may then go direct).
            reply = await four_only.ask("connect", addrs=d["addrs"], timeout=30)
            assert reply["peer"] == six_only.peer_id
            sent = await four_only.ask("send", peer=six_only.peer_id, mib=1, timeout=60)
            assert sent["ok"], sent

            # A dual-stack peer (behind a NAT and a filter itself) dials it straight over IPv6.
            reply = await home6.ask("connect", addrs=d["addrs"], timeout=20)
            assert reply["kind"] == "direct", reply
            direct = await home6.ask("wait_direct", peer=six_only.peer_id, timeout=5)
            assert direct["addr"] is not None and direct["addr"].startswith(f"/ip6/{d_host.ip6}/"), direct

            # Two symmetric NATs (no TCP punch over IPv4) with filtered IPv6: punched over IPv6, also
            # once their AutoNAT refuted the IPv6 addresses (a filter fails a dial-back, not a punch):
            # they are no longer advertised, and still offered in DCUtR (it failed whenever they were
            # refuted before the punch: in CI, 1 run in 5 here)
            def advertises6(state: dict, name: str) -> bool:
                return any(a.startswith(f"/ip6/{lab.hosts[name].ip6}/tcp/{PORT}/") for a in state["addrs"])

            for a, name in ((sym1, "s1"), (sym2, "s2")):
                state = await state_once(a, lambda s, name=name: not advertises6(s, name))
                assert not advertises6(state, name), state
            s2 = await settled(sym2, "private")
            assert s2["mode"] == "relayed", s2
            relayed_only = [a for a in s2["addrs"] if "/p2p-circuit" in a]
            assert relayed_only, s2
            reply = await sym1.ask("connect", addrs=relayed_only, timeout=30)
            assert reply["kind"] == "relayed", reply
            # a round lost to a loaded machine (SYNs dropped twice, a side too late to dial) is tried
            # again after HolePunchConfig.retry_idle (30 s) by design: the wait covers one such retry
            direct = await sym1.ask("wait_direct", peer=sym2.peer_id, timeout=HolePunchConfig().retry_idle + 15)
            if not direct["direct"]:  # what each side's puncher tried
                raise AssertionError(f"no direct connection: {direct}; sym1 {await sym1.ask('metrics')}; "
                                     f"sym2 {await sym2.ask('metrics')}")
            print(f"symmetric NATs, filtered IPv6: relayed in {reply['elapsed']:.2f} s, "
                  f"direct over IPv6 {direct['elapsed']:.2f} s later")
            assert direct["addr"].startswith(f"/ip6/{s2_host.ip6}/"), direct
            # and the side that led the punch (DCUtR's initiator: the relayed connection came in to it)
            other = await sym2.ask("wait_direct", peer=sym1.peer_id, timeout=5)
            assert other["addr"] is not None and other["addr"].startswith(f"/ip6/{lab.hosts['s1'].ip6}/"), other
            # the relayed connection is retired after a grace period (2 s): polled, not slept
            await sym1.ask("wait_relay_retired", peer=sym2.peer_id, timeout=10)
            sent = await sym1.ask("send", peer=sym2.peer_id, mib=4, timeout=60)
            assert sent == {"ok": True, "path": "direct"}, sent

            # Nobody asked a server without IPv6 (relay2, p4only) about an IPv6 address: not one refusal.
            for a in nated:
                metrics = await a.ask("metrics")
                assert metrics["autonat_refused"] == 0, metrics
            assert (await servers[2].ask("metrics"))["autonat_server.refused"] == 0
        finally:
            for a in agents:
                await a.stop()
