"""The step policy (training/policy.py), pure: every row of its table and every rule asked mid-step,
each incident that shaped the optimizer a scenario (its commit named), in milliseconds, no network.

The real-network counterparts stay in tests/test_training.py (equivalence with one process, late
joiner, a peer dying mid-round, delayed updates, auxiliary peers) and tests/test_training_lab.py.
"""

from __future__ import annotations

import math

import pytest
from libp2p.peer.id import ID

from p2p.errors import ConfigError
from training.optimizer import TrainingConfig

from training.policy import (AverageStep, CatchUp, JoinBegunRound, Rules, TakeStateFromAhead, Trainer, Wait,
                             assist_due, decide, estimate, expected_group, join_after_catch_up, left_behind,
                             missed_without_group, needs_read, round_began, state_wanted, stuck_ahead)
from training.progress import GlobalProgress, LocalProgress, global_progress

NOW = 1_000_000.0  # unix time of the reports
T = 500.0  # the trainer's (monotonic) clock
TARGET = 100
ME, A, B, C = (ID(f"peer-{name}".encode()) for name in "mabc")
SYNC, DELAYED = Rules(), Rules(delay_updates=True)


def rep(peer: ID, step: int, samples: int = 0, *, client: bool = False, auxiliary: bool = False,
        sender: bool = False, age: float = 1.0) -> LocalProgress:
    return LocalProgress(peer, step, samples, 10.0, NOW - age, client=client, auxiliary=auxiliary, sender=sender)


def swarm(*reports: LocalProgress) -> tuple[GlobalProgress, list[LocalProgress]]:
    return global_progress(reports, TARGET, NOW), list(reports)


