"""averaging/bandwidth.py: a peer's link rates, measured from its rounds (pure: bytes and times in, rates out).

Which rounds are probes is decided by every member of a group alone, from the group id, so the rule is
pinned here: peers of two releases that picked different rounds would run one probe stream free beside
lockstep ones and measure the group's pace, not the link.
"""

from __future__ import annotations

import math

import pytest

from averaging.bandwidth import BandwidthConfig, BandwidthEstimator, TransferClock, is_probe, link_rate, quantize
from p2p.errors import ConfigError


def _clock(nbytes: int, seconds: float, start: float = 100.0, pieces: int = 11) -> list[TransferClock]:
    """One stream moving ``nbytes`` (after its first piece) in ``seconds``."""
    clock = TransferClock()
    clock.add(nbytes // (pieces - 1), start)  # the first piece only starts the clock
    for i in range(1, pieces):
        clock.add(nbytes // (pieces - 1), start + seconds * i / (pieces - 1))
    return [clock]


def test_bandwidth_is_the_best_recent_round_and_the_user_wins() -> None:
    est = BandwidthEstimator(BandwidthConfig(window=2))
    assert (est.upload, est.download, est.measured) == (0.0, 0.0, False)
    est.observe(_clock(8_000_000, 1.0), _clock(8_000_000, 2.0))  # 8 MB/s up, 4 MB/s down
    assert est.upload == pytest.approx(8e6, rel=0.1) and est.download == pytest.approx(4e6, rel=0.1)
    assert est.measured
    est.observe(_clock(8_000_000, 4.0), _clock(8_000_000, 1.0))  # a round slowed by the group: not the link
    assert est.upload == pytest.approx(8e6, rel=0.1) and est.download == pytest.approx(8e6, rel=0.1)
    est.observe(_clock(8_000_000, 4.0), _clock(8_000_000, 4.0))
    est.observe(_clock(8_000_000, 4.0), _clock(8_000_000, 4.0))  # the window forgets old bests
    assert est.upload == pytest.approx(2e6, rel=0.1) and est.download == pytest.approx(2e6, rel=0.1)
    est.observe(_clock(1000, 1.0), _clock(8_000_000, 0.01))  # too little moved, too short: ignored
    assert est.upload == pytest.approx(2e6, rel=0.1) and est.download == pytest.approx(2e6, rel=0.1)
    user = BandwidthEstimator(BandwidthConfig(upload=1e6))
    user.observe(_clock(8_000_000, 1.0), _clock(8_000_000, 1.0))
    assert user.upload == 1e6 and user.download == pytest.approx(8e6, rel=0.1)
    with pytest.raises(ValueError):
        BandwidthConfig(upload=-1).validate()


def test_a_probe_is_not_washed_out_by_lockstep_rounds() -> None:
    """Lockstep rounds measure the group's pace; the best recent probe still stands beside them."""
    est = BandwidthEstimator(BandwidthConfig(window=2, probe_window=2))
    est.observe(_clock(20_000_000, 1.0), _clock(20_000_000, 1.0), probe=True)  # the link: 20 MB/s
    for _ in range(5):
        est.observe(_clock(4_000_000, 1.0), _clock(4_000_000, 1.0))  # held to the slowest member
    assert est.upload == pytest.approx(20e6, rel=0.1) and est.download == pytest.approx(20e6, rel=0.1)
    est.observe(_clock(8_000_000, 1.0), _clock(8_000_000, 1.0), probe=True)
    est.observe(_clock(8_000_000, 1.0), _clock(8_000_000, 1.0), probe=True)  # the link got slower
    assert est.upload == pytest.approx(8e6, rel=0.1)
    with pytest.raises(ValueError):
        BandwidthConfig(probe_every=-1).validate()


def test_link_rate_adds_concurrent_streams_and_skips_the_first_wait() -> None:
    # a fast peer sending to one fast and two slow reducers: each stream is held back by its far end
    fast, slow1, slow2 = _clock(20_000_000, 1.0)[0], _clock(1_500_000, 1.0)[0], _clock(1_500_000, 1.0)[0]
    assert link_rate([fast, slow1, slow2], 1 << 20, 0.05) == pytest.approx(23e6, rel=0.01)
    # the wait before the first payload does not count
    late = TransferClock()
    late.add(1_000_000, 10.0)  # after a 10 s wait for the group
    late.add(1_000_000, 10.5)
    late.add(1_000_000, 11.0)
    assert late.rate(0.05) == pytest.approx(2e6)
    # alike links declare alike figures
    assert quantize(100e6) == quantize(103e6) and quantize(100e6) < quantize(130e6) and quantize(0) == 0


def test_a_clock_counts_what_moved_after_its_first_payload_and_nothing_for_empty_writes() -> None:
    clock = TransferClock()
    clock.add(0, 5.0)  # an empty write neither starts the clock nor counts
    clock.add(1, 10.0)  # a 1-byte payload starts it
    assert clock.first == 10.0
    clock.add(1, 11.0)  # ... and one after it counts
    assert (clock.bytes, clock.rate(0.5)) == (1, 1.0)
    clock.add(-5, 12.0)
    assert (clock.bytes, clock.last) == (1, 11.0)
    assert TransferClock().rate(0.0) is None  # nothing moved
    assert TransferClock(bytes=5).rate(0.0) is None  # never started (a clock built by hand)
    started = TransferClock()
    started.add(100, 1.0)
    assert started.rate(0.0) is None  # only the first payload: no span, no bytes after it


def test_a_clock_needs_its_minimum_span_and_accepts_it_exactly() -> None:
    clock = TransferClock()
    clock.add(10, 1.0)
    clock.add(1000, 1.5)
    assert clock.rate(0.5) == 2000.0  # a span of exactly min_seconds tells
    assert clock.rate(0.5000001) is None


def test_link_rate_needs_its_minimum_bytes_and_accepts_them_exactly() -> None:
    clock = TransferClock()
    clock.add(10, 0.0)
    clock.add(1000, 1.0)
    assert link_rate([clock], 1000, 0.5) == 1000.0
    assert link_rate([clock], 1001, 0.5) is None
    assert link_rate([], 1, 0.5) is None


def test_quantize_is_a_quarter_doubling_grid_for_any_positive_rate() -> None:
    assert quantize(100e6) == 2.0 ** (106 / 4)  # log2(1e8) = 26.58: the 106th quarter
    assert quantize(1.5) == math.sqrt(2) and quantize(0.5) == 0.5  # below one byte a second too
    assert quantize(-3.0) == 0.0
    assert quantize(100e6, steps_per_doubling=1) == 2.0 ** 27


#: the group ids ``bytes([i]) * 16`` that probe at one round in 8, among i < 256: every release must pick the same
PROBES_OF_8 = [39, 76, 85, 105, 108, 110, 115, 118, 121, 128, 133, 144, 160, 164, 179, 191, 195, 203, 205, 210,
               211, 218, 224, 225, 244, 250, 251]


def test_which_round_probes_is_pinned_by_the_group_id() -> None:
    known = [(1e7, 1e7)] * 3
    assert [i for i in range(256) if is_probe(bytes([i]) * 16, known, 8)] == PROBES_OF_8
    assert [i for i in range(16) if is_probe(bytes([i]) * 16, known, 3)] == [0, 3, 4, 7, 12, 13]
    assert all(is_probe(bytes([i]) * 16, known, 1) for i in range(16))  # every round
    assert not any(is_probe(bytes([i]) * 16, known, 0) for i in range(16))  # never


def test_a_member_without_either_figure_makes_the_round_a_probe_unless_probes_are_off() -> None:
    gid = bytes([1]) * 16  # not a probe by its id at 8 (PROBES_OF_8)
    assert not is_probe(gid, [(1e7, 1e7), (1.0, 1.0)], 8)  # one byte a second is a figure
    assert is_probe(gid, [(1e7, 1e7), (0.0, 1e7)], 8)  # no upload yet
    assert is_probe(gid, [(1e7, 0.0)], 8)  # no download yet
    assert not is_probe(gid, [(0.0, 0.0)], 0)
    assert is_probe(gid, [(0.0, 0.0)], 1)


def test_the_settings_refuse_what_cannot_measure_with_their_reasons() -> None:
    BandwidthConfig(window=1, probe_window=1, min_bytes=1, min_seconds=1e-9, probe_every=0).validate()
    for config in (BandwidthConfig(upload=-1.0), BandwidthConfig(download=-1.0)):
        with pytest.raises(ConfigError, match=r"^upload and download must be >= 0 \(0: measure them\)$"):
            config.validate()
    for config in (BandwidthConfig(window=0), BandwidthConfig(probe_window=0), BandwidthConfig(min_bytes=0),
                   BandwidthConfig(min_seconds=0.0)):
        with pytest.raises(ConfigError,
                           match=r"^window, probe_window, min_bytes and min_seconds must be positive$"):
            config.validate()
    with pytest.raises(ConfigError, match=r"^probe_every must be >= 0 \(0: never probe\)$"):
        BandwidthConfig(probe_every=-1).validate()


def test_the_probe_window_forgets_old_probes_in_both_directions() -> None:
    est = BandwidthEstimator(BandwidthConfig(window=1, probe_window=1))
    est.observe(_clock(20_000_000, 1.0), _clock(20_000_000, 1.0), probe=True)
    est.observe(_clock(8_000_000, 1.0), _clock(8_000_000, 1.0), probe=True)  # the link got slower
    assert est.upload == quantize(8e6) and est.download == quantize(8e6)
