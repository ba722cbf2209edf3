"""The rules that fold the peers' progress reports into the run's (pure: no network)."""

from __future__ import annotations

import math

import pytest

from training.policy import CatchUp, Rules, Trainer, decide
from training.progress import MAX_CLOCK_SKEW, LocalProgress, global_progress, merge_reports, valid

NOW = 1_000_000.0


def rep(peer: str, step: int, samples: int, rate: float = 10.0, age: float = 1.0) -> LocalProgress:
    return LocalProgress(peer, step, samples, rate, NOW - age)


def test_samples_at_the_step_add_up_and_the_step_is_ready_at_the_target() -> None:
    p = global_progress([rep("a", 3, 40), rep("b", 3, 50), rep("c", 3, 0)], target=100, now=NOW)
    assert (p.step, p.samples, p.peers_at_step, p.peers, p.contributors) == (3, 90, 3, 3, 2)
    assert not p.ready and p.eta == pytest.approx(10 / 30)
    p = global_progress([rep("a", 3, 40), rep("b", 3, 60)], target=100, now=NOW)
    assert p.ready and p.eta == 0.0


def test_one_peer_cannot_move_the_step_or_trigger_one_alone() -> None:
    honest = [rep("a", 7, 10), rep("b", 7, 10), rep("c", 7, 10)]
    liar_ahead = rep("x", 10**9, 10**12, rate=1e30)
    p = global_progress([*honest, liar_ahead], target=100, now=NOW)
    assert p.step == 7 and not p.ready  # the lone claim of step 10**9 moves nobody
    liar_here = rep("x", 7, 10**12)
    p = global_progress([*honest[:1], liar_here], target=100, now=NOW)
    assert p.samples == 110  # capped at the target
    p = global_progress([rep("a", 7, 0), liar_here], target=100, now=NOW)
    assert not p.ready and p.contributors == 1  # two peers live: one contributor is not enough


def test_a_peer_alone_trains_alone() -> None:
    p = global_progress([rep("a", 2, 64)], target=64, now=NOW)
    assert p.quorum == 1 and p.ready and p.step == 2


def test_peers_that_moved_on_count_for_the_step_they_passed() -> None:
    # two peers finished step 4 and report 5; one is still at 4: the swarm is at 5
    p = global_progress([rep("a", 5, 0), rep("b", 5, 8), rep("c", 4, 30)], target=100, now=NOW)
    assert p.step == 5 and p.peers_at_step == 2 and p.samples == 8


@pytest.mark.parametrize("bad", [
    rep("x", -1, 5), rep("x", 1, -5), rep("x", 1, 5, rate=math.nan), rep("x", 1, 5, rate=-1.0),
    rep("x", 1, 5, age=-3600.0),  # from the future
    rep("x", 1, 5, age=120.0),    # expired
])
def test_unbelievable_reports_are_dropped(bad: LocalProgress) -> None:
    p = global_progress([rep("a", 1, 5), bad], target=100, now=NOW, expiration=60.0)
    assert p.peers == 1 and p.samples == 5


def test_an_empty_swarm_reads_as_our_own_step() -> None:
    p = global_progress([], target=10, now=NOW, local_step=12)
    assert p.step == 12 and p.samples == 0 and p.peers == 0 and not p.ready


def test_wire_roundtrip_and_garbage() -> None:
    r = rep("12D3KooWabc", 3, 40)
    assert LocalProgress.from_wire("12D3KooWabc", r.to_wire()) == r
    stepped = LocalProgress("a", 4, 8, 1.0, NOW, previous=72)  # it brought 72 samples to step 3
    assert LocalProgress.from_wire("a", stepped.to_wire()).previous == 72
    assert not valid(LocalProgress("a", 4, 8, 1.0, NOW, previous=-1), NOW, 60.0)
    with pytest.raises(ValueError, match="not a progress report"):
        LocalProgress.from_wire("x", b"\xff\xff\xff")


