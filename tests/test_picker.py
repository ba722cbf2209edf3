"""training/datasets/picker.py: which piece to ask of which seeder, which seeders to talk to, and how
uploads wait (pure: ``now`` is passed in).

Beside the scenarios, a random walk over every event a download meets (seeders that come, hold
pieces, answer, fail, vanish or cheat) checks the picker's bookkeeping after each step: a count of
holders off by one, or a request left behind by a seeder that went, is a piece asked of nobody (the
download stalls) or asked twice (an upload wasted).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from libp2p.peer.id import ID

from training.datasets.picker import (
    LEAVES,
    Pacer,
    PickerConfig,
    PiecePicker,
    SeederState,
    SeederTable,
    TableConfig,
    UploadSlots,
)


# ---------------------------------------------------------------------- the piece picker

A, B, C = (ID(bytes([0, 36, 8, 1, 18, 32]) + bytes([i]) * 32) for i in (1, 2, 3))


def picker(pieces: list[int], **kw: object) -> PiecePicker:
    kw.setdefault("config", PickerConfig(pipeline=8, pipeline_start=8))
    return PiecePicker(pieces, leaves_known=range(len(pieces)), rng=random.Random(0), **kw)  # type: ignore[arg-type]


def test_the_rarest_piece_is_asked_first() -> None:
    p = picker([4], config=PickerConfig(pipeline=1, pipeline_start=1))
    p.update(A, 0, None)
    p.update(B, 0, [0, 1, 2])
    p.update(C, 0, [0, 1])
    assert p.pick(A, 0) == (0, 3)  # only A holds piece 3
    assert p.pick(B, 0) == (0, 2)  # then the rarest B holds
    assert p.pick(A, 0) is None  # A's pipeline is full


def test_a_seeder_is_asked_for_a_few_seconds_of_what_it_delivers() -> None:
    p = PiecePicker([100], leaves_known=[0], piece_size=1000, rng=random.Random(0),
                    config=PickerConfig(pipeline=8, pipeline_start=2, queue_seconds=3.0, rate_window=10.0))
    p.update(A, 0, None)
    p.update(B, 0, None)
    assert p.limit(A, 0.0) == 2  # nothing measured yet
    for t in range(10):
        for peer, size in ((A, 2000), (B, 100)):  # A brings 2 pieces a second, B a tenth of one
            key = p.pick(peer, float(t))
            assert key is not None
            p.received(peer, key, float(t) + 0.5, size)
    assert p.limit(A, 10.0) == 6 and p.limit(B, 10.0) == 1
    assert p.limit(A, 100.0) == 2  # nothing lately: back to the start


def test_a_shards_leaves_come_before_any_of_its_pieces() -> None:
    p = PiecePicker([3], rng=random.Random(0))
    p.update(A, 0, None)
    assert p.pick(A, 0) == (0, LEAVES)
    assert p.pick(A, 0) is None  # no piece before the leaves are checked
    assert p.received(A, (0, LEAVES), 0.0)
    assert p.pick(A, 0) is not None and p.pick(A, 0) is not None


def test_shards_come_in_priority_order() -> None:
    p = picker([2, 2, 2], priority=[2, 0, 1])
    for s in range(3):
        p.update(A, s, None)
    picks = [p.pick(A, 0) for _ in range(4)]
    assert [k[0] for k in picks if k] == [1, 1, 2, 2]


def test_the_endgame_asks_a_second_seeder_for_pieces_in_flight_and_the_first_copy_wins() -> None:
    p = picker([2], config=PickerConfig(pipeline=4, pipeline_start=4, endgame_duplicates=2, endgame_pieces=1))
    p.update(A, 0, None)
    assert {p.pick(A, 0), p.pick(A, 0)} == {(0, 0), (0, 1)}
    p.update(B, 0, None)
    assert p.endgame
    assert p.pick(B, 0.5) is None  # the pieces in flight are not late yet: a duplicate would waste an upload
    dup = p.pick(B, 1.0)
    assert dup in {(0, 0), (0, 1)}
    p.update(C, 0, None)
    third = p.pick(C, 1.0)
    assert third is not None and third != dup  # each piece at most twice
    assert p.pick(C, 1.0) is None
    assert p.received(B, dup, 1.0) and not p.received(A, dup, 1.0)  # A's copy comes second: dropped
    assert not p.complete


def test_a_fast_seeder_doubles_a_late_piece_sooner_than_a_slow_one() -> None:
    p = PiecePicker([18], leaves_known=[0], piece_size=1000, rng=random.Random(0),
                    config=PickerConfig(pipeline=8, pipeline_start=8, endgame_patience=2.0, rate_window=10.0,
                                        endgame_pieces=1))
    for peer in (A, B, C):
        p.update(peer, 0, None)
    for t in range(8):  # B brings 1000 bytes a second, C 100
        for peer, size in ((B, 1000), (C, 100)):
            key = p.pick(peer, float(t))
            assert key is not None
            p.received(peer, key, float(t) + 0.5, size)
    slow = [p.pick(A, 8.0), p.pick(A, 8.0)]  # the last two pieces, asked of A at t=8
    assert all(slow) and p.endgame

    def first_double(peer: ID) -> float:
        for tenth in range(81, 400):
            if p.pick(peer, tenth / 10) is not None:
                return tenth / 10 - 8.0
        return float("inf")

    waited_b, waited_c = first_double(B), first_double(C)
    assert 2.0 <= waited_b <= 3.0 and waited_c > 3 * waited_b, (waited_b, waited_c)  # 2 of its own piece times


def test_the_last_few_pieces_are_doubled_at_once() -> None:
    p = picker([2], config=PickerConfig(pipeline=4, pipeline_start=4, endgame_pieces=4))
    p.update(A, 0, None)
    p.update(B, 0, None)
    assert {p.pick(A, 0), p.pick(A, 0)} == {(0, 0), (0, 1)}
    assert p.pick(B, 0) is not None  # two pieces missing, both in flight: no patience for the last few


def test_the_furthest_behind_is_served_first_when_uploads_wait() -> None:
    slots = UploadSlots(2)
    assert slots.enter(500) is None and slots.enter(900) is None  # two slots: granted at once
    ahead, behind, middle = slots.enter(950), slots.enter(100), slots.enter(400)
    assert ahead and behind and middle and slots.waiting == 3
    slots.withdraw(middle)
    assert slots.leave() == behind and slots.leave() == ahead
    assert slots.leave() is None and slots.busy == 1 and slots.waiting == 0


def test_no_piece_is_asked_twice_while_another_was_asked_of_nobody() -> None:
    p = picker([3])
    p.update(A, 0, [0])
    p.update(B, 0, [0, 1, 2])
    assert p.pick(A, 0) == (0, 0)
    p.update(C, 0, [0])
    assert not p.endgame and p.pick(C, 0) is None  # pieces 1 and 2 wait for B: no duplicate of piece 0 yet


def test_a_seeder_that_sends_a_bad_piece_is_banned_and_its_pieces_go_to_others() -> None:
    p = picker([2], config=PickerConfig(pipeline=2, pipeline_start=2))
    p.update(A, 0, None)
    p.update(B, 0, None)
    first = p.pick(A, 0)
    assert first is not None
    p.ban(A, "piece 0 does not match its hash")
    assert p.pick(A, 0) is None and p.banned() == {A: "piece 0 does not match its hash"}
    assert {p.pick(B, 0), p.pick(B, 0)} == {(0, 0), (0, 1)}
    p.lost(A)
    assert p.is_banned(A)  # losing its connection does not lift the ban


def test_a_failing_seeder_rests_and_a_lost_one_gives_its_pieces_back() -> None:
    p = picker([3, 3, 3], config=PickerConfig(pipeline=3, pipeline_start=3, max_failures=2, backoff=10.0))
    for shard in range(3):
        p.update(A, shard, None)
        p.update(B, shard, None)
    k1 = p.pick(A, 0)
    assert k1 is not None
    p.failed(A, k1, now=1.0)  # A says it has not got it: nothing of that shard asked of A again
    assert not any(k[0] == k1[0] for k in p.seeders[A].keys) and p.availability(k1, 1.0) == 1
    k2 = p.pick(A, 1.0)
    assert k2 is not None and k2[0] != k1[0]
    p.failed(A, k2, now=2.0)  # a second shard in a row: it rests
    assert p.pick(A, 3.0) is None and p.pick(A, 11.9) is None  # resting
    assert p.pick(A, 12.1) is not None
    k3 = p.pick(B, 12.1)
    p.lost(B)
    p.update(C, 0, None)
    assert k3 is not None and k3 not in p.requested  # asked of B, which is gone: back to be asked of others
    assert p.availability(k3, 12.1) >= 1 and B not in p.seeders


def test_a_seeder_whose_shard_changed_is_not_rested_for_the_answers_already_in_flight() -> None:
    """A creator whose one shard changed on disk answers "not held" to every request of it in flight:
    one failure, not one each (it rested 10 s, its other shards unasked, and a CI fetch took all from a
    slower seeder); its other shards are still asked of it. A piece returned unused costs nothing."""
    p = picker([4, 4], priority=[0, 1], config=PickerConfig(pipeline=4, pipeline_start=4, max_failures=2, backoff=10.0))
    for shard in (0, 1):
        p.update(A, shard, None)
        p.update(B, shard, None)
    asked = [p.pick(A, 0.0) for _ in range(4)]
    assert all(k is not None and k[0] == 0 for k in asked)  # the first shard first
    for key in asked:
        assert key is not None
        p.failed(A, key, now=1.0)
    assert p.seeders[A].resting_until <= 1.0 and p.seeders[A].failures == 1
    assert p.seeders[A].keys == {(1, i) for i in range(-1, 4)}
    assert all(k is not None and p.availability(k, 1.0) == 1 and k not in p.requested for k in asked)  # B's now
    other = p.pick(A, 1.0)
    assert other is not None and other[0] == 1
    p.returned(A, other)
    assert other in p.seeders[A].keys and p.seeders[A].failures == 1 and other not in p.requested
    assert p.pick(A, 1.0) is not None


# ---------------------------------------------------------------------- the seeder table and the pacer

def test_the_seeder_table_connects_whole_holders_first_and_backs_off() -> None:
    table = SeederTable(C, TableConfig(max_connected=2, retry=2.0, max_retry=5.0, relayed_retry=3.0),
                        random.Random(0))
    table.learn(A, whole=False)
    table.learn(B, whole=True)
    table.learn(C, whole=True)  # ourselves: never
    assert table.to_connect(0) == [B, A]
    assert table.to_connect(0) == []
    table.failed(A, 0.0, "reset")
    assert table.to_connect(1.0) == [] and table.to_connect(2.0) == [A]
    table.failed(A, 2.0, "reset")
    assert table.to_connect(5.9) == [] and table.to_connect(6.0) == [A]
    table.failed(A, 6.0, "reset")
    table.failed(A, 6.0, "reset")
    assert table.known[A].retry_at == 11.0  # capped at max_retry
    table.relayed(B, 0.0)
    assert table.state(B) == SeederState.RELAYED and table.to_connect(3.0) == [B]
    table.ban(B, "bad piece")
    table.failed(B, 3.0, "closed")
    assert table.state(B) == SeederState.BANNED and table.to_connect(100.0) == [A]


def test_the_pacer_holds_uploads_to_the_rate() -> None:
    pacer = Pacer(rate=1000.0, burst=500.0)
    assert pacer.delay(400, 0.0) == 0.0
    assert pacer.delay(600, 0.0) == pytest.approx(0.5)
    assert pacer.delay(1000, 0.5) == pytest.approx(1.0)  # the debt is carried
    assert Pacer(None).delay(10**9, 0.0) == 0.0




# ---------------------------------------------------------------------- the bookkeeping, after any events

PEERS = [ID(bytes([0, 36, 8, 1, 18, 32]) + bytes([i]) * 32) for i in range(10, 14)]
D = PEERS[3]
SHARDS = [3, 2, 4]


def check(p: PiecePicker) -> None:
    """What the picker's tables must agree on after every event."""
    asked = set(p.requested)
    assert p.missing == p.unasked | asked and not p.unasked & asked  # every missing piece: asked or not
    assert set(p.asked_at) == asked
    for key, askers in p.requested.items():
        assert askers and all(peer in p.seeders and key in p.seeders[peer].in_flight for peer in askers)
    holders: dict[tuple[int, int], int] = {}
    for peer, s in p.seeders.items():
        assert all(peer in p.requested.get(key, ()) for key in s.in_flight)
        assert not (s.banned is not None and s.in_flight)
        for shard in {k[0] for k in s.keys}:  # a shard's leaves key is held with its pieces, never alone
            assert (shard, LEAVES) in s.keys and any((shard, i) in s.keys for i in range(SHARDS[shard]))
        assert all(0 <= k[0] < len(SHARDS) and LEAVES <= k[1] < SHARDS[k[0]] for k in s.keys)
        if s.banned is None:
            for key in s.keys:
                holders[key] = holders.get(key, 0) + 1
    assert p.avail == holders


