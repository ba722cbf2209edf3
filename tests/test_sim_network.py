"""The simulator's clock and its network model, call by call: p2p.sim.engine, p2p.sim.network and
p2p.sim.calibration. A scripted random source (:class:`Dice`) gives each draw, so every delay, kind,
session and place is checked to the number; the DHT over them is tests/test_sim.py."""

from __future__ import annotations

import math
import random
import statistics
from typing import Any

import pytest

from p2p.errors import ConfigError
from p2p.sim import calibration as cal
from p2p.sim import network as net
from p2p.sim.engine import Engine
from p2p.sim.network import Kind, NetworkModel, Place


class Dice(random.Random):
    """``random()`` and ``gauss`` give the values listed, in turn; ``randrange`` and
    ``gammavariate`` theirs (the standard library's draws are built on ``random()``)."""

    def __init__(self, *values: float) -> None:
        super().__init__(0)
        self.values = list(values)
        self.ranges: list[int] = []

    def random(self) -> float:
        return self.values.pop(0)

    def gauss(self, mu: float = 0.0, sigma: float = 1.0) -> float:
        return mu + sigma * self.values.pop(0)

    def randrange(self, *args: Any, **kwargs: Any) -> int:
        self.ranges.append(args[0])
        return int(self.values.pop(0))

    def gammavariate(self, alpha: float, beta: float) -> float:
        assert beta == 1.0
        self.ranges.append(-1)
        return alpha * self.values.pop(0)


# ---------------------------------------------------------------------- the clock


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
    assert seen[-1] == "late" and engine.events == 5 and engine.now == 10


def test_a_callback_sees_its_own_time_and_one_due_at_the_end_runs() -> None:
    engine = Engine(start=100.0)
    assert (engine.now, engine.events, len(engine)) == (100.0, 0, 0)
    seen: list[float] = []
    engine.at(0.0, lambda: seen.append(engine.now))
    engine.at(2.5, lambda: seen.append(engine.now))
    engine.at(2.5000001, lambda: seen.append(engine.now))
    engine.run(102.5)
    assert seen == [100.0, 102.5] and len(engine) == 1
    engine.run(50.0)  # the clock never goes back
    assert engine.now == 102.5 and seen == [100.0, 102.5]


def test_a_callback_is_called_with_its_arguments() -> None:
    engine = Engine()
    seen: list[tuple[int, str]] = []
    engine.at(1.0, lambda *args: seen.append(args), 1, "two")
    engine.run(1.0)
    assert seen == [(1, "two")]


def test_nothing_is_scheduled_in_the_past() -> None:
    engine = Engine()
    with pytest.raises(ValueError, match=r"^cannot schedule -1\.5 s in the past$"):
        engine.at(-1.5, print)
    assert len(engine) == 0


# ---------------------------------------------------------------------- the model's settings


def test_the_model_s_defaults_and_sources() -> None:
    model = NetworkModel()
    assert (model.median_rtt_s, model.access_sigma, model.loss) == (0.1, 0.9, 0.01)
    assert (model.unreachable_share, model.silent_share) == (1 - 15_371 / 20_811, 0.10)
    assert (model.access_median_s, model.path_inflation, model.shared_group_share, model.shared_groups) == (
        0.008, 1.0, 0.0, 1)
    assert model.sessions == cal.SessionModel.fitted() and model.regions == net.REGIONS
    assert (net.KM_PER_MS, net.MIN_PATH_KM) == (200.0, 800.0)
    assert sum(r.share for r in net.REGIONS) == pytest.approx(1.0)
    assert net.REGIONS[0] == net.Region("east-asia", 31.0, 118.0, 0.30)


@pytest.mark.parametrize(("settings", "says"), [
    ({"shared_groups": 65_537}, "shared_groups is from 1 to 65,536; got 65537"),
    ({"shared_groups": 0}, "shared_groups is from 1 to 65,536; got 0"),
    ({"shared_group_share": 1.5}, "shared_group_share is a share, from 0 to 1; got 1.5"),
    ({"unreachable_share": -0.01}, "unreachable_share is a share, from 0 to 1; got -0.01"),
    ({"silent_share": 1.01}, "silent_share is a share, from 0 to 1; got 1.01"),
    ({"loss": -0.1}, "loss is a probability, from 0 to below 1; got -0.1"),
    ({"loss": 1.0}, "loss is a probability, from 0 to below 1; got 1.0"),
    ({"unreachable_share": 0.7, "silent_share": 0.4}, "unreachable_share and silent_share add up to more than 1"),
])
def test_a_network_model_with_settings_outside_their_range_says_which(settings: dict[str, float], says: str) -> None:
    """Not a multiaddr's error from deep in a run (``--shared-groups 70000`` failed so in bench/scale.py)."""
    with pytest.raises(ConfigError, match=f"^network model: {says}$"):
        NetworkModel(**settings)  # type: ignore[arg-type]


