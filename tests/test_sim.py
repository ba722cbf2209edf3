"""The internet-scale simulator: its clock, its calibrated network, and the DHT's own code at a
few hundred peers (bench/scale.py runs the thousands)."""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable

import pytest
from libp2p.peer.id import ID

from p2p.dht.routing import DHTID
from p2p.sim import calibration as cal
from p2p.sim.dht import DHTSim, DHTSimConfig, Stored, make_record
from p2p.sim.engine import Engine
from p2p.sim.network import Kind, NetworkModel


def test_the_clock_runs_callbacks_in_time_order_and_ties_in_schedule_order() -> None:
    engine = Engine()
    seen: list[str] = []
    engine.at(2.0, seen.append, "late")
    engine.at(1.0, seen.append, "first")
    engine.at(1.0, seen.append, "second")
    engine.at(0.5, lambda: engine.at(0.5, seen.append, "scheduled inside"))
    engine.run(1.5)
    assert seen == ["first", "second", "scheduled inside"] and engine.now == 1.5 and len(engine) == 1
    engine.run(10)
    assert seen[-1] == "late" and engine.events == 5
    with pytest.raises(ValueError):
        engine.at(-1, seen.append, "past")


def test_the_network_is_calibrated_to_its_sources() -> None:
    model = NetworkModel().calibrate()
    rng = random.Random(7)
    rtts = sorted(model.rtt(model.place(rng), model.place(rng)) for _ in range(10_000))
    assert abs(statistics.median(rtts) - cal.MEDIAN_RTT_S) < 0.005
    assert rtts[int(0.99 * len(rtts))] > 2 * cal.MEDIAN_RTT_S > rtts[0] * 4  # a long tail and short local paths
    sessions = sorted(model.session_s(rng) / 3600 for _ in range(10_000))
    assert abs(sessions[5_000] - cal.SESSION_HALF_GONE_H) < 0.25
    assert abs(sessions[8_000] - cal.SESSION_80_GONE_H) < 1.0
    kinds = [model.kind(rng) for _ in range(10_000)]
    assert abs(kinds.count(Kind.UNREACHABLE) / 1e4 - cal.UNREACHABLE_SHARE) < 0.02
    assert abs(kinds.count(Kind.SILENT) / 1e4 - cal.SILENT_SHARE) < 0.02


def test_a_lost_message_waits_for_tcps_retransmission() -> None:
    model = NetworkModel(loss=0.0).calibrate()
    rng = random.Random(1)
    a, b = model.place(rng), model.place(rng)
    assert model.one_way(a, b, rng) == pytest.approx(model.rtt(a, b) / 2)
    lossy = NetworkModel(loss=0.999).calibrate()
    assert lossy.one_way(a, b, random.Random(2)) > 0.2


@pytest.fixture(scope="module")
def joined() -> DHTSim:
    sim = DHTSim(DHTSimConfig(peers=200, seed=3, join_spread_s=120, churn=False))
    sim.run(300)
    return sim


def test_peers_join_through_the_bootstrap_peers_and_fill_their_tables(joined: DHTSim) -> None:
    servers = joined.live_servers()
    assert len(servers) > 100
    assert statistics.median(len(p.table) for p in servers) >= 40
    health = joined.health(sample=50)
    assert health["know_all_20_closest"] > 0.5  # no churn: most know their neighbourhood
    clients = [p for p in joined.peers if p.kind is Kind.UNREACHABLE]
    assert clients and not any(c.peer_id in s.table for c in clients for s in servers)  # clients serve no one


def test_values_stored_by_the_dhts_own_code_are_found_again(joined: DHTSim) -> None:
    rng = random.Random(4)
    live = [p for p in joined.peers if p.alive]
    stored: dict[bytes, list[ID]] = {}
    records = [make_record(rng, joined.wall()) for _ in range(10)]

    def keep(key: bytes) -> Callable[[Stored], None]:
        return lambda done: stored.__setitem__(key, done.holders)

    for r in records:
        joined.store(rng.choice(live), r, keep(r.key))
    joined.run(joined.now + 60)
    assert len(stored) == 10
    servers = joined.live_servers()
    for r in records:
        holders = stored[r.key]
        truth = joined.closest(int(DHTID.from_key(r.key)), 20, servers)
        assert sum(t.peer_id in holders for t in truth) >= 15
    got: list[tuple[float, bool]] = []
    for r in records:
        joined.get(rng.choice(live), r.key, lambda s, found: got.append((s, found)))
    joined.run(joined.now + 60)
    assert len(got) == 10 and all(found for _, found in got)
    # the timeout bounds every call: nothing waits for a silent peer past it
    assert max(s for s, _ in got) < joined.config.dht.op_timeout
