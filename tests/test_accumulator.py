"""training.accumulator: the sum of per-sample gradients of one global step, exact values (torch only)."""

from __future__ import annotations

import pytest
import torch

from training.accumulator import GradientAccumulator


def _params() -> list[torch.Tensor]:
    return [torch.zeros(3, requires_grad=True), torch.zeros(2, 2, requires_grad=True)]


def _set(params: list[torch.Tensor], *grads: torch.Tensor | None) -> None:
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.clone()


def _scaler(scale: float = 8.0, growth_interval: int = 2) -> torch.amp.GradScaler:
    scaler = torch.amp.GradScaler("cpu", init_scale=scale, growth_factor=2.0, backoff_factor=0.5,
                                  growth_interval=growth_interval)
    scaler.scale(torch.ones(()))  # a loss was scaled: the scale tensor exists
    return scaler


def test_the_mean_weights_each_batch_by_its_samples_and_the_grads_are_taken() -> None:
    params = _params()
    acc = GradientAccumulator(params)
    _set(params, torch.tensor([1.0, 2.0, 3.0]), torch.full((2, 2), 4.0))
    assert acc.add(2) is True
    assert params[0].grad is None and params[1].grad is None
    _set(params, torch.tensor([5.0, 6.0, 7.0]), torch.full((2, 2), -4.0))
    assert acc.add(6) is True
    assert acc.samples == 8 and acc.dropped_batches == 0 and acc.overflows == 0
    mean = acc.mean()
    assert torch.equal(mean[0], (2 * torch.tensor([1.0, 2.0, 3.0]) + 6 * torch.tensor([5.0, 6.0, 7.0])) / 8)
    assert torch.equal(mean[1], torch.full((2, 2), -2.0))


def test_a_parameter_without_a_gradient_adds_nothing() -> None:
    params = _params()
    acc = GradientAccumulator(params)
    _set(params, torch.ones(3), None)
    assert acc.add(4)
    _set(params, None, torch.ones(2, 2))
    assert acc.add(4)
    mean = acc.mean()
    assert torch.equal(mean[0], torch.full((3,), 0.5))
    assert torch.equal(mean[1], torch.full((2, 2), 0.5))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_batch_with_nan_or_inf_is_dropped_and_the_rest_kept(bad: float) -> None:
    params = _params()
    acc = GradientAccumulator(params)
    _set(params, torch.ones(3), torch.ones(2, 2))
    assert acc.add(2)
    _set(params, torch.tensor([1.0, bad, 1.0]), torch.ones(2, 2))
    assert acc.add(5) is False
    assert params[0].grad is None and params[1].grad is None  # a dropped batch's grads are taken too
    assert acc.dropped_batches == 1 and acc.samples == 2 and acc.overflows == 0
    assert torch.equal(acc.mean()[0], torch.ones(3))


def test_no_samples_mean_zeros_and_zero_forgets_everything() -> None:
    params = _params()
    acc = GradientAccumulator(params)
    assert all(torch.equal(m, torch.zeros_like(p)) for m, p in zip(acc.mean(), params))
    _set(params, torch.ones(3), torch.ones(2, 2))
    acc.add(3)
    acc.zero()
    assert acc.samples == 0
    assert all(torch.equal(m, torch.zeros_like(p)) for m, p in zip(acc.mean(), params))
    _set(params, torch.full((3,), 2.0), torch.ones(2, 2))
    acc.add(1)
    assert torch.equal(acc.mean()[0], torch.full((3,), 2.0))  # nothing of before the zero() is left


def test_scaled_gradients_are_unscaled_and_the_scale_grows_after_clean_batches() -> None:
    params = _params()
    scaler = _scaler(scale=8.0, growth_interval=2)
    acc = GradientAccumulator(params, scaler)
    assert acc.scaler is scaler
    _set(params, torch.full((3,), 8.0), torch.full((2, 2), 16.0))  # true gradients 1 and 2, scaled by 8
    assert acc.add(1)
    assert scaler.get_scale() == 8.0  # one clean batch: not yet
    _set(params, torch.full((3,), 8.0), torch.full((2, 2), 16.0))
    assert acc.add(1)
    assert scaler.get_scale() == 16.0  # two in a row: grows by growth_factor
    _set(params, torch.full((3,), 16.0), torch.full((2, 2), 32.0))  # the same, at the new scale
    assert acc.add(2)
    assert scaler.get_scale() == 16.0  # the count starts again after a change
    mean = acc.mean()
    assert torch.equal(mean[0], torch.ones(3)) and torch.equal(mean[1], torch.full((2, 2), 2.0))


