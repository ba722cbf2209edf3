"""The expert client's call table (training/moe/calls.py) and the protocol's vocabulary, without a socket.

Each of the eight incidents in the call path's history (the module docstring of
``training/moe/calls.py`` numbers them) is replayed here against the pure table,
with the time passed in: milliseconds each.
"""

from __future__ import annotations

import pytest
import torch
import trio

from p2p.errors import ConfigError, DedlocError, DialError
from p2p.multistream import PeerRefused
from p2p.resources import ResourceLimitExceeded, Scope
from training.moe.calls import MAX_BANS, CallTable, ClientConfig, new_stream_tries
from training.moe.protocol import (MAX_EXPERTS, MAX_REQUEST_HEADER, Expert, ExpertCallError, Kind, Status,
                                   answer_limit, check_answer, describe, failure, header_bytes, refused_busy,
                                   split_answer, status_error)
from training.proto import moe_pb2 as pb

from .kit import numbered_peer_id as peer

A, B = peer(1), peer(2)


def table(**config: object) -> CallTable[str, str, str]:
    return CallTable(ClientConfig(**config))  # type: ignore[arg-type]


# ---------------------------------------------------------------------- incident 1: a stream per call


def test_1_streams_are_kept_between_calls_and_the_newest_is_taken_first() -> None:
    t = table()
    assert t.take_stream(A, 0.0) is None  # nothing kept: the shell opens one
    t.keep(A, "s1", 1.0)
    t.keep(A, "s2", 2.0)
    assert t.take_stream(B, 2.5) is None  # kept per server
    assert t.take_stream(A, 3.0) == "s2" and t.take_stream(A, 3.0) == "s1" and t.take_stream(A, 3.0) is None
    assert t.reset_next() is None  # nothing was taken out of use


# ---------------------------------------------------------------------- incident 2: more streams than the server allows


def test_2_calls_in_flight_per_server_are_bounded_and_the_rest_wait_in_order() -> None:
    t = table(max_streams_per_server=2, max_idle_streams=2)
    assert t.acquire(A, "w1") and t.acquire(A, "w2")
    assert t.in_flight(A) == 2
    assert not t.acquire(A, "w3") and not t.acquire(A, "w4")  # in line, in order
    assert t.acquire(B, "x1")  # another server's slots are its own
    assert t.release(A) == "w3"  # the slot passes on: still two in flight
    assert t.in_flight(A) == 2
    assert t.withdraw(A, "w4")  # gave up in line: it held nothing
    assert not t.withdraw(A, "w4")
    assert t.release(A) is None and t.in_flight(A) == 1
    assert t.acquire(A, "w5")  # a free slot, nobody in line
    assert not t.acquire(A, "w6")
    assert not t.withdraw(A, "w1")  # it holds a slot: the shell releases it
    assert t.release(A) == "w6"
    assert t.release(A) is None and t.release(A) is None
    assert t.in_flight(A) == 0 and t.servers() == 1  # B still holds one; A is forgotten
    assert t.release(B) is None and t.servers() == 0


def test_2_a_waiter_behind_others_does_not_jump_the_line_when_a_slot_frees() -> None:
    t = table(max_streams_per_server=1, max_idle_streams=1)
    assert t.acquire(A, "w1")
    assert not t.acquire(A, "w2")
    # w1's slot goes to w2, never back to "free" where a newcomer would take it
    assert t.release(A) == "w2" and not t.acquire(A, "newcomer")
    assert t.release(A) == "newcomer"


# ---------------------------------------------------------------------- incident 3: closed, not reset


def test_3_streams_taken_out_of_use_are_handed_back_to_be_reset() -> None:
    t = table(max_streams_per_server=4, max_idle_streams=2, keep_streams_for=10.0)
    for i, now in enumerate((0.0, 1.0, 2.0)):
        t.keep(A, f"s{i}", now)  # the third is one more than max_idle_streams
    assert t.reset_next() == "s2" and t.reset_next() is None
    # s1 (kept at 1.0) is idle for exactly keep_streams_for at 11.0: too old, like s0
    assert t.take_stream(A, 11.0) is None
    assert {t.reset_next(), t.reset_next()} == {"s0", "s1"} and t.reset_next() is None
    t.keep(A, "s3", 20.0)
    t.keep(B, "s4", 20.0)
    assert sorted(t.close()) == ["s3", "s4"] and t.take_stream(A, 20.0) is None and t.servers() == 0