def test_reports_carry_loss_and_addresses_and_garbage_in_them_is_dropped() -> None:
    from multiaddr import Multiaddr

    from training.proto import training_pb2 as pb

    addr = Multiaddr("/ip4/127.0.0.1/tcp/4001")
    mine = LocalProgress("a", 3, 10, 5.0, NOW, loss=2.5, addrs=(addr,))
    back = LocalProgress.from_wire("a", mine.to_wire())
    assert back.loss == 2.5 and back.addrs == (addr,)
    raw = pb.Progress(step=1, samples=1, time=NOW, loss=float("nan"), addrs=[b"\xff\xfe garbage", addr.to_bytes()])
    odd = LocalProgress.from_wire("b", raw.SerializeToString())
    assert odd.loss is None and odd.addrs == (addr,)  # NaN loss unknown, a garbled address dropped
    assert LocalProgress.from_wire("c", pb.Progress(step=1).SerializeToString()).loss is None  # none given
    p = global_progress([LocalProgress("a", 3, 10, 1.0, NOW, loss=2.0), LocalProgress("b", 3, 10, 1.0, NOW, loss=4.0),
                         LocalProgress("c", 3, 10, 1.0, NOW)], target=100, now=NOW)
    assert p.loss == pytest.approx(3.0)  # the mean of those that report one
    assert global_progress([rep("a", 3, 10)], target=100, now=NOW).loss is None


def test_our_own_report_counts_when_the_dht_did_not_give_it_back() -> None:
    # a peer alone whose report no replica returned (it stored nowhere yet) still reaches its target;
    # before, it read an empty swarm with nothing done and never stepped
    mine = rep("me", 1, 64)
    p = global_progress([], target=64, now=NOW, local_step=1, own=mine)
    assert p.step == 1 and p.samples == 64 and p.peers == 1 and p.ready
    # with the others' reports: ours is added once, not twice
    p = global_progress([rep("a", 1, 10), mine], target=100, now=NOW, own=mine)
    assert p.peers == 2 and p.samples == 74
    p = global_progress([rep("a", 1, 10)], target=100, now=NOW, own=mine)
    assert p.peers == 2 and p.samples == 74 and p.contributors == 2


def test_the_progress_line_never_shows_more_than_its_whole() -> None:
    """A step that overshoots its target (512 samples toward 128) reads full, not ``512/128``."""
    from training.events import TrainingStatus, bar, count

    assert count(512, 128) == "128/128" and count(64, 128) == "64/128"
    assert bar(512, 128, width=8) == "[########]" and bar(32, 128, width=8) == "[##......]" and bar(5, 0, width=4) == "[....]"
    line = TrainingStatus(step=3, target=128, swarm_samples=512, samples_per_second=10.0, swarm_samples_per_second=40.0,
                          loss=4.25, swarm_loss=4.5, peers=2, eta=0.0, local_samples=100).human()
    assert " 128/128 " in line and "512" not in line and "loss 4.250 (swarm 4.500)" in line and "next step now" in line


def test_every_field_of_a_report_crosses_the_wire() -> None:
    full = LocalProgress("a", 4, 8, 2.5, NOW, client=True, loss=1.25, auxiliary=True, sender=True, previous=72)
    assert LocalProgress.from_wire("a", full.to_wire()) == full


def test_a_report_is_believed_up_to_its_bounds() -> None:
    assert valid(rep("a", 0, 0, rate=0.0), NOW, 60.0)  # a peer that has just joined: nothing yet
    assert valid(rep("a", 1, 5, rate=0.5), NOW, 60.0)
    assert valid(rep("a", 1, 5, age=60.0), NOW, 60.0)  # exactly as old as the expiration
    assert valid(rep("a", 1, 5, age=-MAX_CLOCK_SKEW), NOW, 60.0)  # as far ahead as clocks may be
    assert not valid(rep("a", 1, 5, rate=math.inf), NOW, 60.0)
    assert not valid(LocalProgress("a", 1, 5, 1.0, math.nan), NOW, 60.0)


def test_an_empty_swarm_without_a_step_of_our_own_is_at_step_zero() -> None:
    p = global_progress([], target=10, now=NOW)
    assert (p.step, p.samples, p.peers, p.quorum, p.time) == (0, 0, 0, 1, NOW) and not p.ready


def test_our_local_step_counts_only_while_nobody_reports() -> None:
    assert global_progress([rep("a", 5, 1)], target=10, now=NOW, local_step=2).step == 5


def test_the_swarm_s_rate_caps_each_peer_and_one_sample_makes_a_contributor() -> None:
    p = global_progress([rep("a", 7, 1), rep("b", 7, 0), rep("x", 7, 0, rate=1e30)], target=100, now=NOW)
    assert p.samples_per_second == 1e12 + 20.0 and p.contributors == 1