EVENTS = st.lists(st.one_of(
    st.tuples(st.just("update"), st.integers(0, 2), st.integers(-1, 3),
              st.one_of(st.none(), st.lists(st.integers(-2, 5), max_size=5))),
    st.tuples(st.just("pick"), st.integers(0, 3), st.floats(0.0, 5.0)),
    st.tuples(st.sampled_from(["received", "failed", "returned"]), st.integers(0, 3), st.integers(0, 7),
              st.integers(0, 3000)),
    st.tuples(st.just("unasked"), st.integers(0, 3), st.integers(0, 2), st.integers(-1, 3)),
    st.tuples(st.sampled_from(["lost", "ban"]), st.integers(0, 3)),
), min_size=20, max_size=80)


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(EVENTS)
def test_the_pickers_tables_agree_after_any_events(events: list[tuple[Any, ...]]) -> None:
    p = PiecePicker(SHARDS, held=[(0, 1)], leaves_known=[2], rng=random.Random(0), piece_size=1000,
                    config=PickerConfig(pipeline=3, pipeline_start=2, endgame_pieces=2, max_failures=2))
    now = 0.0
    check(p)
    for event in events:
        kind, peer = event[0], PEERS[event[1]]
        if kind == "update":
            p.update(peer, event[2], event[3])
        elif kind == "pick":
            now += event[2]
            key = p.pick(peer, now)
            assert key is None or (key in p.missing and key in p.seeders[peer].in_flight)
        elif kind == "unasked":  # a piece nobody asked it for (or one we hold)
            p.received(peer, (event[2], event[3]), now, 1000)
        elif kind in ("lost", "ban"):
            if kind == "lost":
                p.lost(peer)
            else:
                p.ban(peer, "bad piece")
                assert p.is_banned(peer) and p.pick(peer, now) is None
        else:
            flight = sorted(p.seeders[peer].in_flight) if peer in p.seeders else []
            if flight:
                key = flight[event[2] % len(flight)]
                if kind == "received":
                    assert p.received(peer, key, now, event[3])
                    assert p.holds(key) and key not in p.requested
                elif kind == "failed":
                    p.failed(peer, key, now)
                else:
                    p.returned(peer, key)
        check(p)
    assert p.complete == (not p.missing) and p.complete == all(p.shard_complete(s) for s in range(len(SHARDS)))