def test_3_a_stream_just_under_its_age_is_still_taken() -> None:
    t = table(keep_streams_for=10.0)
    t.keep(A, "s", 5.0)
    assert t.take_stream(A, 14.999) == "s"
    assert t.servers() == 0  # nothing left for A: forgotten
    t.keep(A, "old", 0.0)
    assert t.take_stream(A, 10.0) is None and t.servers() == 0 and t.reset_next() == "old"


def test_a_server_with_streams_kept_is_remembered_after_its_calls() -> None:
    t = table()
    t.keep(A, "s", 0.0)
    assert t.acquire(A, "w") and t.release(A) is None
    assert t.servers() == 1 and t.take_stream(A, 1.0) == "s"
    assert not t.withdraw(B, "never seen")  # a server the table holds nothing for: no slot, nothing in line


# ---------------------------------------------------------------------- incident 4: long bans of busy experts


def test_4_a_busy_expert_is_left_out_briefly_a_broken_one_long() -> None:
    t = table(ban_time=30.0, overload_ban_time=1.0)
    assert t.ban("ffn.0", A, status_error("expert ffn.0", Status.OVERLOADED, "queue full"), 100.0) == 1.0
    assert t.banned("ffn.0", A, 100.5) and not t.banned("ffn.0", B, 100.5) and not t.banned("ffn.1", A, 100.5)
    assert not t.banned("ffn.0", A, 101.0)  # the ban ends at its time exactly
    refused = failure(PeerRefused(str(ResourceLimitExceeded(Scope.PEER_PROTOCOL, "inbound streams", 128,
                                                            what="/dedloc/moe/expert/1.0.0"))), "expert x", 5.0)
    assert refused.busy and t.ban("ffn.0", A, refused, 200.0) == 1.0
    for broken in (status_error("e", Status.FAILED, "boom"), ExpertCallError("e: answered 3 tensors, not 1"),
                   failure(PeerRefused("unauthenticated: no pass"), "e", 5.0), failure(trio.TooSlowError(), "e", 5.0)):
        assert not broken.busy
        assert t.ban("ffn.1", A, broken, 300.0) == 30.0
    assert t.banned("ffn.1", A, 329.9) and not t.banned("ffn.1", A, 330.0)
    t.ban("ffn.2", A, ExpertCallError("e"), 400.0)
    assert t.ban_left("ffn.2", A, 410.0) == 20.0 and t.ban_left("ffn.2", A, 430.0) == 0.0  # what an error says
    assert t.ban_left("ffn.3", A, 410.0) == 0.0


def test_4_an_unreachable_server_has_every_expert_left_out() -> None:
    """A call that could not connect to its server (a DialError, wrapped or not) leaves out every
    expert of that server, as long as the one called; other failures leave out the one alone."""
    t = table(ban_time=30.0)
    unreachable = failure(DialError("could not connect to it"), "expert ffn.0", 5.0)
    assert unreachable.unreachable and t.ban("ffn.0", A, unreachable, 100.0) == 30.0
    assert t.banned("ffn.7", A, 100.5) and not t.banned("ffn.7", B, 100.5)
    assert t.ban_left("ffn.7", A, 110.0) == 20.0 and t.unreachable(A, 110.0) and not t.unreachable(B, 110.0)
    assert not t.banned("ffn.7", A, 130.0) and not t.unreachable(A, 130.0)
    wrapped = RuntimeError()
    wrapped.__cause__ = DialError("no route")
    assert failure(wrapped, "e", 1.0).unreachable
    for other in (failure(OSError("connection reset"), "e", 1.0), failure(trio.TooSlowError(), "e", 1.0),
                  status_error("e", Status.FAILED, "boom")):
        assert not other.unreachable
        t.ban("ffn.1", B, other, 200.0)
    assert t.banned("ffn.1", B, 200.5) and not t.banned("ffn.2", B, 200.5) and not t.unreachable(B, 200.5)
    t.ban("ffn.3", B, ExpertCallError("e"), 300.0)  # the later of its own ban and its server's
    t.ban("ffn.4", B, ExpertCallError("e", unreachable=True), 320.0)
    assert t.ban_left("ffn.3", B, 325.0) == 25.0


def test_4_bans_are_bounded_and_the_oldest_half_forgotten() -> None:
    t = table()
    error = ExpertCallError("e")
    for i in range(MAX_BANS):
        t.ban(f"u{i}", A, error, float(i))
    t.ban("newest", A, error, float(MAX_BANS))
    assert t.banned("newest", A, float(MAX_BANS)) and t.banned(f"u{MAX_BANS - 1}", A, float(MAX_BANS))
    assert not t.banned("u0", A, 0.0) and not t.banned(f"u{MAX_BANS // 2 - 1}", A, 0.0)
    assert t.banned(f"u{MAX_BANS // 2}", A, 0.0)


