"""The userspace wire's core (nat.delay_line.DelayLine): packets in, packets out, a fake clock."""

from __future__ import annotations

import random

import pytest

from nat.delay_line import DelayLine


def test_every_packet_leaves_after_the_delay_in_the_order_it_came() -> None:
    line = DelayLine(delay=0.05)
    for i in range(5):
        assert line.push(bytes([i]), now=1.0 + i * 0.01)
    assert line.next_deadline() == pytest.approx(1.05)
    assert line.due(1.049) == []
    assert line.due(1.06) == [b"\x00", b"\x01"]
    assert line.due(10.0) == [b"\x02", b"\x03", b"\x04"]
    assert line.next_deadline() is None and len(line) == 0 and line.passed == 5


def test_zero_delay_passes_at_once() -> None:
    line = DelayLine(delay=0.0)
    line.push(b"x", now=3.0)
    assert line.due(3.0) == [b"x"]


def test_loss_drops_its_share_independently_and_repeatably() -> None:
    def run(seed: int) -> tuple[int, list[bytes]]:
        line = DelayLine(delay=0.01, loss=0.2, rng=random.Random(seed))
        for i in range(10_000):
            line.push(i.to_bytes(2, "big"), now=0.0)
        return line.lost, line.due(1.0)

    lost, out = run(7)
    assert 1_800 < lost < 2_200 and lost + len(out) == 10_000
    assert out == sorted(out)  # the survivors keep their order
    assert run(7) == (lost, out)  # a seed repeats the run
    assert run(8)[1] != out


def test_a_full_queue_drops_the_newcomer_and_counts_it() -> None:
    line = DelayLine(delay=1.0, limit=3)
    assert [line.push(b"%d" % i, now=0.0) for i in range(5)] == [True, True, True, False, False]
    assert line.overflowed == 2 and line.due(1.0) == [b"0", b"1", b"2"]


def test_nonsense_is_refused() -> None:
    with pytest.raises(ValueError):
        DelayLine(delay=-1.0)
    with pytest.raises(ValueError):
        DelayLine(delay=0.0, loss=1.5)