def test_the_ends_of_each_range_are_taken() -> None:
    NetworkModel(shared_groups=65_536, shared_group_share=1.0, loss=0.999)
    NetworkModel(shared_groups=1, shared_group_share=0.0, loss=0.0)
    NetworkModel(unreachable_share=0.6, silent_share=0.4)
    NetworkModel(unreachable_share=0.0, silent_share=1.0)
    NetworkModel(unreachable_share=1.0, silent_share=0.0)


# ---------------------------------------------------------------------- distances and round trips


def test_great_circle_distances() -> None:
    equator = net.Region("a", 0.0, 0.0, 0.5)
    assert net._great_circle_km(equator, equator) == 0.0
    assert net._great_circle_km(equator, net.Region("b", 0.0, 90.0, 0.5)) == pytest.approx(6371.0 * math.pi / 2)
    assert net._great_circle_km(equator, net.Region("c", 90.0, 0.0, 0.5)) == pytest.approx(6371.0 * math.pi / 2)
    assert net._great_circle_km(net.Region("d", 45.0, 10.0, 0.5), net.Region("e", 45.0, 20.0, 0.5)) == pytest.approx(
        785.767, abs=0.001)  # shorter than the parallel's arc between them (786.3 km)


def test_a_round_trip_is_the_fibre_s_stretched_plus_both_access_links() -> None:
    regions = (net.Region("here", 0.0, 0.0, 0.5), net.Region("there", 0.0, 90.0, 0.5))
    model = NetworkModel(regions=regions)
    model.path_inflation = 2.0
    far = 2 * 6371.0 * math.pi / 2 / 200.0 / 1000  # there and back, at 200 km per ms
    near = 2 * 800.0 / 200.0 / 1000  # one region: still 800 km apart
    a, b = Place(0, 0.004), Place(1, 0.030)
    assert model.rtt(a, b) == pytest.approx(2.0 * far + 0.034)
    assert model.rtt(b, a) == pytest.approx(2.0 * far + 0.034)
    assert model.rtt(a, Place(0, 0.001)) == pytest.approx(2.0 * near + 0.005)


def test_a_message_takes_half_the_round_trip_and_a_retransmission_timeout_each_time_it_is_lost() -> None:
    model = NetworkModel(loss=0.25)
    a, b = Place(0, 0.010), Place(0, 0.010)
    rtt = model.rtt(a, b)  # 0.028: under the floor of 200 ms
    assert model.one_way(a, b, Dice(0.25)) == pytest.approx(rtt / 2)  # at the probability: not lost
    assert model.one_way(a, b, Dice(0.1, 0.2, 0.9)) == pytest.approx(rtt / 2 + 2 * 0.2)
    slow = (Place(0, 0.2), Place(0, 0.2))
    slow_rtt = model.rtt(*slow)
    assert model.one_way(*slow, Dice(0.0, 0.5)) == pytest.approx(slow_rtt / 2 + 2 * slow_rtt)


def test_no_loss_no_retransmission() -> None:
    model = NetworkModel(loss=0.0)
    a, b = Place(0, 0.010), Place(3, 0.020)
    assert model.one_way(a, b, Dice(0.0)) == pytest.approx(model.rtt(a, b) / 2)


# ---------------------------------------------------------------------- peers drawn


def test_a_place_is_a_region_by_its_share_and_an_access_link_from_a_lognormal() -> None:
    model = NetworkModel()
    # east-asia 0.30, north-america 0.27, europe 0.28, ...: cumulative 0.30, 0.57, 0.85
    assert model.place(Dice(0.29, 0.0)) == Place(0, 0.008)
    second = model.place(Dice(0.31, 1.0))
    assert second.region == 1 and second.access_s == pytest.approx(0.008 * math.exp(0.9))
    assert model.place(Dice(0.86, -2.0)).region == 3
    assert model.place(Dice(0.999, 0.0)).region == 6
    wide = NetworkModel(access_median_s=0.02, access_sigma=0.5)
    assert wide.place(Dice(0.0, 1.0)).access_s == pytest.approx(0.02 * math.exp(0.5))


