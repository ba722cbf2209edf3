"""Contributions nobody can forge or erase (DeDLOC I.2): a peer's count lives under its own signed
subkey (no one else can write it), and the backbone credits a claim only as far as time allows."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from p2p.dht.records import owned
from p2p.errors import DedlocError
from p2p.identity import new_identity, peer_id_of
from training.contributions import Contributions, DataContributions
from training.progress import LocalProgress, ProgressTracker

from .kit import open_peers

pytestmark = pytest.mark.timeout(60)


def report(peer: object, step: int, samples: int, rate: float) -> LocalProgress:
    return LocalProgress(peer, step, samples, rate, 0.0)  # type: ignore[arg-type]


def test_honest_claims_are_credited_and_an_inflated_one_is_cut_to_what_time_allows() -> None:
    honest = [peer_id_of(new_identity()) for _ in range(3)]
    liar = peer_id_of(new_identity())
    board = Contributions(target=100_000)
    # step 0 lasts 10 s: each honest peer does 50 samples/s, read every second; the liar claims a
    # million samples and a rate of a million a second (it cannot move the median of the rates)
    for t in range(11):
        reports = [report(p, 0, 50 * t, 50.0) for p in honest]
        reports.append(report(liar, 0, 0 if t < 8 else 1_000_000, 1e6))
        board.observe(reports, float(t))
    rows = board.leaderboard()
    for p in honest:
        assert rows[p.to_base58()] == {"samples": 500, "claimed": 500, "auxiliary_steps": 0}
    liar_row = rows[liar.to_base58()]
    assert liar_row["claimed"] == 1_000_000
    # it said 0 until t=7: from then on its credit grows at most 3 x the median rate (50) a second
    assert liar_row["samples"] == 3 * 50 * 3
    # and later reads add only what the time between them allows
    board.observe([report(liar, 0, 1_000_001, 1e6), *[report(p, 0, 500, 50.0) for p in honest]], 12.0)
    assert board.leaderboard()[liar.to_base58()]["samples"] == 3 * 50 * 5
    # a claim never counts beyond one global batch
    capped = Contributions(target=100)
    capped.observe([report(liar, 0, 5000, 1e6), *[report(p, 0, 50, 50.0) for p in honest]], 100.0)
    assert capped.leaderboard()[liar.to_base58()]["samples"] == 100


def test_a_lower_count_later_never_lowers_the_credit_and_auxiliaries_are_counted_apart() -> None:
    peer, helper = peer_id_of(new_identity()), peer_id_of(new_identity())
    board = Contributions(target=1000)
    board.observe([report(peer, 3, 40, 10.0)], 0.0)
    board.observe([report(peer, 3, 10, 10.0)], 5.0)
    helper_report = LocalProgress(helper, 3, 0, 0.0, 0.0, auxiliary=True)
    board.observe([report(peer, 4, 20, 10.0), helper_report], 10.0)
    rows = board.leaderboard({helper: "carol"})
    assert rows[peer.to_base58()]["samples"] == 60
    assert rows[helper.to_base58()] == {"samples": 0, "claimed": 0, "auxiliary_steps": 1, "username": "carol"}


def test_the_count_a_peer_stepped_with_is_credited_though_the_next_steps_report_replaced_it_unread() -> None:
    """A peer's last batch before a step is in its report of that step only until the next step's
    report replaces it: a backbone reading between the two may never see it (the slow trainer of
    the CLI test was credited 320 of its 896 samples so). Each report says what the peer brought
    to the previous step's round, credited only for the time that step was under way."""
    honest, quiet, liar = (peer_id_of(new_identity()) for _ in range(3))
    board = Contributions(target=1000)
    for t in range(4):  # step 0: 10 samples/s each, read every second
        board.observe([report(p, 0, 10 * t, 10.0) for p in (honest, quiet, liar)], float(t))
    # each did 5 more, the step happened at 3.5 s; the next read (4.2 s) already sees step 1
    board.observe([LocalProgress(honest, 1, 5, 10.0, 0.0, previous=35), report(quiet, 1, 5, 10.0),
                   LocalProgress(liar, 1, 5, 10.0, 0.0, previous=100_000)], 4.2)
    rows = board.leaderboard()
    assert rows[honest.to_base58()]["samples"] == rows[honest.to_base58()]["claimed"] == 35 + 5
    assert rows[quiet.to_base58()]["samples"] == 30 + 5  # one that does not say: its last read count
    # the liar's step 0 grows by 3 x the median rate (10/s) from its last read (3 s) to step 1's first (4.2 s)
    assert rows[liar.to_base58()]["samples"] == 30 + 36 + 5
    # and the same claim read again later adds nothing: step 0 was over
    board.observe([LocalProgress(liar, 1, 5, 10.0, 0.0, previous=100_000)], 60.0)
    assert board.leaderboard()[liar.to_base58()]["samples"] == 30 + 36 + 5