def test_sources_are_the_dialable_peers_at_the_step_or_past_it_freshest_first() -> None:
    reports = [rep("old", 3, 1, age=30.0), rep("new", 4, 1, age=1.0), rep("mid", 3, 1, age=10.0),
               rep("behind", 2, 1, age=0.5), LocalProgress("client", 3, 1, 1.0, NOW, client=True),
               LocalProgress("helper", 3, 0, 0.0, NOW, auxiliary=True)]
    p = global_progress(reports, target=100, now=NOW)
    assert p.step == 3 and p.sources == ("new", "mid", "old")


def test_the_round_waits_for_peers_and_auxiliaries_at_the_step_or_one_behind() -> None:
    reports = [rep("a", 5, 1), rep("b", 5, 1), rep("c", 4, 1), rep("d", 3, 1),
               LocalProgress("h1", 5, 0, 0.0, NOW, auxiliary=True), LocalProgress("h2", 4, 0, 0.0, NOW, auxiliary=True),
               LocalProgress("h3", 3, 0, 0.0, NOW, auxiliary=True), LocalProgress("h4", 6, 0, 0.0, NOW, auxiliary=True)]
    p = global_progress(reports, target=100, now=NOW)
    assert (p.step, p.peers, p.peers_at_step, p.peers_near_step, p.auxiliaries) == (5, 4, 2, 3, 2)
    assert p.expected == 3 + 2


def test_reports_expire_after_a_minute_by_default() -> None:
    assert global_progress([rep("a", 1, 5, age=60.5), rep("b", 1, 5, age=59.5)], target=10, now=NOW).peers == 1


def test_our_newer_report_beats_an_older_copy_the_dht_gave_back() -> None:
    # the reads keep a report until it expires (merge_reports): ours from a step ago must not win
    old, mine = rep("me", 1, 64, age=5.0), rep("me", 2, 8, age=1.0)
    p = global_progress([old, rep("a", 2, 10)], target=100, now=NOW, own=mine)
    assert p.step == 2 and p.samples == 18 and p.peers == 2
    # and a copy newer than what we hold (we reported again since) is the DHT's to give
    p = global_progress([mine, rep("a", 2, 10)], target=100, now=NOW, own=old)
    assert p.step == 2 and p.samples == 18
    # a copy as new as ours is ours as we last published it: what we hold wins the tie
    twin = LocalProgress("me", 2, 50, 10.0, mine.time)
    assert global_progress([twin, rep("a", 2, 10)], target=100, now=NOW, own=mine).samples == 18


def test_a_read_that_missed_a_live_report_keeps_it_until_it_expires() -> None:
    # a read that found only our own report folded into a swarm of one: quorum 1, and a peer with a
    # whole target stepped alone while the other waited (the GPU bench, 1 synchronous run in 12)
    a1, b1 = rep("a", 0, 0, age=3.0), rep("b", 0, 32, age=2.0)
    kept = merge_reports([a1, b1], [b1], now=NOW, expiration=60.0)
    assert sorted(kept, key=lambda r: r.peer_id) == [a1, b1]
    assert not global_progress(kept, target=32, now=NOW).ready  # a's vote still counts: no step alone
    # each peer's newest wins, from either side, and only once
    a2 = rep("a", 1, 8, age=1.0)
    assert sorted(merge_reports([a1, b1], [a2], NOW, 60.0), key=lambda r: r.peer_id) == [a2, b1]
    assert sorted(merge_reports([a2, b1], [a1, b1], NOW, 60.0), key=lambda r: r.peer_id) == [a2, b1]
    # a tie keeps what was known
    twin = LocalProgress("a", 1, 99, 10.0, a2.time)
    assert merge_reports([a2], [twin], NOW, 60.0) == [a2]
    # an expired report goes, known or read: the DHT would not return it either
    assert merge_reports([rep("a", 0, 0, age=61.0)], [rep("b", 0, 0, age=60.5)], NOW, 60.0) == []
    assert merge_reports([rep("a", 0, 0, age=59.0)], [], NOW, 60.0) != []


# ---------------------------------------------------------------------- archives (a backbone's checkpoint)