def test_a_peer_s_kind_by_the_shares() -> None:
    model = NetworkModel(unreachable_share=0.25, silent_share=0.5)
    assert model.kind(Dice(0.0)) is Kind.UNREACHABLE
    assert model.kind(Dice(0.2499)) is Kind.UNREACHABLE
    assert model.kind(Dice(0.25)) is Kind.SILENT
    assert model.kind(Dice(0.7499)) is Kind.SILENT
    assert model.kind(Dice(0.75)) is Kind.PUBLIC
    assert NetworkModel(unreachable_share=0.0, silent_share=0.0).kind(Dice(0.0)) is Kind.PUBLIC
    assert [k.value for k in Kind] == ["public", "unreachable", "silent"]


def test_a_shared_ip_group_by_its_share() -> None:
    model = NetworkModel(shared_group_share=0.3, shared_groups=7)
    assert model.shared_group(Dice(0.3)) is None
    dice = Dice(0.29, 5)
    assert model.shared_group(dice) == 5 and dice.ranges == [7]
    assert NetworkModel().shared_group(Dice(0.0)) is None  # no share by default


def test_a_session_is_drawn_from_the_weibull_through_the_measured_points() -> None:
    model = NetworkModel()
    shape, scale_h = model.sessions.shape, model.sessions.scale_h
    for u in (0.5, 0.8, 0.1):
        # weibullvariate(1, shape) is (-log(1 - u)) ** (1 / shape)
        hours = model.session_s(Dice(u)) / 3600
        assert hours == pytest.approx(scale_h * (-math.log(1 - u)) ** (1 / shape))
    assert model.session_s(Dice(0.5)) / 3600 == pytest.approx(cal.SESSION_HALF_GONE_H)
    assert model.session_s(Dice(0.8)) / 3600 == pytest.approx(cal.SESSION_80_GONE_H)


def test_a_residual_session_is_a_point_in_a_length_biased_session() -> None:
    model = NetworkModel(sessions=cal.SessionModel(shape=0.5, scale_h=2.0))
    dice = Dice(4.0, 0.25)  # the gamma draw 4 * alpha (alpha = 1 + 1/shape = 3), then the point
    length = 2.0 * 3600 * 12.0 ** (1 / 0.5)
    assert model.residual_session_s(dice) == pytest.approx(0.25 * length)
    assert dice.ranges == [-1]


def test_calibration_sets_the_median_round_trip_and_is_a_function_of_its_seed() -> None:
    model = NetworkModel()
    assert model.calibrate() is model
    rng = random.Random(0)
    pairs = [(model.place(rng), model.place(rng)) for _ in range(20_000)]
    assert statistics.median(model.rtt(a, b) for a, b in pairs) == pytest.approx(0.100, rel=1e-6)
    assert 0.9 < model.path_inflation < 1.0  # the access links take the rest of the 100 ms
    again = NetworkModel().calibrate(seed=0)
    assert again.path_inflation == model.path_inflation
    assert NetworkModel().calibrate(seed=1).path_inflation != model.path_inflation
    assert NetworkModel().calibrate(seed=0, samples=2_001).path_inflation != model.path_inflation
    fast = NetworkModel(median_rtt_s=0.05).calibrate()
    assert fast.path_inflation < model.path_inflation


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


# ---------------------------------------------------------------------- the sources


def test_the_session_model_passes_through_both_measured_points() -> None:
    fitted = cal.SessionModel.fitted()
    assert fitted.cdf(cal.SESSION_HALF_GONE_H) == pytest.approx(0.5)
    assert fitted.cdf(cal.SESSION_80_GONE_H) == pytest.approx(0.8)
    other = cal.SessionModel.fitted(1.0, 10.0)
    assert other.cdf(1.0) == pytest.approx(0.5) and other.cdf(10.0) == pytest.approx(0.8)
    assert cal.SessionModel(shape=1.0, scale_h=1.0).cdf(1.0) == pytest.approx(1 - math.exp(-1))
    assert cal.SessionModel(shape=2.0, scale_h=2.0).cdf(1.0) == pytest.approx(1 - math.exp(-0.25))
    assert (cal.SESSION_HALF_GONE_H, cal.SESSION_80_GONE_H, cal.MEDIAN_RTT_S, cal.SILENT_SHARE) == (2.0, 8.0, 0.1, 0.1)