async def test_no_peer_can_write_another_peers_progress() -> None:
    async with open_peers(2) as (relay, alice, mallory):
        tracker = ProgressTracker(alice, "credit-run", 1000)
        assert await tracker.report(3, 120, 10.0)
        # mallory writes under alice's owned subkey: refused before it leaves (and by every replica)
        with pytest.raises(DedlocError):
            await mallory.dht.store("credit-run.progress", b"\x00" * 8, time.time() + 60,
                                    subkey=owned("progress", alice.peer_id))
        reader = ProgressTracker(relay, "credit-run", 1000)
        await reader.fetch()
        (mine,) = [r for r in reader.reports if r.peer_id == alice.peer_id]
        assert (mine.step, mine.samples) == (3, 120)


# ---------------------------------------------------------------------- credit for data

def test_bytes_served_are_credited_no_faster_than_a_link_carries_and_survive_a_restart() -> None:
    alice, bob = (peer_id_of(new_identity()) for _ in range(2))
    data = DataContributions(max_rate=1000.0)
    dataset = b"\x01" * 32
    data.observe_served(dataset, {alice: 500, bob: 0}, now=0.0)  # met for the first time: credited from here on
    data.observe_served(dataset, {alice: 1500, bob: 10**12}, now=1.0)  # bob claims a terabyte in a second
    board = data.leaderboard()
    assert board[alice.to_base58()]["bytes_served"] == 1000 and board[bob.to_base58()]["bytes_served"] == 1000
    data.observe_served(dataset, {alice: 200, bob: 10**12}, now=2.0)  # alice restarted: her count starts again
    data.observe_served(dataset, {alice: 700, bob: 10**12}, now=3.0)
    board = data.leaderboard()
    assert board[alice.to_base58()]["bytes_served"] == 1000 + 200 + 500
    assert board[bob.to_base58()]["bytes_served"] == 3000
    data.observe_shards(dataset, {alice: 3})
    data.observe_shards(dataset, {bob: 2})  # the dataset's shards as they are now: alice's were retracted
    board = data.leaderboard()
    assert board[bob.to_base58()]["shards_added"] == 2 and board[alice.to_base58()]["shards_added"] == 0


def test_a_count_read_again_unchanged_is_credited_once_and_restarts_add_up() -> None:
    alice = peer_id_of(new_identity())
    data = DataContributions(max_rate=100.0)
    dataset = b"\x02" * 32
    data.observe_served(dataset, {alice: 300}, now=1.0)  # first seen at 1 s: time counts from there
    data.observe_served(dataset, {alice: 300}, now=1.5)  # half a second at 100 B/s: 50 of it
    assert data.leaderboard()[alice.to_base58()]["bytes_served"] == 50
    for t in (3.0, 5.0, 7.0):  # the same count, read again: credited up to it, never past it
        data.observe_served(dataset, {alice: 300}, now=t)
    assert data.leaderboard()[alice.to_base58()]["bytes_served"] == 300
    # two restarts: what each run was credited adds up, and each run starts from nothing
    data.observe_served(dataset, {alice: 40}, now=8.0)  # restarted: 40 new bytes in 1 s, all credited
    data.observe_served(dataset, {alice: 10}, now=8.05)  # again: 5 of its 10 (0.05 s x 100 B/s)
    data.observe_served(dataset, {alice: 11}, now=8.055)  # 0.5 more allowed: 5.5
    row = data.leaderboard()[alice.to_base58()]
    assert row == {"bytes_served": int(300 + 40 + 5.5), "shards_added": 0}


def test_data_credit_adds_up_over_datasets_and_a_peer_that_only_added_shards_has_a_row() -> None:
    alice, bob = (peer_id_of(new_identity()) for _ in range(2))
    data = DataContributions(max_rate=1000.0)
    first, second = b"\x03" * 32, b"\x04" * 32
    for dataset in (first, second):
        data.observe_served(dataset, {alice: 0}, now=0.0)
        data.observe_served(dataset, {alice: 600}, now=1.0)
    data.observe_shards(first, {alice: 2, bob: 3})
    data.observe_shards(second, {bob: 4})
    assert data.leaderboard() == {alice.to_base58(): {"bytes_served": 1200, "shards_added": 2},
                                  bob.to_base58(): {"bytes_served": 0, "shards_added": 7}}


def test_the_rate_limit_is_the_median_of_working_trainers_only() -> None:
    a, b, c, d, helper = (peer_id_of(new_identity()) for _ in range(5))
    board = Contributions(target=1000)
    assert board.max_rate([]) == 0.0  # nobody reports a rate yet: nothing beyond the slack
    reports = [report(a, 0, 0, 0.5), report(b, 0, 0, 2.0), report(c, 0, 0, 0.0), report(d, 0, 0, -1.0),
               LocalProgress(helper, 0, 0, 1000.0, 0.0, auxiliary=True)]
    # a peer at 0 (just started) or below is no rate, an auxiliary's is not a trainer's: median(0.5, 2.0)
    assert board.max_rate(reports) == 3.0 * 1.25