# ---------------------------------------------------------------------- the picker's rules at their edges

def test_a_shard_is_complete_with_its_leaves_and_every_piece() -> None:
    p = PiecePicker([2, 1], held=[(0, 0)], rng=random.Random(0))  # no shard's leaves known yet
    assert not p.shard_complete(0) and not p.holds((0, LEAVES)) and p.holds((0, 0)) and not p.holds((0, 1))
    assert p.received(A, (0, 1), 0.0)  # every piece, but not the leaves
    assert not p.shard_complete(0)
    assert p.received(A, (0, LEAVES), 0.0)
    assert p.shard_complete(0) and not p.shard_complete(1) and not p.complete
    assert not p.received(A, (0, LEAVES), 0.0)  # already had it
    assert PiecePicker([2], held=[(0, 0), (0, 1)]).shard_complete(0)  # held whole: its leaves are not needed


def test_a_piece_that_came_unasked_is_not_asked_for_again() -> None:
    p = picker([3])
    p.update(A, 0, None)
    assert p.received(B, (0, 1), 0.0, 1000)  # from a peer we never asked (and do not know)
    picks = [p.pick(A, 0.0) for _ in range(3)]
    assert sorted(k for k in picks if k) == [(0, 0), (0, 2)] and (0, 1) not in p.asked_at