def test_an_overflow_backs_the_scale_off_and_restarts_the_clean_count() -> None:
    params = _params()
    scaler = _scaler(scale=8.0, growth_interval=2)
    acc = GradientAccumulator(params, scaler)
    _set(params, torch.full((3,), 8.0), torch.ones(2, 2))
    assert acc.add(1)
    _set(params, torch.full((3,), float("inf")), torch.ones(2, 2))
    assert acc.add(1) is False
    assert scaler.get_scale() == 4.0 and acc.overflows == 1 and acc.dropped_batches == 1
    _set(params, torch.full((3,), 4.0), torch.ones(2, 2))
    assert acc.add(1)
    assert scaler.get_scale() == 4.0  # one clean batch since the overflow, not two
    assert acc.samples == 2


def test_the_scale_never_grows_past_float32() -> None:
    params = _params()
    scaler = _scaler(scale=torch.finfo(torch.float32).max / 1.5, growth_interval=1)
    acc = GradientAccumulator(params, scaler)
    before = scaler.get_scale()
    _set(params, torch.ones(3), torch.ones(2, 2))
    assert acc.add(1)
    assert scaler.get_scale() == before


def test_a_disabled_scaler_is_no_scaler_and_one_never_used_is_a_clear_error() -> None:
    params = _params()
    assert GradientAccumulator(params, torch.amp.GradScaler("cpu", enabled=False)).scaler is None
    unused = torch.amp.GradScaler("cpu", init_scale=8.0)
    acc = GradientAccumulator(params, unused)
    _set(params, torch.ones(3), torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"never scaled a loss: use scaler\.scale\(loss\)\.backward\(\)"):
        acc.add(1)


def test_every_dropped_batch_and_overflow_is_counted_and_said(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    params = _params()
    acc = GradientAccumulator(params)
    with caplog.at_level(logging.INFO, logger="training.accumulator"):
        for size in (5, 7):
            _set(params, torch.full((3,), float("nan")), torch.ones(2, 2))
            assert not acc.add(size)
    assert acc.dropped_batches == 2
    assert [r.getMessage() for r in caplog.records] == [
        f"dropped a batch of {n} samples: its gradients hold NaN or Inf (the others are kept)" for n in (5, 7)]
    caplog.clear()
    scaler = _scaler(scale=8.0)
    acc = GradientAccumulator(params, scaler)
    with caplog.at_level(logging.INFO, logger="training.accumulator"):
        for _ in range(2):
            _set(params, torch.full((3,), float("inf")), torch.ones(2, 2))
            assert not acc.add(3)
    assert acc.overflows == 2 and acc.dropped_batches == 2 and scaler.get_scale() == 2.0
    assert [r.getMessage() for r in caplog.records] == [
        "dropped a batch of 3 samples: its gradients overflowed at loss scale 8 (the scale backs off to 4)",
        "dropped a batch of 3 samples: its gradients overflowed at loss scale 4 (the scale backs off to 2)"]


def test_a_scaler_that_never_scaled_is_refused_with_the_whole_reason() -> None:
    params = _params()
    acc = GradientAccumulator(params, torch.amp.GradScaler("cpu", init_scale=8.0))
    _set(params, torch.ones(3), torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"^the GradScaler given to the optimizer never scaled a loss: "
                                         r"use scaler\.scale\(loss\)\.backward\(\)$"):
        acc.add(1)


class _Calls(torch.overrides.TorchFunctionMode):
    """The torch calls made inside it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_a_batch_costs_the_same_few_torch_calls_for_3_parameters_or_300() -> None:
    """The GPU's reason: add() runs on the training peer's event loop after every micro-batch, and a
    kernel launch per parameter (two: the finiteness check's sum and the add) cost it ~400 launches a
    micro-batch for the example model. The check and the add are fused over the parameters."""
    def calls(n: int) -> list[str]:
        params = [torch.zeros(4, requires_grad=True) for _ in range(n)]
        acc = GradientAccumulator(params)
        _set(params, *[torch.full((4,), float(i)) for i in range(n)])
        with _Calls() as mode:
            assert acc.add(2)
        assert torch.equal(acc.mean()[n - 1], torch.full((4,), float(n - 1)))
        # what computes (not .grad's attribute reads, sizes, or .to() to the dtype a tensor has)
        return [name for name in mode.names if not name.startswith("__")
                and name not in ("numel", "is_floating_point", "to", "device")]
    few = calls(3)
    assert calls(300) == few and "_foreach_add_" in few and len(few) < 10, few


def test_a_batch_with_no_gradient_at_all_adds_nothing_and_counts_its_samples() -> None:
    params = _params()
    acc = GradientAccumulator(params)
    _set(params, None, None)
    assert acc.add(3) is True
    assert acc.samples == 3 and all(torch.equal(m, torch.zeros_like(m)) for m in acc.mean())