# ---------------------------------------------------------------------- incident 5: a wrong answer's stream kept


def test_5_a_wrong_answer_fails_its_check_so_its_stream_is_never_given_back() -> None:
    x = torch.randn(3, 4)
    with pytest.raises(ExpertCallError, match=r"^expert e: answered \[2, 4\] for 3 rows$"):
        check_answer("expert e", Kind.FORWARD, [x], [torch.randn(2, 4)])
    with pytest.raises(ExpertCallError, match=r"^expert e: answered 2 tensors, not 1$"):
        check_answer("expert e", Kind.FORWARD, [x], [x, x])
    with pytest.raises(ExpertCallError, match=r"^expert e: answered \[\] for 3 rows$"):
        check_answer("expert e", Kind.FORWARD, [x], [torch.tensor(1.0)])
    with pytest.raises(ExpertCallError, match=r"^expert e: input gradient \[3, 5\] for an input of \[3, 4\]$"):
        check_answer("expert e", Kind.BACKWARD, [x, torch.randn(3, 2)], [torch.randn(3, 5)])
    with pytest.raises(ExpertCallError, match=r"^expert e: answered 1 tensors, not 2$"):
        check_answer("expert e", Kind.INFO, [], [x])
    # a row may be a single value, and an input's gradient has the input's shape, not the gradient's
    assert check_answer("expert e", Kind.FORWARD, [x], [torch.ones(3)])[0].shape == (3,)
    assert check_answer("expert e", Kind.BACKWARD, [x, torch.randn(3, 2)], [torch.randn(3, 4)])[0].shape == (3, 4)
    out = check_answer("expert e", Kind.FORWARD, [x], [x.half()])
    assert out[0].dtype == torch.float32 and torch.allclose(out[0], x, atol=1e-2)
    info = check_answer("expert e", Kind.INFO, [], [torch.randn(1, 4), torch.randn(1, 7)])
    assert [t.shape for t in info] == [(1, 4), (1, 7)]
    # the table keeps only what the shell gives back, and only until it is taken
    t = table()
    t.keep(A, "good", 0.0)
    assert t.take_stream(A, 1.0) == "good" and t.take_stream(A, 1.0) is None


def test_5_a_many_expert_answer_is_split_each_expert_on_its_own() -> None:
    experts = [Expert(f"ffn.{i}", A) for i in range(3)]
    inputs = [[torch.randn(2, 4)], [torch.randn(1, 4)], [torch.randn(3, 4)]]
    rows = [2, 1, 3]
    response = pb.ExpertResponse(statuses=[Status.OK, Status.OVERLOADED, Status.OK], reasons=["", "full", ""])
    out = torch.arange(5 * 4, dtype=torch.float16).view(5, 4)
    results = split_answer("s", experts, Kind.FORWARD, inputs, rows, response, [out])
    assert isinstance(results[0], list) and torch.equal(results[0][0], out[:2].float())
    assert isinstance(results[2], list) and torch.equal(results[2][0], out[2:].float())
    error = results[1]
    assert isinstance(error, ExpertCallError) and error.busy and not error.timed_out
    assert str(error) == f"expert {experts[1]}: overloaded: full"
    none_ok = pb.ExpertResponse(statuses=[Status.FAILED] * 3, reasons=["", "x", ""])
    failed = split_answer("s", experts, Kind.FORWARD, inputs, rows, none_ok, [])
    assert [str(e) for e in failed] == [f"expert {experts[0]}: failed: no reason given",
                                        f"expert {experts[1]}: failed: x", f"expert {experts[2]}: failed: no reason given"]
    assert not any(isinstance(e, ExpertCallError) and e.busy for e in failed)
    with pytest.raises(ExpertCallError, match="^s: answered 2 statuses for 3 experts$"):
        split_answer("s", experts, Kind.FORWARD, inputs, rows, pb.ExpertResponse(statuses=[Status.OK] * 2, reasons=["", ""]), [out])
    with pytest.raises(ExpertCallError, match="^s: answered 3 statuses for 3 experts$"):  # 2 reasons
        split_answer("s", experts, Kind.FORWARD, inputs, rows, pb.ExpertResponse(statuses=[Status.OK] * 3, reasons=["", ""]),
                     [out])
    with pytest.raises(ExpertCallError, match="^s: answered 0 tensors$"):
        split_answer("s", experts, Kind.FORWARD, inputs, rows, response, [])
    with pytest.raises(ExpertCallError, match="^s: answered 1 tensors$"):
        split_answer("s", experts, Kind.FORWARD, inputs, rows, none_ok, [out])
    with pytest.raises(ExpertCallError, match=r"^s: answered \[6, 4\] for 5 rows$"):
        split_answer("s", experts, Kind.FORWARD, inputs, rows, response, [torch.randn(6, 4)])
    with pytest.raises(ExpertCallError, match=r"^s: answered \[\] for 5 rows$"):
        split_answer("s", experts, Kind.FORWARD, inputs, rows, response, [torch.tensor(2.0)])
    # outputs may be narrower than inputs, or one value a row
    narrow = split_answer("s", experts, Kind.FORWARD, inputs, rows, response, [torch.randn(5, 3)])
    assert [r[0].shape for r in narrow if isinstance(r, list)] == [(2, 3), (3, 3)]
    flat = split_answer("s", experts, Kind.FORWARD, inputs, rows, response, [torch.randn(5)])
    assert [r[0].shape for r in flat if isinstance(r, list)] == [(2,), (3,)]
    # a backward's gradient must have its input's shape, each expert on its own
    grads = split_answer("s", experts, Kind.BACKWARD, inputs, rows, response, [torch.randn(5, 3)])
    assert str(grads[0]) == f"expert {experts[0]}: input gradient [2, 3] for an input of [2, 4]"
    assert isinstance(grads[0], ExpertCallError) and not grads[0].busy