def test_the_first_copy_takes_the_piece_out_of_every_seeders_requests() -> None:
    p = picker([1], config=PickerConfig(pipeline=2, pipeline_start=2, endgame_pieces=1, endgame_duplicates=2))
    for peer in (A, B):
        p.update(peer, 0, None)
    assert p.pick(A, 0.0) == (0, 0) and p.pick(B, 0.0) == (0, 0)  # the last piece: doubled at once
    assert p.received(B, (0, 0), 1.0)
    assert not p.seeders[A].in_flight and not p.seeders[B].in_flight and not p.requested and not p.asked_at
    assert not p.received(A, (0, 0), 1.5)


def test_the_endgame_doubles_the_least_asked_piece_first() -> None:
    p = picker([2], config=PickerConfig(pipeline=4, pipeline_start=4, endgame_pieces=2, endgame_duplicates=3))
    for peer in (A, B, C):
        p.update(peer, 0, None)
    assert {p.pick(A, 0.0), p.pick(A, 0.0)} == {(0, 0), (0, 1)}
    first = p.pick(B, 0.0)
    assert first is not None
    other = (0, 1 - first[1])
    assert p.pick(C, 0.0) == other  # asked of one seeder only, against the other's two
    assert p.pick(C, 0.0) == first  # then the other: at most three requests a piece