def archive(peer: str, step: int, age: float = 1.0, client: bool = False) -> LocalProgress:
    return LocalProgress(peer, step, 0, 0.0, NOW - age, client, archive=True)  # type: ignore[arg-type]


def test_a_trusted_archive_ahead_of_every_live_peer_by_more_than_a_step_is_the_run_s_step_and_source() -> None:
    """Every trainer left; one joins at step 0 (or is alone, behind): the backbone's checkpoint of step 120
    is where the run is, and the backbone the one to take it from, with nothing done toward it yet."""
    alone = rep("a", 0, 30)
    for reports, local in (([], 0), ([alone], None)):
        p = global_progress(reports, target=100, now=NOW, local_step=local,
                            archives=[archive("b", 120), archive("c", 110, age=0.5)])
        assert (p.step, p.sources, p.samples, p.peers_at_step, p.contributors) == (120, ("b",), 0, 0, 0)
        assert not p.ready
        for delayed in (False, True):  # the trainer takes it there, with or without delayed updates
            decision = decide(Trainer("a", 0, 30), p, reports, NOW, Rules(delay_updates=delayed))  # type: ignore[arg-type]
            assert decision.action == CatchUp(p)
    # nothing known of the swarm, nor of our own step: step 0 is where it stands
    assert global_progress([], target=100, now=NOW, archives=[archive("b", 2)]).step == 2
    assert global_progress([], target=100, now=NOW, archives=[archive("b", 1)]).step == 0
    # two archives at the step: the freshest report first
    p = global_progress([alone], target=100, now=NOW, archives=[archive("b", 120, age=3), archive("c", 120, age=2)])
    assert p.sources == ("c", "b")
    # a swarm of two peers at different steps: behind the archive only if the furthest of them is
    p = global_progress([rep("a", 2, 0), rep("d", 118, 0)], target=100, now=NOW, archives=[archive("b", 120)])
    assert p.step == 120 and p.sources == ("b",)
    p = global_progress([rep("a", 2, 0), rep("d", 119, 0)], target=100, now=NOW, archives=[archive("b", 120)])
    assert p.step == 2 and "b" not in p.sources


@pytest.mark.parametrize("live_step", [119, 120, 125])
def test_an_archive_within_a_step_of_the_swarm_or_behind_it_changes_nothing(live_step: int) -> None:
    """During a run the backbone saves the state some live peer holds: at most a step ahead of the others
    (its source moved on as it saved), never a reason to drop their samples."""
    reports = [rep("a", live_step, 40), rep("d", live_step, 50)]
    with_archive = global_progress(reports, target=100, now=NOW, archives=[archive("b", 120)])
    assert with_archive == global_progress(reports, target=100, now=NOW)


def test_an_archive_is_nobody_s_word_unless_passed_as_trusted_and_is_never_a_live_peer() -> None:
    reports = [rep("a", 3, 40), archive("x", 10**9)]
    p = global_progress(reports, target=100, now=NOW)  # an archive among the reports: not trusted
    assert (p.step, p.peers, p.sources) == (3, 1, ("a",))
    p = global_progress([rep("a", 3, 40)], target=100, now=NOW, own=archive("a", 50))  # our own archive report
    assert (p.step, p.peers) == (3, 1)
    p = global_progress([], target=100, now=NOW, own=archive("b", 50), local_step=None)
    assert p.peers == 0 and p.step == 0


@pytest.mark.parametrize("bad", [archive("b", 120, age=120.0), archive("b", 120, client=True),
                                 LocalProgress("b", 120, 0, 0.0, NOW - 1)],  # type: ignore[arg-type]
                         ids=["expired", "client", "not-an-archive"])
def test_an_archive_that_expired_cannot_be_dialed_or_is_not_one_is_not_taken(bad: LocalProgress) -> None:
    p = global_progress([rep("a", 0, 0)], target=100, now=NOW, expiration=60.0, archives=[bad])
    assert p.step == 0 and "b" not in p.sources


def test_the_archive_flag_crosses_the_wire() -> None:
    from p2p.identity import new_identity, peer_id_of

    me = peer_id_of(new_identity())
    sent = LocalProgress(me, 120, 0, 0.0, NOW, archive=True)
    assert LocalProgress.from_wire(me, sent.to_wire()) == sent
    assert not LocalProgress.from_wire(me, LocalProgress(me, 1, 2, 3.0, NOW).to_wire()).archive