# ---------------------------------------------------------------------- incidents 6 and 7: joined calls


def test_6_calls_join_only_when_every_slot_is_in_use_or_their_kind_already_waits() -> None:
    t = table(max_streams_per_server=2, max_idle_streams=2)
    assert not t.joins(A, Kind.FORWARD)  # a server the table has never seen: a slot of its own
    assert t.acquire(A, "w1") and not t.joins(A, Kind.FORWARD)
    assert t.acquire(A, "w2") and t.joins(A, Kind.FORWARD) and t.joins(A, Kind.BACKWARD)
    group, first, new = t.join(A, Kind.FORWARD, "c1", experts=2, rows=10, size=100, header=20, deadline=5.0)
    assert new and first == 0
    assert t.release(A) is None  # a slot frees: forwards still go behind the waiting group, backwards not
    assert t.joins(A, Kind.FORWARD) and not t.joins(A, Kind.BACKWARD)
    same, first, new = t.join(A, Kind.FORWARD, "c2", experts=3, rows=5, size=50, header=30, deadline=4.0)
    assert same is group and not new and first == 2
    assert (group.items, group.experts, group.rows, group.size, group.header) == (["c1", "c2"], 5, 15, 150, 50)
    assert group.deadline == 5.0  # the latest of its callers' deadlines, never an earlier one
    t.join(A, Kind.FORWARD, "c3", experts=1, rows=1, size=1, header=1, deadline=9.0)
    assert group.deadline == 9.0
    other, _, new = t.join(A, Kind.BACKWARD, "b1", experts=1, rows=1, size=1, header=1, deadline=1.0)
    assert new and other is not group  # one group per kind
    t.sending(A, group)  # it has its slot: the next forward starts a new group
    fresh, first, new = t.join(A, Kind.FORWARD, "c4", experts=1, rows=1, size=1, header=1, deadline=1.0)
    assert new and fresh is not group and first == 0
    t.sending(A, group)  # a group already sent: nothing changes
    assert t.joins(A, Kind.FORWARD)
    t.sending(A, fresh)
    t.sending(A, other)
    assert not t.joins(A, Kind.FORWARD) and t.in_flight(A) == 1
    assert t.release(A) is None and t.servers() == 0


@pytest.mark.parametrize("limit, grow", [
    ("experts", dict(experts=MAX_EXPERTS - 10)),
    ("rows", dict(rows=4096 - 10)),
    ("size", dict(size=256 * 1024 - 10)),
    ("header", dict(header=MAX_REQUEST_HEADER - 64 - 10)),
])
def test_7_a_group_grows_to_each_limit_and_no_further(limit: str, grow: dict[str, int]) -> None:
    """Up to 1024 experts, max_rows rows, max_join_bytes of tensors (incident 7: one stream window) and
    the server's request header, less 64 bytes for the rest of the request."""
    t = table()
    base = dict(experts=1, rows=1, size=1, header=1)
    group, _, _ = t.join(A, Kind.FORWARD, "first", **{**base, **grow}, deadline=1.0)
    assert getattr(group, limit) == grow[limit]
    exact, _, new = t.join(A, Kind.FORWARD, "fits", **{**base, limit: 10}, deadline=1.0)
    assert exact is group and not new  # exactly at the limit still fits
    over, first, new = t.join(A, Kind.FORWARD, "over", **base, deadline=1.0)
    assert new and over is not group and first == 0 and over.items == ["over"]