def test_the_classic_endgame_starts_at_exactly_endgame_pieces_missing() -> None:
    def doubled_at_once(missing: int, endgame_pieces: int) -> bool:
        p = picker([missing], config=PickerConfig(pipeline=8, pipeline_start=8, endgame_pieces=endgame_pieces))
        p.update(A, 0, None)
        p.update(B, 0, None)
        for _ in range(missing):
            assert p.pick(A, 0.0) is not None
        return p.pick(B, 0.0) is not None

    assert doubled_at_once(3, 3) and not doubled_at_once(4, 3)


def test_endgame_patience_is_two_piece_times_of_the_asker_but_at_least_a_second() -> None:
    def first_double(rate_pieces: float) -> float:
        """Seconds until B, which brought ``rate_pieces`` pieces a second, doubles A's late piece."""
        p = PiecePicker([40], leaves_known=[0], piece_size=1000, rng=random.Random(0),
                        config=PickerConfig(pipeline=40, pipeline_start=40, endgame_patience=2.0, endgame_pieces=1,
                                            rate_window=100.0))
        p.update(B, 0, None)
        for t in range(10):
            key = p.pick(B, 100.0 + t)
            assert key is not None and p.received(B, key, 100.0 + t + 0.5, int(1000 * rate_pieces))
        p.update(A, 0, None)
        while p.unasked:
            assert p.pick(A, 110.0) is not None or p.pick(B, 110.0) is not None
        for tenth in range(1, 200):
            if p.pick(B, 110.0 + tenth / 10) is not None:
                return tenth / 10
        return float("inf")

    # B's rate is what it brought over the time since it was first asked (10 s, and x more as it waits)
    assert first_double(10.0) == pytest.approx(1.0)  # 2 x 1000 B at 10000 / (10 + x) B/s is under a second
    assert first_double(0.4) == pytest.approx(10.0)  # 2 x 1000 B at 4000 / (10 + x) B/s: x >= (10 + x) / 2