# ---------------------------------------------------------------------- a peer's last word: it left


def left(peer: str, step: int, age: float = 0.5, archive: bool = False) -> LocalProgress:
    return LocalProgress(peer, step, 0, 0.0, NOW - age, archive=archive, left=True)  # type: ignore[arg-type]


def test_a_peer_that_left_counts_no_more_at_once_not_when_its_report_expires() -> None:
    """Its samples no longer fill the batch, its vote no longer holds the step, it is no source of state:
    else, for the minute its report lives, the swarm steps without it or waits for its samples."""
    a, b = rep("a", 3, 40, age=2.0), rep("b", 3, 60, age=2.0)
    assert global_progress([a, b], target=100, now=NOW).ready
    known = merge_reports([a, b], [a, left("b", 3)], NOW, 60.0)
    p = global_progress(known, target=100, now=NOW)
    assert (p.peers, p.samples, p.sources, p.ready) == (1, 40, ("a",), False)
    # a later read that finds only the older copy (a replica that missed the last store) brings it not back
    assert global_progress(merge_reports(known, [a, b], NOW, 60.0), target=100, now=NOW).peers == 1
    # it came back: a report newer than its last word counts again
    back = rep("b", 3, 10, age=0.1)
    assert global_progress(merge_reports(known, [back], NOW, 60.0), target=100, now=NOW).samples == 50
    # a last word as old as a report wins the tie, whichever was known first
    twin = LocalProgress("b", 3, 60, 10.0, NOW - 0.5)  # type: ignore[arg-type]
    for first, then in (([twin], [left("b", 3)]), ([left("b", 3)], [twin])):
        assert [r.left for r in merge_reports(first, then, NOW, 60.0)] == [True]
    # our own last word: we are not in the swarm we read
    p = global_progress([a, b], target=100, now=NOW, own=left("b", 3, age=1.0))
    assert (p.peers, p.samples) == (1, 40)


def test_the_swarm_that_every_trainer_left_is_behind_the_archive_at_once_and_a_backbone_that_left_is_none() -> None:
    gone = [left("a", 120), left("d", 120)]
    p = global_progress(gone, target=100, now=NOW, local_step=0, archives=[archive("b", 120)])
    assert (p.step, p.sources) == (120, ("b",))
    p = global_progress([rep("a", 0, 0)], target=100, now=NOW, archives=[left("b", 120, archive=True)])
    assert p.step == 0 and p.sources == ("a",)


def test_present_keeps_the_peers_still_in_the_run_and_the_left_flag_crosses_the_wire() -> None:
    from p2p.identity import new_identity, peer_id_of
    from training.progress import present

    assert present([rep("a", 1, 1), left("b", 1)]) == [rep("a", 1, 1)]
    me = peer_id_of(new_identity())
    sent = LocalProgress(me, 4, 0, 0.0, NOW, left=True)
    assert LocalProgress.from_wire(me, sent.to_wire()) == sent


def test_an_observer_reads_a_run_every_trainer_left_at_the_step_they_left_it() -> None:
    """A backbone (no step of its own) reads the run where its trainers left it, not back at step 0; a
    trainer that joins goes on from its own step (or an archive), never from a step nobody holds."""
    gone = [left("a", 9), left("b", 10), LocalProgress("x", 50, 0, 0.0, NOW, auxiliary=True, left=True)]  # type: ignore[arg-type]
    p = global_progress(gone, target=100, now=NOW)
    assert (p.step, p.peers, p.samples, p.sources, p.ready) == (10, 0, 0, (), False)  # an auxiliary has no vote
    assert global_progress(gone, target=100, now=NOW, seen=12).step == 12  # what we read before they left
    assert global_progress(gone, target=100, now=NOW, seen=3).step == 10
    assert global_progress([], target=100, now=NOW, seen=7).step == 7  # their last words expired too
    assert global_progress(gone, target=100, now=NOW, local_step=0).step == 0  # a trainer: its own step
    # anybody still training: the reports decide, the last words and the memory not
    assert global_progress([*gone, rep("c", 2, 5)], target=100, now=NOW, seen=12).step == 2
    assert global_progress(gone, target=100, now=NOW, own=left("b", 11)).step == 11  # our own last word too