def test_7_the_join_limits_come_from_the_config() -> None:
    t = table(max_rows=100, max_join_bytes=1000)
    t.join(A, Kind.FORWARD, "a", experts=1, rows=60, size=600, header=1, deadline=1.0)
    assert t.join(A, Kind.FORWARD, "b", experts=1, rows=41, size=1, header=1, deadline=1.0)[2]
    t2 = table(max_rows=100, max_join_bytes=1000)
    t2.join(A, Kind.FORWARD, "a", experts=1, rows=60, size=600, header=1, deadline=1.0)
    assert t2.join(A, Kind.FORWARD, "b", experts=1, rows=1, size=401, header=1, deadline=1.0)[2]
    assert not t2.join(A, Kind.FORWARD, "c", experts=1, rows=40, size=399, header=1, deadline=1.0)[2]


# ---------------------------------------------------------------------- incident 8: a fresh stream reset


def test_8_a_forward_or_info_is_tried_twice_on_new_streams_a_backward_once() -> None:
    assert new_stream_tries(Kind.FORWARD) == 2 and new_stream_tries(Kind.INFO) == 2
    assert new_stream_tries(Kind.BACKWARD) == 1


# ---------------------------------------------------------------------- the vocabulary


def test_failures_are_worded_once_and_typed() -> None:
    slow = failure(trio.TooSlowError(), "expert e", 2.25)
    assert str(slow) == "expert e: no answer within 2.2 s" and slow.timed_out and not slow.busy
    own = ExpertCallError("expert e: bad answer", busy=True)
    assert failure(own, "ignored", 1.0) is own
    reset = failure(OSError("connection reset"), "expert e", 1.0)
    assert str(reset) == "expert e: OSError: connection reset" and not reset.busy and not reset.timed_out
    assert isinstance(reset, DedlocError)
    # py-libp2p's bare wrapper: the cause says what happened; a wrapped refusal is still seen as busy
    refusal = PeerRefused(str(ResourceLimitExceeded(Scope.PEER, "streams", 2)))
    try:
        try:
            raise refusal
        except PeerRefused as cause:
            raise RuntimeError() from cause
    except RuntimeError as wrapped:
        assert describe(wrapped) == f"RuntimeError: (PeerRefused: {refusal})"
        assert refused_busy(wrapped) and failure(wrapped, "e", 1.0).busy
    bare = RuntimeError()
    bare.__cause__ = refusal  # raised "from" it outside any handler: no context
    assert refused_busy(bare) and describe(bare) == f"RuntimeError: (PeerRefused: {refusal})"
    deep, deep.__cause__ = RuntimeError(), bare
    assert refused_busy(deep)  # a refusal under two wrappers
    deep, deep.__cause__ = RuntimeError(), deep
    assert refused_busy(deep) is False  # three: not looked for
    assert refused_busy(RuntimeError("x")) is False and refused_busy(PeerRefused("gone")) is False
    assert describe(ValueError("plain")) == "ValueError: plain"
    assert str(status_error("e", Status.BAD_REQUEST, "")) == "e: bad_request: no reason given"
    assert not status_error("e", Status.UNKNOWN_EXPERT, "x").busy


def test_request_and_answer_sizes() -> None:
    assert answer_limit(3, 2) == 4 * 3 * (1 << 16) * 2
    assert header_bytes(["ffn.1", "é"]) == (5 + 6) + (2 + 6)
    assert str(Expert("ffn.3", A)) == f"ffn.3@{str(A)[-8:]}"


def test_the_client_config_refuses_nonsense() -> None:
    ClientConfig().validate()
    ClientConfig(max_rows=1, max_threads=1, max_streams_per_server=1, max_idle_streams=1, max_join_bytes=1).validate()
    for bad, match in [(dict(forward_timeout=0), "forward_timeout must be positive, got 0"),
                       (dict(keep_streams_for=-1.0), "keep_streams_for must be positive"),
                       (dict(max_rows=0), "max_rows must be at least 1, got 0"),
                       (dict(max_streams_per_server=2, max_idle_streams=3),
                        "^expert client: max_idle_streams cannot exceed max_streams_per_server$")]:
        with pytest.raises(ConfigError, match=match):
            ClientConfig(**bad).validate()  # type: ignore[arg-type]