def test_leaves_come_before_pieces_of_any_shard_whatever_its_priority() -> None:
    p = PiecePicker([2, 2], leaves_known=[0], priority=[0, 1], rng=random.Random(0),
                    config=PickerConfig(pipeline=1, pipeline_start=1))
    for shard in (0, 1):
        p.update(A, shard, None)
    assert p.pick(A, 0.0) == (1, LEAVES)  # the later shard's leaves: small, and they unlock its pieces


def test_what_a_seeder_holds_is_checked_against_the_dataset() -> None:
    p = picker([3, 2])
    p.update(A, 2, None)  # no shard 2
    p.update(A, -1, None)
    p.update(A, 1, [0, 2, 5, -1])  # shard 1 has pieces 0 and 1 only
    assert p.seeders[A].keys == {(1, 0), (1, LEAVES)}
    p.update(A, 0, [])  # holds nothing of shard 0: not even its leaves
    assert {k for k in p.seeders[A].keys if k[0] == 0} == set()
    assert p.limit(B, 0.0) == 0  # nobody we know of: nothing to ask
    assert p.availability((1, 0), 0.0) == 1 and p.availability((1, 1), 0.0) == 0


def test_a_seeders_rate_counts_the_last_window_over_at_least_a_second() -> None:
    p = PiecePicker([100], leaves_known=[0], piece_size=1000, rng=random.Random(0),
                    config=PickerConfig(pipeline=100, pipeline_start=2, queue_seconds=1.0, rate_window=10.0))
    p.update(A, 0, None)
    key = p.pick(A, 100.0)
    assert key is not None and p.received(A, key, 100.5, 5000)
    assert p.limit(A, 100.5) == 5  # 5000 B over a second (not the half second since it was asked)
    assert p.limit(A, 102.0) == 3  # 5000 B over 2 s
    assert p.limit(A, 110.5) == 1  # still in the window at exactly its end: 500 B/s, one piece at least
    assert p.limit(A, 110.6) == 2  # out of it: unknown again, pipeline_start


def test_a_delivery_ends_a_seeders_run_of_failures_and_a_rest_starts_a_new_one() -> None:
    p = picker([2, 2, 2, 2], config=PickerConfig(pipeline=1, pipeline_start=1, max_failures=2, backoff=10.0))
    for shard in range(4):
        p.update(A, shard, None)
    k = p.pick(A, 0.0)
    assert k is not None
    p.failed(A, k, 0.0)  # one shard not held
    k = p.pick(A, 0.0)
    assert k is not None and p.received(A, k, 0.0)  # a delivery: the run is over
    k = p.pick(A, 0.0)
    assert k is not None
    p.failed(A, k, 0.0)  # one in a new run: no rest
    assert p.pick(A, 0.0) is not None


def test_a_rest_resets_the_count() -> None:
    p = picker([1] * 5, config=PickerConfig(pipeline=1, pipeline_start=1, max_failures=2, backoff=10.0))
    for shard in range(5):
        p.update(A, shard, None)
    for t in (0.0, 0.0):
        k = p.pick(A, t)
        assert k is not None
        p.failed(A, k, t)
    assert p.pick(A, 9.9) is None  # two in a row: resting
    k = p.pick(A, 10.0)
    assert k is not None
    p.failed(A, k, 10.0)  # the first of a new run after the rest
    assert p.pick(A, 10.0) is not None


def test_ties_are_broken_by_the_random_source_given() -> None:
    """Equally rare pieces come in an order of the picker's own random source: the same source, the same
    order (a decision is a function of the state), another downloader's, another order."""
    def order(seed: int) -> list[tuple[int, int] | None]:
        p = PiecePicker([8], leaves_known=[0], rng=random.Random(seed), config=PickerConfig(pipeline=8, pipeline_start=8))
        p.update(A, 0, None)
        return [p.pick(A, 0.0) for _ in range(8)]

    assert order(5) == order(5) != order(6) and sorted(k for k in order(5) if k) == [(0, i) for i in range(8)]