def test_an_auxiliary_is_counted_at_each_step_it_helped_and_the_trainers_after_it_too() -> None:
    peer, helper = peer_id_of(new_identity()), peer_id_of(new_identity())
    board = Contributions(target=1000)
    board.observe([LocalProgress(helper, 5, 0, 0.0, 0.0, auxiliary=True), report(peer, 5, 30, 10.0)], 0.0)
    board.observe([LocalProgress(helper, 6, 0, 0.0, 0.0, auxiliary=True), report(peer, 6, 20, 10.0)], 1.0)
    assert board.assisted[helper] == {5, 6} and helper not in board.claims  # no claim at any step
    assert set(board.claims[peer]) == {5, 6}
    assert board.leaderboard()[helper.to_base58()]["auxiliary_steps"] == 2


def test_previous_counts_only_from_a_trainer_past_step_zero_that_brought_samples() -> None:
    peer, other = peer_id_of(new_identity()), peer_id_of(new_identity())
    board = Contributions(target=1000)
    board.observe([LocalProgress(peer, 0, 5, 10.0, 0.0, previous=7)], 0.0)  # no step before step 0
    board.observe([LocalProgress(other, 3, 0, 10.0, 0.0, previous=0)], 0.0)  # brought nothing to step 2
    assert set(board.claims[peer]) == {0} and set(board.claims[other]) == {3}
    board.observe([LocalProgress(other, 4, 0, 10.0, 0.0, previous=1)], 1.0)  # one sample to step 3 is a claim
    assert (board.claims[other][3].claimed, board.claims[other][3].credited) == (1, 1.0)


# ---------------------------------------------------------------------- a backbone that restarted


def test_a_restarted_backbone_s_board_adds_to_the_one_it_saved_and_reads_afresh_what_is_read_afresh() -> None:
    """A restart wiped every volunteer's credit: the new board started from nothing and was written over
    the old one."""
    from training.contributions import carried

    earlier = {"a": {"samples": 500, "claimed": 600, "auxiliary_steps": 0, "username": "ann", "bytes_served": 7,
                     "shards_added": 3},
               "gone": {"samples": 40, "claimed": 40, "auxiliary_steps": 2}}
    board = {"a": {"samples": 100, "claimed": 100, "auxiliary_steps": 0, "bytes_served": 5, "shards_added": 1},
             "new": {"samples": 9, "claimed": 9, "auxiliary_steps": 0, "username": "neo"}}
    assert carried(earlier, board) == {
        "a": {"samples": 600, "claimed": 700, "auxiliary_steps": 0, "username": "ann", "bytes_served": 12,
              "shards_added": 1},  # shards added: the dataset as read now (a retraction takes them back)
        "gone": {"samples": 40, "claimed": 40, "auxiliary_steps": 2},
        "new": {"samples": 9, "claimed": 9, "auxiliary_steps": 0, "username": "neo"}}
    assert carried({}, board) == board and carried(earlier, {}) == earlier
    # a saved row that lost a count (a hand-edited value left out) still has every count the page reads
    assert carried({"ed": {"username": "ed", "samples": 3}, "zed": {"username": "zed"}}, {}) == {
        "ed": {"samples": 3, "claimed": 0, "auxiliary_steps": 0, "username": "ed"},
        "zed": {"samples": 0, "claimed": 0, "auxiliary_steps": 0, "username": "zed"}}


def test_a_saved_board_is_read_back_with_what_is_not_a_count_left_out() -> None:
    from training.contributions import board_from_json

    assert board_from_json('{"a": {"samples": 5, "claimed": -1, "auxiliary_steps": true, "username": 3, '
                           '"bytes_served": 2.5, "shards_added": 4, "other": 1, "note": "x"}, "b": [1], "c": {}, '
                           '"d": {"username": "dee", "claimed": 0}}') == {
        "a": {"samples": 5, "shards_added": 4}, "c": {}, "d": {"username": "dee", "claimed": 0}}
    with pytest.raises(ValueError, match="^not a leaderboard: no object at the top$"):
        board_from_json("[1, 2]")
    for bad in ('{"a": ', ""):
        with pytest.raises(ValueError):
            board_from_json(bad)


def test_claims_toward_steps_a_saved_board_holds_are_not_credited_again() -> None:
    peer, helper = peer_id_of(new_identity()), peer_id_of(new_identity())
    board = Contributions(target=1000, after=4)
    aux = LocalProgress(helper, 4, 0, 0.0, 0.0, auxiliary=True)
    board.observe([report(peer, 4, 300, 100.0), aux], 0.0)  # step 4: the saved board has it
    assert board.leaderboard() == {}
    # a peer still at step 4 (it lags), with what it brought to step 3: seen, not credited (a restarted
    # backbone read the step's first sight from a dictionary it had never filled, and stopped)
    board.observe([LocalProgress(peer, 4, 310, 100.0, 0.0, previous=200)], 0.5)
    assert board.leaderboard() == {}
    board.observe([LocalProgress(peer, 5, 50, 100.0, 0.0, previous=300), replace(aux, step=5)], 1.0)
    assert board.leaderboard() == {peer.to_base58(): {"samples": 50, "claimed": 50, "auxiliary_steps": 0},
                                   helper.to_base58(): {"samples": 0, "claimed": 0, "auxiliary_steps": 1}}