def me(step: int, samples: int = 0, **kw: object) -> Trainer:
    kw.setdefault("fresh", False)
    return Trainer(ME, step, samples, reported_samples=samples, **kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- the table, row by row


def test_idle_a_step_short_of_its_samples_waits() -> None:
    progress, reports = swarm(rep(ME, 3, 40), rep(A, 3, 30))
    decision = decide(me(3, 40), progress, reports, T, SYNC)
    assert decision == type(decision)(Wait(), None, None)


def test_ready_averages_with_every_peer_at_the_step_and_catches_up_if_missed() -> None:
    progress, reports = swarm(rep(ME, 3, 60), rep(A, 3, 50), rep(B, 2, 10))
    action = decide(me(3, 60), progress, reports, T, SYNC).action
    # B finishes step 2 and will be at step 3 in a moment: the round waits for it too
    assert action == AverageStep(progress, expected=3, catch_up_if_missed=True)
    # with delayed updates a missed round is repaired by the next call, not at once
    action = decide(me(3, 60), progress, reports, T, DELAYED).action
    assert isinstance(action, AverageStep) and not action.catch_up_if_missed


def test_a_lone_peer_steps_on_its_own_report() -> None:
    """b39edd6: a lone peer whose own report the DHT did not return read an empty swarm and never
    stepped; its own report always counts."""
    own = rep(ME, 0, 100)
    progress = global_progress([], TARGET, NOW, own=own)
    assert isinstance(decide(me(0, 100), progress, [], T, SYNC).action, AverageStep)


def test_behind_the_swarm_catches_up() -> None:
    """2e22d0b: a peer that joins late or missed a round downloads the state."""
    progress, reports = swarm(rep(A, 7, 10), rep(B, 7, 10), rep(ME, 2, 0))
    assert decide(me(2), progress, reports, T, SYNC).action == CatchUp(progress)
    assert state_wanted(me(2), progress, SYNC) == 7


def test_a_missed_round_is_repaired_with_the_state_past_it() -> None:
    """The swarm stepped without us: the next call takes the state of the step after the missed one
    (with delayed updates our step already is that one)."""
    progress, reports = swarm(rep(A, 4, 10), rep(ME, 4, 0))
    trainer = me(4, missed_at=T)
    assert decide(trainer, progress, reports, T, SYNC).action == CatchUp(progress)
    assert state_wanted(trainer, progress, SYNC) == 5
    assert state_wanted(trainer, progress, DELAYED) == 4
    # and a missed round overrides joining a begun one
    progress, reports = swarm(rep(A, 5, 10), rep(B, 5, 10), rep(ME, 4, 10))
    assert decide(me(4, 10, missed_at=T), progress, reports, T, DELAYED).action == CatchUp(progress)


def test_a_round_missed_for_a_lone_client_ahead_is_moot_after_rejoin_after() -> None:
    """The demo in CI, 2026-12-03: a client stepped alone before it saw the swarm; the two servers
    at step 0 saw it ahead, each missed its round, and asked the other for step 1's state, refused
    ("at step 0, behind 1") until the run ended. After ``rejoin_after`` with nobody that could
    serve the state past the round, the miss is moot: they average their step."""
    progress, reports = swarm(rep(ME, 0, 60), rep(A, 0, 50), rep(B, 1, 0, client=True))
    assert progress.step == 0 and progress.ready
    trainer = me(0, 60, missed_at=T - 9)
    # at first the report ahead may be the first of a group's: take the state past the round
    decision = decide(trainer, progress, reports, T, SYNC)
    assert decision.action == CatchUp(progress) and decision.missed_at == T - 9
    assert state_wanted(trainer, progress, SYNC) == 1
    # rejoin_after later, still only the client is ahead: the miss is forgotten, the step goes on
    decision = decide(trainer, progress, reports, T + 1, SYNC)
    assert decision.action == AverageStep(progress, expected=2, catch_up_if_missed=True)
    assert decision.missed_at is None
    # a peer that can serve the state past the round holds it: catch up, however long it took
    for ahead in (rep(C, 1, 0), rep(C, 2, 0)):
        progress, reports = swarm(rep(ME, 0, 60), rep(A, 0, 50), rep(B, 1, 0, client=True), ahead)
        decision = decide(trainer, progress, reports, T + 60, SYNC)
        assert isinstance(decision.action, CatchUp) and decision.missed_at == T - 9
    # an auxiliary peer ahead serves no state either
    progress, reports = swarm(rep(ME, 0, 60), rep(A, 0, 50), rep(C, 1, auxiliary=True))
    assert decide(trainer, progress, reports, T + 1, SYNC).missed_at is None
    # with delayed updates the state wanted is our step's: a server at it holds it
    progress, reports = swarm(rep(ME, 3, 60), rep(A, 3, 50), rep(B, 4, 0, client=True))
    assert isinstance(decide(me(3, 60, missed_at=T - 60), progress, reports, T, DELAYED).action, CatchUp)
    # behind the swarm's step, a download is due whatever the miss
    progress, reports = swarm(rep(ME, 0, 60), rep(A, 1, 0), rep(B, 1, 0, client=True))
    decision = decide(trainer, progress, reports, T + 60, SYNC)
    assert decision.action == CatchUp(progress) and decision.missed_at == T - 9


def test_delayed_updates_join_the_round_the_others_began() -> None:
    """b2a5359: with delayed updates a trainer whose partner began the step's round (and took its
    samples out of the count) joins it, instead of waiting ``rejoin_after`` and taking a state
    that lacks this very step."""
    # the partner moved on to step 4 as it began step 3's round; the quorum still reads step 3
    progress, reports = swarm(rep(ME, 3, 30), rep(A, 4, 0))
    assert progress.step == 3 and not progress.ready
    assert round_began(me(3, 30), progress, reports)
    action = decide(me(3, 30), progress, reports, T, DELAYED).action
    assert action == JoinBegunRound(progress, expected=2)
    # without samples of ours there is nothing to join with: not a begun round
    assert not round_began(me(3, 0), progress, reports)
    # without delayed updates the same reports are no sign to join
    assert isinstance(decide(me(3, 30), progress, reports, T, SYNC).action, Wait)


def test_delayed_updates_join_when_the_swarm_is_one_step_on_at_every_step() -> None:
    """b84fa0f: the join-the-begun-round rule holds at every step, not only the first."""
    for step in (0, 1, 5, 40):
        progress, reports = swarm(rep(A, step + 1, 0), rep(B, step + 1, 0), rep(ME, step, 20))
        assert progress.step == step + 1
        action = decide(me(step, 20), progress, reports, T, DELAYED).action
        assert isinstance(action, JoinBegunRound), step
        assert isinstance(decide(me(step, 20), progress, reports, T, SYNC).action, CatchUp)


def test_stuck_without_quorum_takes_the_state_of_the_peer_ahead_after_rejoin_after() -> None:
    """1c87e59: peers that stepped alone before they met ended at different steps; the quorum rule
    left the one behind waiting for a quorum that never came (they deadlocked). With the samples
    but not the quorum for ``rejoin_after``, it takes the state of the peer furthest ahead."""
    rules = Rules(rejoin_after=10.0)
    progress, reports = swarm(rep(ME, 3, 100), rep(A, 5, 0, age=2.0))
    assert progress.step == 3 and progress.samples >= TARGET and progress.contributors < progress.quorum
    first = decide(me(3, 100), progress, reports, T, rules)
    assert first.action == Wait() and first.stuck_since == T
    later = decide(me(3, 100, stuck_since=T), progress, reports, T + 9.9, rules)
    assert later.action == Wait() and later.stuck_since == T
    due = decide(me(3, 100, stuck_since=T), progress, reports, T + 10.0, rules)
    assert isinstance(due.action, TakeStateFromAhead)
    assert due.action.progress.step == 5 and due.action.behind == 3
    assert due.action.progress.sources == (A,)


def test_a_fresh_peer_follows_a_lone_peer_ahead_at_once() -> None:
    """A peer that never took a step does not wait ``rejoin_after``; with delayed updates a peer
    one step ahead is the usual moment of a round, not a peer that went on without us."""
    progress, reports = swarm(rep(ME, 0, 10), rep(A, 2, 0))
    action = decide(me(0, 10, fresh=True), progress, reports, T, SYNC).action
    assert isinstance(action, TakeStateFromAhead) and action.progress.step == 2
    progress, reports = swarm(rep(ME, 0, 10), rep(A, 1, 0))
    assert stuck_ahead(me(0, 10, fresh=True), progress, reports, T, DELAYED) == (None, None)


def test_stuck_but_a_download_failed_a_moment_ago_steps_or_waits() -> None:
    progress, reports = swarm(rep(ME, 3, 100), rep(A, 5, 0))
    decision = decide(me(3, 100, stuck_since=T - 60, next_download=T + 5), progress, reports, T, SYNC)
    assert decision.action == Wait() and decision.stuck_since == T - 60


def test_no_longer_stuck_forgets_since_when() -> None:
    progress, reports = swarm(rep(ME, 3, 40), rep(A, 3, 40))
    assert decide(me(3, 40, stuck_since=T - 5), progress, reports, T, SYNC).stuck_since is None


def test_a_round_still_running_in_the_background_is_not_stuck() -> None:
    progress, reports = swarm(rep(ME, 3, 100), rep(A, 6, 0))
    assert stuck_ahead(me(3, 100, pending=True), progress, reports, T, SYNC) == (None, None)


# ---------------------------------------------------------------------------- rules asked mid-step


def test_the_progress_is_read_again_when_our_samples_may_complete_the_step() -> None:
    progress, _ = swarm(rep(ME, 3, 20), rep(A, 3, 50))
    trainer = Trainer(ME, 3, samples=60, reported_samples=20)
    assert estimate(trainer, progress) == 110 and needs_read(trainer, progress)
    assert not needs_read(Trainer(ME, 3, samples=25, reported_samples=20), progress)
    assert needs_read(Trainer(ME, 4, samples=0), progress) and needs_read(trainer, None)


def test_a_peer_whose_samples_count_in_full_reads_again_only_every_reread_interval() -> None:
    # a peer waiting at its step with a whole target's samples read (and reported) after every 4 ms
    # batch: 1,021 times in 15 s; a replica takes 1,000 stores a minute from one peer
    progress, _ = swarm(rep(ME, 3, TARGET), rep(A, 3, 0))
    full = Trainer(ME, 3, samples=TARGET + 8, reported_samples=TARGET)
    assert not needs_read(full, progress, 0.05, SYNC) and needs_read(full, progress, 0.1, SYNC)
    assert needs_read(full, progress, 0.01, Rules(reread_interval=0.0))
    # samples that still add to our count may complete the step: read at once
    progress, _ = swarm(rep(ME, 3, 20), rep(A, 3, 90))
    assert needs_read(Trainer(ME, 3, samples=30, reported_samples=20), progress, 0.0, SYNC)
    assert needs_read(Trainer(ME, 3, samples=TARGET, reported_samples=TARGET - 1), progress, 0.0, SYNC)
    # as at once as ever: another step's progress, or none yet; and short of the target, never
    assert needs_read(Trainer(ME, 4, samples=TARGET), progress, 0.0, SYNC) and needs_read(full, None, 0.0, SYNC)
    short, _ = swarm(rep(ME, 3, 5), rep(A, 3, 50))
    assert not needs_read(Trainer(ME, 3, samples=5, reported_samples=5), short, 99.0, SYNC)


def test_expected_group_counts_the_peers_finishing_the_step_before_and_with_delay_those_ahead() -> None:
    progress, reports = swarm(rep(ME, 3, 10), rep(A, 3, 10), rep(B, 2, 10), rep(C, 4, 10))
    assert expected_group(3, progress, reports, ME, SYNC) == 3
    assert expected_group(3, progress, reports, ME, DELAYED) == 4


def test_the_swarm_left_the_round_when_only_we_are_at_its_step() -> None:
    reports = [rep(A, 4), rep(B, 4), rep(C, 3, auxiliary=True)]
    assert left_behind(3, reports, ME, reduces=True, rules=SYNC)  # an auxiliary peer alone holds no round
    assert not left_behind(3, [rep(A, 4), rep(B, 3)], ME, reduces=True, rules=SYNC)
    assert not left_behind(3, [rep(A, 3), rep(B, 3)], ME, reduces=True, rules=SYNC)  # nobody went on
    # with delayed updates peers one step on are still in the round (they moved on as it began)
    assert not left_behind(3, [rep(A, 4), rep(B, 4)], ME, reduces=True, rules=DELAYED)
    assert left_behind(3, [rep(A, 5), rep(B, 5)], ME, reduces=True, rules=DELAYED)


def test_two_late_senders_are_left_behind_at_once() -> None:
    """e6ec15f: two late peers behind NATs (senders: neither may reduce) at step 0 while the swarm
    went on: no group of them can ever form, so each is left behind at once, not after the
    matchmaking timeout (seen in the NAT lab demo: 30 s at step 0 while the others took 80 steps).
    A peer that may reduce, or a partner that may, can still form a group: not left behind.
    (Moved here from tests/test_training.py, which ran the same table through an optimizer.)"""
    for reduces, partner_sends, aux_at_step, left in [
        (False, True, False, True),  # two senders at the step: nobody can reduce
        (False, False, False, False),  # the partner may reduce: a group can form
        (True, True, False, False),  # we may reduce
        (False, True, True, False),  # an auxiliary peer at the step reduces for us
    ]:
        reports = [rep(A, 3), rep(B, 0, sender=partner_sends)]
        if aux_at_step:
            reports.append(rep(C, 0, auxiliary=True))
        assert left_behind(0, reports, ME, reduces, SYNC) is left, (reduces, partner_sends, aux_at_step)
        # nobody ahead: never left
        assert not left_behind(0, [rep(B, 0, sender=partner_sends)], ME, reduces, SYNC)


def test_no_group_while_the_others_stepped_is_a_missed_round_else_a_lone_step() -> None:
    """1c87e59: a group that cannot form is reported; stepping alone while the others took the step
    together would set us apart for good, so that case is a missed round (take their state)."""
    assert missed_without_group(3, [rep(A, 4), rep(ME, 3)], ME)
    assert not missed_without_group(3, [rep(A, 3), rep(ME, 9)], ME)


def test_after_a_download_a_gathering_round_is_joined_at_once() -> None:
    """2fa6bdb: trainers behind port-changing and symmetric NATs took the state, computed a batch,
    and came to the round as the others left it, step after step; now they join it at once."""
    progress, reports = swarm(rep(A, 6, 60), rep(B, 6, 50))
    join = join_after_catch_up(me(6), progress, reports, SYNC)
    assert join == AverageStep(progress, expected=3, catch_up_if_missed=True)
    assert join_after_catch_up(me(6), progress, reports, DELAYED) is None  # the next call joins the begun round
    progress, reports = swarm(rep(A, 6, 10), rep(B, 6, 10))
    assert join_after_catch_up(me(6), progress, reports, SYNC) is None  # not gathering yet


def test_an_auxiliary_peer_helps_each_due_step_once() -> None:
    ready, _ = swarm(rep(A, 5, 60), rep(B, 5, 50))
    short, _ = swarm(rep(A, 5, 10), rep(B, 5, 10))
    alone, _ = swarm(rep(A, 5, 100))
    assert assist_due(ready, assisted=4, rules=SYNC) == 5
    assert assist_due(ready, assisted=5, rules=SYNC) is None  # helped already
    assert assist_due(short, assisted=4, rules=SYNC) is None  # not ready
    assert assist_due(short, assisted=3, rules=DELAYED) == 4  # the step the trainers just moved past
    assert assist_due(short, assisted=4, rules=DELAYED) is None
    assert assist_due(alone, assisted=-1, rules=SYNC) is None  # a peer alone averages with nobody


# ---------------------------------------------------------------------------- exact edges (mutation-tested)


def test_the_expected_group_counts_the_step_and_the_one_before_and_takes_the_larger_estimate() -> None:
    from dataclasses import replace

    reports = [rep(ME, 5), rep(A, 4), rep(B, 5), rep(C, 3), rep(ID(b"peer-d"), 6), rep(ID(b"peer-e"), 7)]
    progress = replace(swarm(*reports)[0], step=5, peers_at_step=2, peers_near_step=0, auxiliaries=0)
    # SYNC: A (finishing step 4) and B count; C two steps behind and D, E ahead do not
    assert expected_group(5, progress, reports, ME, SYNC) == 3
    # delayed updates: D, one step ahead, began this round already; E, two ahead, did not
    assert expected_group(5, progress, reports, ME, DELAYED) == 4
    # the swarm's own estimate wins where it is larger, but only for the step it describes
    bigger = replace(progress, peers_at_step=9)
    assert expected_group(5, bigger, reports, ME, SYNC) == 9
    assert expected_group(5, replace(bigger, step=4), reports, ME, SYNC) == 3


def test_stuck_ahead_takes_the_state_from_the_freshest_servers_at_the_furthest_step() -> None:
    from dataclasses import replace

    d, e = ID(b"peer-d"), ID(b"peer-e")
    reports = [rep(ME, 2), rep(A, 7, age=5.0), rep(B, 7, age=1.0), rep(C, 7, client=True), rep(d, 9, auxiliary=True),
               rep(e, 6)]
    progress = replace(swarm(*reports)[0], step=2)
    ahead, since = stuck_ahead(me(2, fresh=True), progress, reports, T, SYNC)
    assert since == T and ahead is not None
    # the furthest step of the peers that train (an auxiliary's step is not the swarm's), freshest first;
    # no client (it serves no state) and nobody behind it
    assert ahead.step == 7 and ahead.sources == (B, A)


def test_stuck_needs_a_peer_ahead_by_more_than_the_lag_or_a_quorum_short() -> None:
    from dataclasses import replace

    def stuck(trainer: Trainer, rules: Rules, *others: LocalProgress, samples: int = 0, contributors: int = 0,
              quorum: int = 2) -> tuple[GlobalProgress | None, float | None]:
        reports = [rep(ME, trainer.step), *others]
        progress = replace(swarm(*reports)[0], step=trainer.step, samples=samples, contributors=contributors,
                           quorum=quorum)
        return stuck_ahead(trainer, progress, reports, T, rules)

    assert stuck(me(0, fresh=True), SYNC) == (None, None)  # nobody else: never stuck
    assert stuck(me(2, fresh=True), SYNC, rep(A, 3))[0] is not None  # SYNC: one step ahead is ahead
    assert stuck(me(2, fresh=True), DELAYED, rep(A, 3)) == (None, None)  # delayed: one ahead is a round begun
    assert stuck(me(2, fresh=True), DELAYED, rep(A, 4))[0] is not None
    # not fresh: the samples without the quorum, while someone is ahead
    assert stuck(me(3), SYNC, rep(A, 3), samples=TARGET, contributors=1) == (None, None)  # nobody ahead
    assert stuck(me(3), SYNC, rep(A, 5), samples=TARGET, contributors=2) == (None, None)  # the quorum is there
    assert stuck(me(3), SYNC, rep(A, 5), samples=TARGET, contributors=1) == (None, T)  # stuck since now


def test_the_reread_interval_is_a_config_checked_and_never_past_the_report_interval() -> None:
    with pytest.raises(ConfigError, match="reread_interval"):
        TrainingConfig(run_id="r", target_batch_size=8, reread_interval=-0.1).validate()
    with pytest.raises(ConfigError, match="reread_interval"):
        TrainingConfig(run_id="r", target_batch_size=8, reread_interval=math.nan).validate()
    config = TrainingConfig(run_id="r", target_batch_size=8, reread_interval=5.0, rejoin_after=3.0,
                            delay_updates=True)
    config.validate()
    assert config.rules() == Rules(delay_updates=True, rejoin_after=3.0, reread_interval=config.report_interval)
    assert TrainingConfig(run_id="r", target_batch_size=8).rules() == Rules(reread_interval=0.1)