def test_is_banned_of_a_peer_never_met_is_false() -> None:
    assert not picker([1]).is_banned(A)


# ---------------------------------------------------------------------- the table, the pacer, the slots at their edges

def test_the_table_fills_only_the_room_left_and_marks_whom_it_chose() -> None:
    table = SeederTable(C, TableConfig(max_connected=2), random.Random(0))
    table.connected(A)  # a seeder that connected to us (never learned from the tracker)
    assert table.state(A) == SeederState.CONNECTED and table.count(SeederState.CONNECTED) == 1
    for i in range(3):
        table.learn(PEERS[i], whole=False)
    chosen = table.to_connect(0.0)
    assert len(chosen) == 1 and table.count(SeederState.CONNECTED) == 2 and table.count(SeederState.KNOWN) == 2
    assert table.to_connect(0.0) == []
    assert table.state(B) is None  # never heard of


def test_the_table_spreads_over_seeders_by_its_random_source() -> None:
    def order(seed: int) -> list[ID]:
        table = SeederTable(C, TableConfig(max_connected=10), random.Random(seed))
        for peer in PEERS:
            table.learn(peer, whole=False)
        return table.to_connect(0.0)

    expected = list(PEERS)
    random.Random(7).shuffle(expected)
    assert order(7) == expected  # the source it was given, not a fresh one


def test_a_connection_clears_the_failures_and_the_relayed_wait_is_in_the_future() -> None:
    table = SeederTable(C, TableConfig(retry=2.0, max_retry=60.0, relayed_retry=3.0), random.Random(0))
    table.failed(A, 0.0, "reset")  # of a peer the table did not know yet
    table.failed(A, 2.0, "reset")
    assert table.known[A].retry_at == 2.0 + 4.0
    table.connected(A)
    assert (table.known[A].failures, table.known[A].why) == (0, "")
    table.failed(A, 10.0, "closed")
    assert table.known[A].retry_at == 12.0  # the first wait again
    table.relayed(B, 10.0)  # of a peer not known yet either
    assert (table.state(B), table.known[B].why) == (SeederState.RELAYED, "reached only through a relay")
    assert B not in table.to_connect(12.9) and B in table.to_connect(13.0)
    table.ban(D, "bad piece")
    assert table.state(D) == SeederState.BANNED and table.count(SeederState.BANNED) == 1



def test_the_pacers_burst_is_a_quarter_second_of_its_rate_and_time_refills_it() -> None:
    pacer = Pacer(rate=1000.0)
    assert pacer.delay(250, 50.0) == 0.0 and pacer.delay(1, 50.0) == pytest.approx(0.001)
    assert pacer.delay(100, 50.1) == pytest.approx(0.001)  # a tenth of a second refilled 100 of the 101 owed
    assert pacer.delay(0, 60.0) == 0.0 and pacer.delay(251, 60.0) == pytest.approx(0.001)  # full at the burst
    exact = Pacer(rate=1000.0, burst=500.5)
    assert exact.delay(500, 0.0) == 0.0  # half a byte left: no wait (and never a negative one)


def test_slots_take_waiters_in_order_of_what_they_hold_then_first_come() -> None:
    slots = UploadSlots(1)
    assert slots.enter(10) is None
    first, second, third = slots.enter(500), slots.enter(500), slots.enter(500)
    assert len({first, second, third}) == 3
    slots.withdraw(12345)  # a ticket nobody holds: nothing changes
    assert slots.waiting == 3
    assert [slots.leave(), slots.leave(), slots.leave()] == [first, second, third]
    many = UploadSlots(3)
    assert all(many.enter(0) is None for _ in range(3))
    assert many.leave() is None and many.busy == 2
