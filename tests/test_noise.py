"""The Noise transport phase: NoiseCodec with no I/O, NoiseSession over in-memory pipes,
NoiseTransport's handshake hand-over. Wire format checked against ``cryptography`` directly."""

from __future__ import annotations

import os
import random
import struct
import threading

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
import trio.testing
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from libp2p.connection_types import ConnectionType
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.io.exceptions import ConnectionClosedError
from libp2p.peer.id import ID
from libp2p.crypto.x25519 import create_new_key_pair as x25519
from libp2p.security.noise.exceptions import (
    HandshakeHasNotFinished,
    InvalidSignature,
    NoiseStateError,
    PeerIDMismatchesPubkey,
)
from libp2p.security.noise.transport import Transport as HandshakeTransport

from p2p import multistream, noise
from p2p.errors import ConfigError
from p2p.noise import (
    MAX_MESSAGE,
    MAX_PLAINTEXT,
    OWN_MESSAGE,
    TAG_SIZE,
    CryptoPool,
    NoiseCodec,
    NoiseConfig,
    NoiseError,
    NoiseSession,
    NoiseTransport,
    READ_SIZE,
    crypto_threads_for,
    pieces,
    process_cores,
    spans,
    usable_cores,
)

KEY_A = bytes(range(32))
KEY_B = bytes(range(100, 132))
TAG = 16
#: An incomplete message is at most its 2-byte prefix and all but one byte of a full body.
MAX_BUFFERED = 2 + MAX_MESSAGE - 1


def codec_pair(**nonces: int) -> tuple[NoiseCodec, NoiseCodec]:
    """Two ends of one channel: what ``a`` seals ``b`` opens, and back."""
    a = NoiseCodec(KEY_A, KEY_B, send_nonce=nonces.get("a", 0), recv_nonce=nonces.get("b", 0))
    b = NoiseCodec(KEY_B, KEY_A, send_nonce=nonces.get("b", 0), recv_nonce=nonces.get("a", 0))
    return a, b


def spec_messages(wire: bytes | bytearray) -> list[bytes]:
    """Split wire bytes into message bodies by the spec's 2-byte big-endian prefix."""
    out, pos = [], 0
    while pos < len(wire):
        (length,) = struct.unpack_from(">H", wire, pos)
        out.append(bytes(wire[pos + 2 : pos + 2 + length]))
        pos += 2 + length
    assert pos == len(wire), "wire bytes end in the middle of a message"
    return out


def spec_nonce(n: int) -> bytes:
    return b"\x00" * 4 + n.to_bytes(8, "little")


def opened(codec: NoiseCodec, wire: bytes | bytearray | memoryview) -> bytes:
    return b"".join(codec.feed(wire))


# ---------------------------------------------------------------------------- NoiseCodec, no I/O


@pytest.mark.parametrize(
    "size", [0, 1, MAX_PLAINTEXT - 1, MAX_PLAINTEXT, MAX_PLAINTEXT + 1, 2 * MAX_PLAINTEXT, 3 * 1024 * 1024 + 7]
)
def test_round_trip_sizes(size):
    a, b = codec_pair()
    plain = random.Random(size).randbytes(size)
    wire = a.encrypt(plain)
    messages = spec_messages(wire)
    assert len(messages) == -(-size // MAX_PLAINTEXT)
    assert len(wire) == size + len(messages) * (2 + TAG)
    assert all(len(m) <= MAX_MESSAGE for m in messages)
    assert opened(b, wire) == plain
    assert b.buffered == 0


def test_exactly_max_plaintext_is_one_full_message():
    a, b = codec_pair()
    wire = a.encrypt(b"\x01" * MAX_PLAINTEXT)
    assert wire[:2] == b"\xff\xff" and len(wire) == 2 + MAX_MESSAGE
    assert b.feed(wire) == [b"\x01" * MAX_PLAINTEXT]
    wire = a.encrypt(b"\x02" * (MAX_PLAINTEXT + 1))
    assert [len(m) for m in spec_messages(wire)] == [MAX_MESSAGE, 1 + TAG]
    assert b.feed(wire) == [b"\x02" * MAX_PLAINTEXT, b"\x02"]


def test_empty_input_makes_no_message_and_uses_no_nonce():
    a, b = codec_pair()
    assert a.encrypt() == b"" and a.encrypt(b"", bytearray(), memoryview(b"")) == b""
    assert b.feed(b"") == []
    # The first real message still carries nonce 0.
    wire = a.encrypt(b"x")
    assert ChaCha20Poly1305(KEY_A).decrypt(spec_nonce(0), spec_messages(wire)[0], None) == b"x"


def test_parts_of_every_buffer_type_are_sealed_back_to_back():
    rng = random.Random(1)
    raw = rng.randbytes(5 * 1024 * 1024 + 3)
    # Cut at sizes that straddle message boundaries every which way.
    cuts = [0, 1, 2, MAX_PLAINTEXT - 1, MAX_PLAINTEXT + 5, 3 * MAX_PLAINTEXT, 3 * MAX_PLAINTEXT + 1, 2 * 1024 * 1024, len(raw)]
    kinds = [bytes, bytearray, memoryview]
    parts = [kinds[i % 3](raw[lo:hi]) for i, (lo, hi) in enumerate(zip(cuts, cuts[1:]))]
    a, b = codec_pair()
    wire = a.encrypt(*parts)
    # Parts are packed back to back, except that a part of OWN_MESSAGE bytes or more starts a message
    expected, pending = [], 0
    for part in parts:
        left = len(part)
        if left >= OWN_MESSAGE and pending:
            expected.append(pending)
            pending = 0
        while left:
            take = min(left, MAX_PLAINTEXT - pending)
            pending, left = pending + take, left - take
            if pending == MAX_PLAINTEXT:
                expected.append(pending)
                pending = 0
    expected += [pending] if pending else []
    assert [len(m) - TAG_SIZE for m in spec_messages(wire)] == expected
    assert opened(b, wire) == raw


def test_a_yamux_header_before_a_big_body_is_sealed_alone_and_the_body_in_place():
    """A 12-byte header and a 100 KiB body: the header is one message, the body starts the next (no
    copy joins them); a small body still rides with its header."""
    a, b = codec_pair()
    body = bytes(range(256)) * 400
    wire = a.encrypt(b"H" * 12, body)
    assert [len(m) - TAG_SIZE for m in spec_messages(wire)] == [12, MAX_PLAINTEXT, len(body) - MAX_PLAINTEXT]
    assert opened(b, wire) == b"H" * 12 + body
    small = a.encrypt(b"H" * 12, body[:OWN_MESSAGE - 1])
    assert [len(m) - TAG_SIZE for m in spec_messages(small)] == [12 + OWN_MESSAGE - 1]


def test_non_byte_memoryview_is_read_as_its_bytes():
    import array

    values = array.array("I", range(1000))
    a, b = codec_pair()
    assert opened(b, a.encrypt(memoryview(values))) == values.tobytes()


def test_one_byte_at_a_time_and_random_splits_give_the_same_plaintext():
    rng = random.Random(7)
    plain = rng.randbytes(3 * MAX_PLAINTEXT + 1234)
    a = codec_pair()[0]
    wire = bytes(a.encrypt(plain[:100], plain[100:]))

    _, b = codec_pair()
    got = bytearray()
    for i in range(len(wire)):
        got += opened(b, wire[i : i + 1])
        assert b.buffered <= MAX_BUFFERED
    assert got == plain and b.buffered == 0

    for trial in range(20):
        _, b = codec_pair()
        got = bytearray()
        pos = 0
        while pos < len(wire):
            step = rng.choice([1, 2, 3, 17, 1000, MAX_MESSAGE, MAX_MESSAGE + 2, rng.randrange(1, 200_000)])
            chunk = wire[pos : pos + step]
            got += opened(b, rng.choice([bytes, bytearray, memoryview])(chunk))
            assert b.buffered <= MAX_BUFFERED
            pos += step
        assert got == plain and b.buffered == 0, trial


def test_buffered_holds_only_an_incomplete_message():
    a, b = codec_pair()
    wire = a.encrypt(b"y" * MAX_PLAINTEXT)  # one 65537-byte message on the wire
    assert b.feed(wire[:1]) == [] and b.buffered == 1
    assert b.feed(wire[1:-1]) == [] and b.buffered == len(wire) - 1 == MAX_BUFFERED
    assert b.feed(wire[-1:]) == [b"y" * MAX_PLAINTEXT] and b.buffered == 0
    # Ten full messages and the start of an eleventh in one feed: only the start is kept.
    wire = a.encrypt(b"z" * (10 * MAX_PLAINTEXT + 100))
    out = b.feed(wire[:-50])
    assert len(out) == 10 and b.buffered == 2 + 100 + TAG - 50


def test_nonces_advance_in_step_and_order_matters():
    a, b = codec_pair()
    first, second = a.encrypt(b"same"), a.encrypt(b"same")
    assert first != second  # a new nonce per message
    assert opened(b, first) == b"same"
    assert opened(b, second) == b"same"
    # Replaying a message (its nonce is spent) fails.
    with pytest.raises(NoiseError, match="authentication"):
        b.feed(first)

    a, b = codec_pair()
    first, second = a.encrypt(b"one"), a.encrypt(b"two")
    with pytest.raises(NoiseError, match="authentication"):
        b.feed(second)  # out of order: opened with nonce 0, sealed with nonce 1


def test_both_directions_are_independent():
    a, b = codec_pair()
    for i in range(5):
        assert opened(b, a.encrypt(b"ping %d" % i)) == b"ping %d" % i
        assert opened(a, b.encrypt(b"pong %d" % i)) == b"pong %d" % i
    assert opened(b, a.encrypt(b"x" * 10) + a.encrypt(b"y" * 10)) == b"x" * 10 + b"y" * 10


def test_wire_format_matches_the_libp2p_spec():
    """2-byte big-endian length, ChaCha20-Poly1305 with nonce = 4 zero bytes + 64-bit LE counter, no AD."""
    plain = random.Random(3).randbytes(2 * MAX_PLAINTEXT + 10)
    a, _ = codec_pair(a=41)  # start mid-stream, as after a handshake
    wire = a.encrypt(plain)
    reference = ChaCha20Poly1305(KEY_A)
    pieces = [reference.decrypt(spec_nonce(41 + i), body, None) for i, body in enumerate(spec_messages(wire))]
    assert b"".join(pieces) == plain
    assert [len(p) for p in pieces] == [MAX_PLAINTEXT, MAX_PLAINTEXT, 10]
    # Empty associated data is not the same as none at all in some libraries; the spec means empty.
    assert reference.decrypt(spec_nonce(41), spec_messages(wire)[0], b"") == pieces[0]

    # And the other way: messages sealed independently are opened by the codec.
    _, b = codec_pair(a=1000)
    wire = b""
    for i, text in enumerate([b"hello", b"", b"world" * 3000]):
        body = reference.encrypt(spec_nonce(1000 + i), text, None)
        wire += len(body).to_bytes(2, "big") + body
    assert b.feed(wire) == [b"hello", b"world" * 3000]  # an empty message carries nothing


def test_flipped_ciphertext_bit_fails_authentication_and_the_codec_stays_failed():
    a, b = codec_pair()
    assert opened(b, a.encrypt(b"fine")) == b"fine"
    wire = bytearray(a.encrypt(b"secret data"))
    wire[2 + 3] ^= 0x10
    with pytest.raises(NoiseError, match=r"#1 failed authentication"):
        b.feed(wire)
    # Nothing more is accepted, not even a genuine next message.
    for more in (a.encrypt(b"next"), b"", b"\x00"):
        with pytest.raises(NoiseError, match="authentication"):
            b.feed(more)
    assert b.buffered == 0


@pytest.mark.parametrize("where", ["ciphertext", "tag"])
def test_garbling_anywhere_in_a_message_is_caught(where):
    a, b = codec_pair()
    wire = bytearray(a.encrypt(b"q" * 1000))
    wire[-1 if where == "tag" else 2] ^= 0x01
    with pytest.raises(NoiseError):
        b.feed(wire)


def test_a_garbled_message_after_good_ones_in_the_same_read_fails():
    a, b = codec_pair()
    wire = bytearray(a.encrypt(b"ok1") + a.encrypt(b"ok2") + a.encrypt(b"bad"))
    wire[-5] ^= 0xFF
    with pytest.raises(NoiseError, match="#2 failed authentication"):
        b.feed(wire)


@pytest.mark.parametrize("length", [0, 1, TAG - 1])
def test_message_shorter_than_the_tag_is_refused(length):
    _, b = codec_pair()
    with pytest.raises(NoiseError, match="shorter than its 16-byte tag"):
        b.feed(length.to_bytes(2, "big") + b"\x00" * length)
    with pytest.raises(NoiseError):
        b.feed(b"")


def test_an_empty_message_whose_length_is_cut_after_one_byte_is_refused_like_an_uncut_one():
    """However the reads cut a message's 2-byte length, it is read as those 2 bytes: a 0-byte
    message is refused also when its length comes in two reads, with more bytes behind it."""
    _, b = codec_pair()
    assert b.feed(b"\x00") == [] and b.buffered == 1
    with pytest.raises(NoiseError, match="Noise message of 0 bytes is shorter than its 16-byte tag"):
        b.feed(b"\x00" + b"\x55" * 40)


def test_a_range_seals_and_opens_only_its_own_messages():
    """Threads seal and open ranges side by side because a range touches no other's bytes: sealing
    message 1 leaves message 0's place untouched, and opening messages 1 and 2 leaves 0 unopened."""
    a, b = codec_pair()
    sealing = a.plan_seal(b"\x01" * (3 * MAX_PLAINTEXT))
    sealing.seal(1, 2)
    first = bytes(sealing.out[2 : 2 + MAX_MESSAGE])
    assert sealing.out[:2] == b"\xff\xff" and first == bytes(MAX_MESSAGE)  # length written, body not sealed
    sealing.seal(0, 1)
    sealing.seal(2, 3)
    opening = b.take(sealing.out)
    opening.open(1, 3)
    with pytest.raises(NoiseError, match="#0 failed authentication"):
        opening.plaintext()


def test_a_part_is_sealed_from_the_callers_buffer_without_a_copy():
    """Each message whose bytes come from one part is a view of that part (the join copies only a
    message that straddles parts); a part of exactly OWN_MESSAGE bytes starts a message of its own."""
    a, _ = codec_pair()
    header, body = bytearray(b"H" * 12), bytearray(2 * MAX_PLAINTEXT + 5)
    plains = list(noise._cut([memoryview(header), memoryview(body)], MAX_PLAINTEXT))
    assert [len(p) for p in plains] == [12, MAX_PLAINTEXT, MAX_PLAINTEXT, 5]
    assert all(isinstance(p, memoryview) for p in plains)
    assert plains[0].obj is header and all(p.obj is body for p in plains[1:])
    joined = list(noise._cut([memoryview(header), memoryview(body)[:OWN_MESSAGE - 1]], MAX_PLAINTEXT))
    assert [bytes(p) for p in joined] == [bytes(header) + bytes(OWN_MESSAGE - 1)]
    alone = list(noise._cut([memoryview(header), memoryview(body)[:OWN_MESSAGE]], MAX_PLAINTEXT))
    assert [len(p) for p in alone] == [12, OWN_MESSAGE]


def test_random_garbage_never_yields_plaintext():
    rng = random.Random(11)
    for _ in range(50):
        _, b = codec_pair()
        junk = rng.randbytes(rng.randrange(18, 5000))
        junk = (len(junk) - 2).to_bytes(2, "big") + junk[2:]  # a well-formed length, garbage inside
        with pytest.raises(NoiseError):
            b.feed(junk)


def test_nonce_limit():
    """Nonce 2^64-1 is reserved: 2^64-2 is the last usable one, in each direction."""
    last = 2**64 - 2
    a, b = codec_pair(a=last)
    assert opened(b, a.encrypt(b"last")) == b"last"
    with pytest.raises(NoiseError, match="^Noise send nonce exhausted: the connection must be re-established$"):
        a.encrypt(b"one too many")
    # A message big enough to need two nonces is refused whole, nothing sent.
    a, _ = codec_pair(a=last)
    with pytest.raises(NoiseError, match="exhausted"):
        a.encrypt(b"x" * (MAX_PLAINTEXT + 1))
    # The receiving side refuses to go past the limit too.
    sealed = ChaCha20Poly1305(KEY_A).encrypt(spec_nonce(0), b"wrapped", None)
    _, c = codec_pair(a=2**64 - 1)
    with pytest.raises(NoiseError, match="^Noise receive nonce exhausted$"):
        c.feed(len(sealed).to_bytes(2, "big") + sealed)
    # ... also for the second of two messages one read brings, the first being the last usable.
    cipher = ChaCha20Poly1305(KEY_A)
    two = b"".join(len(m).to_bytes(2, "big") + m
                   for m in (cipher.encrypt(spec_nonce(last), b"last", None), cipher.encrypt(spec_nonce(0), b"over", None)))
    _, d = codec_pair(a=last)
    with pytest.raises(NoiseError, match="exhausted"):
        d.feed(two)


# ---------------------------------------------------------------------------- sealing and opening in ranges


@pytest.mark.parametrize("cores, threads", [(1, 0), (2, 0), (3, 0), (4, 1), (8, 2), (15, 3), (16, 4), (64, 4)])
def test_crypto_threads_are_chosen_by_the_cores_a_process_may_use(cores, threads):
    """None on the 2-core machine (the loop and the compute fill it: a thread hop would only cost),
    then one per 4 cores, at most 4."""
    assert crypto_threads_for(cores) == threads
    assert NoiseConfig(crypto_threads=3).threads() == 3 and NoiseConfig(crypto_threads=0).threads() == 0
    assert NoiseConfig().threads() == crypto_threads_for(process_cores())


def test_the_cores_a_process_may_use_are_read_from_its_affinity_and_its_cgroup(monkeypatch, tmp_path):
    affinity = len(os.sched_getaffinity(0))
    quota = tmp_path / "cpu.max"
    monkeypatch.setattr(noise, "CGROUP_CPU_MAX", str(quota))
    assert process_cores() == affinity  # no cgroup file: the affinity
    quota.write_text("max 100000\n")
    assert process_cores() == affinity
    quota.write_text("100000 100000\n")
    assert process_cores() == 1
    quota.write_text(f"{100000 * (affinity + 3)} 100000\n")
    assert process_cores() == affinity  # a quota above the affinity: the affinity
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})  # pinned to 3 of 64 cores
    quota.unlink()
    assert process_cores() == 3
    # without sched_getaffinity (macOS): the machine's cores, and 1 where even those are unknown
    monkeypatch.delattr(os, "sched_getaffinity")
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert process_cores() == 6
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert process_cores() == 1


@pytest.mark.parametrize("affinity, cpu_max, cores", [
    (16, None, 16), (16, "max 100000\n", 16), (64, "200000 100000\n", 2), (64, "150000 100000", 2),
    (4, "800000 100000", 4), (8, "50000 100000", 1), (8, "garbled", 8), (8, "", 8), (0, None, 1),
    (8, "100000 0", 8), (8, "3 1", 3),  # a period of 0 is no quota (and no division by it)
])
def test_usable_cores_are_the_affinity_capped_by_a_cgroup_quota(affinity, cpu_max, cores):
    """A container with 2 CPUs of quota on a 64-core host must choose as a 2-core machine does."""
    assert usable_cores(affinity, cpu_max) == cores


def test_a_noise_config_out_of_range_says_which_setting():
    with pytest.raises(ConfigError, match="crypto_threads"):
        NoiseConfig(crypto_threads=-1).validate()
    with pytest.raises(ConfigError, match="offload_bytes"):
        NoiseConfig(offload_bytes=1000).validate()
    with pytest.raises(ConfigError, match="split_bytes"):
        NoiseConfig(split_bytes=1000).validate()
    with pytest.raises(ConfigError, match="crypto_threads"):
        CryptoPool(NoiseConfig(crypto_threads=65))
    NoiseConfig(crypto_threads=64, offload_bytes=MAX_MESSAGE, split_bytes=MAX_MESSAGE).validate()  # the bounds hold


@pytest.mark.parametrize("size, threads, parts", [
    (768 * 1024, 4, 1), (2 * 1024 * 1024, 4, 1), (4 * 1024 * 1024, 4, 2), (64 * 1024 * 1024, 4, 4),
    (4 * 1024 * 1024, 1, 1), (0, 4, 1),
])
def test_a_batch_is_split_across_threads_only_in_ranges_of_split_bytes(size, threads, parts):
    """Each range is one thread hop on the loop: a write of a few MiB goes to one thread."""
    assert pieces(size, threads, 2 * 1024 * 1024) == parts


@pytest.mark.parametrize("count, parts", [(0, 4), (1, 4), (5, 2), (16, 4), (17, 3), (3, 8)])
def test_spans_cover_every_message_once_in_order(count, parts):
    ranges = spans(count, parts)
    assert [i for lo, hi in ranges for i in range(lo, hi)] == list(range(count))
    assert len(ranges) <= max(1, min(parts, count)) and all(hi > lo for lo, hi in ranges if count)


def test_a_write_sealed_in_ranges_in_any_order_is_the_same_wire_bytes():
    whole_codec, _ = codec_pair()
    a, b = codec_pair()
    payload = random.Random(1).randbytes(5 * MAX_PLAINTEXT + 99)
    whole = whole_codec.encrypt(b"header", payload)
    sealing = a.plan_seal(b"header", payload)
    for lo, hi in reversed(spans(sealing.count, 3)):
        sealing.seal(lo, hi)
    assert sealing.out == whole and sealing.count == 7
    opening = b.take(sealing.out)
    for lo, hi in reversed(spans(opening.count, 3)):
        opening.open(lo, hi)
    assert b"".join(opening.plaintext()) == b"header" + payload
    assert opened(b, a.encrypt(b"next")) == b"next"  # both planned their nonces: the next write follows


def test_a_garbled_message_opened_in_another_range_fails_the_codec_with_its_number():
    a, b = codec_pair()
    wire = bytearray(a.encrypt(random.Random(2).randbytes(4 * MAX_PLAINTEXT)))
    wire[3 * (2 + MAX_MESSAGE) + 10] ^= 1  # inside the fourth message
    opening = b.take(wire)
    opening.open(2, 4)
    opening.open(0, 2)
    with pytest.raises(NoiseError, match="#3 failed authentication"):
        opening.plaintext()
    with pytest.raises(NoiseError, match="#3 failed"):
        b.feed(a.encrypt(b"after"))


class Work:
    """A batch's ``work(lo, hi)`` that records each range, the thread it ran on, and how many ran at once."""

    def __init__(self, pause: float = 0.0) -> None:
        self.calls: list[tuple[int, int, bool]] = []
        self.pause = pause
        self.running = self.most = 0
        self._lock = threading.Lock()

    def __call__(self, lo: int, hi: int) -> None:
        with self._lock:
            self.running += 1
            self.most = max(self.most, self.running)
            self.calls.append((lo, hi, threading.current_thread() is threading.main_thread()))
        if self.pause:
            threading.Event().wait(self.pause)
        with self._lock:
            self.running -= 1


async def test_a_pool_without_threads_keeps_every_batch_on_the_loop():
    pool, work = CryptoPool(NoiseConfig(crypto_threads=0)), Work()
    await pool.run(work, 40, 64 * 1024 * 1024)
    assert work.calls == [(0, 40, True)] and pool.offloaded == 0


async def test_a_batch_leaves_the_loop_from_offload_bytes_and_is_split_from_twice_split_bytes():
    config = NoiseConfig(crypto_threads=2, offload_bytes=768 * 1024, split_bytes=2 * 1024 * 1024)
    pool = CryptoPool(config)
    work = Work()
    await pool.run(work, 12, config.offload_bytes - 1)
    assert work.calls == [(0, 12, True)] and pool.offloaded == 0
    work = Work()
    await pool.run(work, 12, config.offload_bytes)
    assert work.calls == [(0, 12, False)] and pool.offloaded == 1
    work = Work()
    await pool.run(work, 64, 2 * config.split_bytes)
    assert sorted(work.calls) == [(0, 32, False), (32, 64, False)] and pool.offloaded == 2


@pytest.mark.parametrize("count", [1, 64], ids=["one range", "split"])
async def test_the_node_never_runs_more_crypto_threads_than_its_pool_has(count):
    """One limiter for all the node's connections: two batches at once on a one-thread pool run one
    after the other, also when each would be split (trio's own limiter would run them side by side)."""
    pool = CryptoPool(NoiseConfig(crypto_threads=1, offload_bytes=MAX_MESSAGE, split_bytes=MAX_MESSAGE))
    pool.threads = 2  # split a batch in two ranges, still under the one-thread limiter
    work = Work(pause=0.05)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pool.run, work, count, 10 * MAX_MESSAGE)
        nursery.start_soon(pool.run, work, count, 10 * MAX_MESSAGE)
    assert work.most == 1 and len(work.calls) == (2 if count == 1 else 4)


# ---------------------------------------------------------------------------- NoiseSession over a pipe


class Pipe:
    """An ``IRawConnection`` stand-in over one end of an in-memory trio stream pair."""

    def __init__(self, pipe: trio.abc.Stream) -> None:
        self._pipe = pipe
        self.closed = False

    async def read(self, n: int | None = None) -> bytes:
        return await self._pipe.receive_some(n)

    async def write(self, data: bytes) -> None:
        await self._pipe.send_all(data)

    async def close(self) -> None:
        self.closed = True
        await self._pipe.aclose()

    def get_remote_address(self) -> tuple[str, int] | None:
        return ("memory", 0)

    def get_transport_addresses(self) -> list:
        return []

    def get_connection_type(self) -> ConnectionType:
        return ConnectionType.DIRECT


def session(raw: Pipe, codec: NoiseCodec, *, is_initiator: bool, crypto: CryptoPool | None = None) -> NoiseSession:
    local, remote = create_new_key_pair(), create_new_key_pair()
    return NoiseSession(
        raw,
        codec,
        local_peer=ID.from_pubkey(local.public_key),
        local_key_pair=local,
        remote_peer=ID.from_pubkey(remote.public_key),
        is_initiator=is_initiator,
        remote_public_key=remote.public_key,
        crypto=crypto,
    )


def threaded() -> CryptoPool:
    """A pool that seals and opens every write and read of a message or more, split across 2 worker threads."""
    return CryptoPool(NoiseConfig(crypto_threads=2, offload_bytes=MAX_MESSAGE, split_bytes=MAX_MESSAGE))


def session_and_wire(**codec_nonces: int) -> tuple[NoiseSession, trio.abc.Stream, NoiseCodec]:
    """A NoiseSession, the other end of its pipe, and the codec that talks to it from there."""
    ours, theirs = trio.testing.memory_stream_pair()
    a, b = codec_pair(**codec_nonces)
    return session(Pipe(ours), a, is_initiator=True), theirs, b


@pytest.mark.parametrize("pools", [(None, None), ("threads", "threads")], ids=["on the loop", "on threads"])
async def test_session_round_trip_both_ways(pools):
    left, right = trio.testing.memory_stream_pair()
    a_codec, b_codec = codec_pair()
    a_pool, b_pool = (threaded() if p else None for p in pools)
    a = session(Pipe(left), a_codec, is_initiator=True, crypto=a_pool)
    b = session(Pipe(right), b_codec, is_initiator=False, crypto=b_pool)
    payload = random.Random(5).randbytes(2 * 1024 * 1024 + 1)

    async def drain(s: NoiseSession, n: int) -> bytes:
        got = bytearray()
        while len(got) < n:
            got += await s.read(min(100_000, n - len(got)))
        return bytes(got)

    results: dict[str, bytes] = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(a.write_parts, payload[:10], bytearray(payload[10:500_000]), memoryview(payload)[500_000:])
        nursery.start_soon(b.write, payload[::-1])

        async def collect(name: str, s: NoiseSession) -> None:
            results[name] = await drain(s, len(payload))

        nursery.start_soon(collect, "b", b)
        nursery.start_soon(collect, "a", a)
    assert results["b"] == payload and results["a"] == payload[::-1]
    if a_pool is not None and b_pool is not None:  # both ends sealed and opened on their threads
        assert a_pool.offloaded >= 2 and b_pool.offloaded >= 2


async def test_session_read_n_never_returns_more_than_asked():
    s, wire, codec = session_and_wire()
    await wire.send_all(codec.encrypt(b"abcdefghij") + codec.encrypt(b"klmnop"))
    assert await s.read(3) == b"abc"
    assert await s.read(4) == b"defg"
    # What is left of both messages, joined, and no more than asked.
    assert await s.read(100) == b"hijklmnop"
    await wire.send_all(codec.encrypt(b"qrstuvwxyz"))
    assert await s.read(5) == b"qrstu"
    assert await s.read() == b"vwxyz"


async def test_session_read_messages_returns_what_one_read_completes():
    s, wire, codec = session_and_wire()
    await wire.send_all(codec.encrypt(b"one") + codec.encrypt(b"two") + codec.encrypt(b"thr"))
    assert await s.read_messages() == [b"one", b"two", b"thr"]
    await wire.send_all(codec.encrypt(b"four"))
    assert await s.read_messages() == [b"four"]


async def test_session_clean_eof():
    s, wire, codec = session_and_wire()
    await wire.send_all(codec.encrypt(b"last words"))
    await wire.aclose()
    assert await s.read() == b"last words"
    assert await s.read_messages() == []
    with pytest.raises(ConnectionClosedError):
        await s.read(10)


async def test_session_eof_in_the_middle_of_a_message_is_an_error():
    s, wire, codec = session_and_wire()
    sealed = codec.encrypt(b"cut short")
    await wire.send_all(sealed[:-3])
    await wire.aclose()
    with pytest.raises(NoiseError, match="middle of a Noise message"):
        await s.read_messages()


async def test_session_garbled_ciphertext_breaks_the_session_for_good():
    s, wire, codec = session_and_wire()
    good = codec.encrypt(b"good")
    bad = bytearray(codec.encrypt(b"bad!"))
    bad[4] ^= 0x80
    await wire.send_all(good)
    assert await s.read() == b"good"
    await wire.send_all(bad + codec.encrypt(b"after"))
    with pytest.raises(NoiseError, match="failed authentication"):
        await s.read()
    with pytest.raises(NoiseError, match="already broken"):
        await s.read()
    with pytest.raises(NoiseError, match="already broken"):
        await s.write(b"anything")
    # A broken session is a closed connection to py-libp2p code above.
    assert issubclass(NoiseError, ConnectionClosedError)


async def test_session_write_to_a_closed_pipe_raises_noise_error_and_breaks():
    s, wire, _ = session_and_wire()
    await wire.aclose()
    with pytest.raises(NoiseError, match="connection lost"):
        await s.write(b"x" * 100)
    with pytest.raises(NoiseError, match="already broken"):
        await s.write(b"y")


@pytest.mark.parametrize("pool", [None, "threads"], ids=["on the loop", "on threads"])
async def test_session_concurrent_writers_keep_nonce_order(pool):
    """Writes are serialised before sealing: the receiver opens every message in order, also when
    each write is sealed on worker threads while the next writer waits.

    A lockstep pipe makes every write wait for the reader, so writers really overlap."""
    ours, wire = trio.testing.lockstep_stream_pair()
    mine, codec = codec_pair()
    crypto = threaded() if pool else None
    s = session(Pipe(ours), mine, is_initiator=True, crypto=crypto)
    chunks = {i: bytes([i]) * (MAX_PLAINTEXT * 3 + i) for i in range(8)}
    got = bytearray()

    async def receive() -> None:
        total = sum(map(len, chunks.values()))
        while len(got) < total:
            data = await wire.receive_some(100_000)
            got.extend(b"".join(codec.feed(data)))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(receive)
        for i, chunk in chunks.items():
            nursery.start_soon(s.write, chunk)
    # Each write arrives whole (not interleaved with another's messages).
    pos = 0
    seen = set()
    while pos < len(got):
        i = got[pos]
        assert got[pos : pos + len(chunks[i])] == chunks[i]
        seen.add(i)
        pos += len(chunks[i])
    assert seen == set(chunks)
    assert crypto is None or crypto.offloaded == len(chunks)


async def test_session_close_closes_the_raw_connection():
    s, wire, _ = session_and_wire()
    await s.close()
    assert s.raw.closed
    assert await wire.receive_some(10) == b""


async def test_session_read_n_takes_across_messages_and_keeps_the_rest_whole():
    s, wire, codec = session_and_wire()
    await wire.send_all(codec.encrypt(b"abc") + codec.encrypt(b"defghij"))
    assert await s.read(0) == b""  # nothing asked, nothing taken
    assert await s.read(5) == b"abcde"
    assert await s.read(5) == b"fghij"  # exactly what was left of the message
    await wire.send_all(codec.encrypt(b"next"))
    assert await s.read(2) == b"ne"  # a new message, not an empty piece left behind
    assert await s.read_messages() == [b"xt"]  # the rest of a message read in part comes first


async def test_session_end_says_connection_closed():
    s, wire, _ = session_and_wire()
    await wire.aclose()
    with pytest.raises(ConnectionClosedError, match="^connection closed$"):
        await s.read()


class CountingPipe(Pipe):
    """A Pipe that records the size asked of every read, and fails one after the end."""

    def __init__(self, pipe: trio.abc.Stream) -> None:
        super().__init__(pipe)
        self.asked: list[int | None] = []
        self.ended = False

    async def read(self, n: int | None = None) -> bytes:
        assert not self.ended, "read again after the end"
        self.asked.append(n)
        data = await super().read(n)
        self.ended = not data
        return data


async def test_session_reads_a_megabyte_at_a_time_and_not_past_the_end():
    """One wake-up opens every message a big read brought; at the end the raw connection is not read again."""
    ours, wire = trio.testing.memory_stream_pair()
    mine, codec = codec_pair()
    raw = CountingPipe(ours)
    s = session(raw, mine, is_initiator=True)
    await wire.send_all(codec.encrypt(b"x"))
    await wire.aclose()
    assert await s.read_messages() == [b"x"]
    assert await s.read_messages() == [] and await s.read_messages() == []
    assert raw.asked == [READ_SIZE, READ_SIZE]


async def test_a_session_given_no_pool_seals_and_opens_on_the_loop(monkeypatch):
    async def no_threads(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a thread hop")

    monkeypatch.setattr(trio.to_thread, "run_sync", no_threads)
    monkeypatch.setattr(noise, "process_cores", lambda: 16)  # where a node's own pool would use threads
    left, right = trio.testing.memory_stream_pair()
    a_codec, b_codec = codec_pair()
    a = session(Pipe(left), a_codec, is_initiator=True)
    b = session(Pipe(right), b_codec, is_initiator=False)
    assert a.early_muxer is None  # none agreed in a handshake: negotiate one
    big = random.Random(4).randbytes(4 * 1024 * 1024)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(a.write, big)
        got = bytearray()
        while len(got) < len(big):
            got += await b.read()
    assert got == big


YAMUX = "/yamux/1.0.0"
ANSWER = multistream.encode(multistream.HEADER, YAMUX)


@pytest.mark.parametrize("cut", [1, 2, 5, 7, len(ANSWER), len(ANSWER) + 3])
async def test_the_expected_preface_is_taken_off_the_front_however_the_messages_cut_it(cut):
    """The listener's multistream answer comes first, in Noise messages cut anywhere (a peer may
    write it in pieces, and the yamux frames behind it in the same message): the reader sees only
    what follows it."""
    s, wire, codec = session_and_wire()
    s.expect_preface(multistream.Reply(YAMUX))
    stream = ANSWER + b"frames"
    await wire.send_all(b"".join(codec.encrypt(stream[i : i + cut]) for i in range(0, len(stream), cut)))
    await wire.send_all(codec.encrypt(b"more"))
    got = bytearray()
    with trio.fail_after(5):
        while len(got) < len(b"framesmore"):
            pieces = await s.read_messages()
            assert pieces and all(pieces)
            got += b"".join(pieces)
    assert got == b"framesmore"


async def test_a_preface_in_messages_of_its_own_then_data_in_the_next():
    s, wire, codec = session_and_wire()
    s.expect_preface(multistream.Reply(YAMUX))
    await wire.send_all(codec.encrypt(ANSWER[:4]) + codec.encrypt(ANSWER[4:]))
    await wire.send_all(codec.encrypt(b"a") + codec.encrypt(b"b"))
    with trio.fail_after(5):
        assert await s.read_messages() == [b"a", b"b"]
    await wire.send_all(codec.encrypt(ANSWER))  # once done, the same bytes are data
    with trio.fail_after(5):
        assert b"".join(await s.read_messages()) == ANSWER


async def test_a_wrong_preface_fails_the_first_read_and_breaks_the_session():
    s, wire, codec = session_and_wire()
    s.expect_preface(multistream.Reply(YAMUX))
    await wire.send_all(codec.encrypt(multistream.encode(multistream.HEADER, "na") + b"frames"))
    with pytest.raises(multistream.ProtocolRefused):
        await s.read_messages()
    with pytest.raises(NoiseError, match="already broken"):
        await s.read_messages()


async def test_a_clean_end_before_the_preface_is_an_end():
    s, wire, codec = session_and_wire()
    s.expect_preface(multistream.Reply(YAMUX))
    await wire.send_all(codec.encrypt(ANSWER[:3]))
    await wire.aclose()
    assert await s.read_messages() == []


class TcpRaw(Pipe):
    """py-libp2p's TCP connection, as the session finds its socket: ``raw.stream.stream``."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self.stream = type("TrioTCPStream", (), {"stream": stream})()

    async def read(self, n: int | None = None) -> bytes:
        raise AssertionError("the session reads the socket itself")

    async def write(self, data: bytes) -> None:
        raise AssertionError("the session writes the socket itself")


async def test_a_session_on_tcp_talks_to_the_socket_and_knows_its_local_address():
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with listeners[0], await trio.open_tcp_stream("127.0.0.1", port) as client:
        server = await listeners[0].accept()
        a_codec, b_codec = codec_pair()
        a = session(TcpRaw(client), a_codec, is_initiator=True)
        b = session(TcpRaw(server), b_codec, is_initiator=False)
        assert a.local_address() == client.socket.getsockname() == ("127.0.0.1", a.local_address()[1])
        assert b.local_address() == ("127.0.0.1", port)
        await a.write(b"over tcp")
        assert await b.read() == b"over tcp"
        await server.aclose()
        assert b.local_address() is None  # a closed socket has none
    plain, _, _ = session_and_wire()
    assert plain.local_address() is None  # not on TCP (a relayed stream): none


async def test_a_raw_connection_whose_stream_is_no_socket_is_read_through_its_own_methods():
    ours, wire = trio.testing.memory_stream_pair()
    raw = Pipe(ours)
    raw.stream = type("RelayedStream", (), {"stream": object()})()  # type: ignore[attr-defined]
    mine, codec = codec_pair()
    s = session(raw, mine, is_initiator=True)
    await wire.send_all(codec.encrypt(b"relayed"))
    assert await s.read() == b"relayed"


# ---------------------------------------------------------------------------- NoiseTransport hand-over


async def test_transport_handshake_then_our_record_layer():
    """py-libp2p's XX handshake over a pipe; the keys and nonces it leaves work in our codec."""
    key_i, key_r = create_new_key_pair(), create_new_key_pair()
    i, r = await handshake(NoiseTransport(key_i), NoiseTransport(key_r), key_r)
    assert isinstance(i, NoiseSession) and isinstance(r, NoiseSession)
    assert i.is_initiator is True and r.is_initiator is False
    assert i.get_remote_peer() == r.get_local_peer() == ID.from_pubkey(key_r.public_key)
    assert r.get_remote_peer() == i.get_local_peer() == ID.from_pubkey(key_i.public_key)
    assert i.get_remote_public_key() == key_r.public_key and r.get_remote_public_key() == key_i.public_key
    assert i.get_local_private_key() == key_i.private_key and r.get_local_private_key() == key_r.private_key
    await i.write(b"hello responder")
    assert await r.read() == b"hello responder"
    await r.write_parts(b"hello ", b"initiator")
    assert await i.read() == b"hello initiator"
    big = random.Random(9).randbytes(300_000)
    await i.write(big)
    got = bytearray()
    while len(got) < len(big):
        got += await r.read()
    assert got == big


@pytest.mark.parametrize("ours, theirs, agreed", [
    (["/yamux/1.0.0"], ["/yamux/1.0.0"], "/yamux/1.0.0"),
    (["/mplex/6.7.0", "/yamux/1.0.0"], ["/yamux/1.0.0", "/mplex/6.7.0"], "/mplex/6.7.0"),  # the initiator's order
    (["/yamux/1.0.0"], [], None),  # a peer that lists none: multistream afterwards
    (["/yamux/1.0.0"], ["/mplex/6.7.0"], None),  # nothing in common: multistream says so
])
async def test_the_muxer_is_agreed_inside_the_handshake(ours: list[str], theirs: list[str], agreed: str | None) -> None:
    """The inlined muxer negotiation: both sides come out of the handshake with the same muxer
    (or none, and negotiate one with multistream), the initiator's preference first."""
    key_i, key_r = create_new_key_pair(), create_new_key_pair()
    i, r = await handshake(NoiseTransport(key_i, muxers=ours), NoiseTransport(key_r, muxers=theirs), key_r)
    assert i.early_muxer == r.early_muxer == agreed
    await i.write(b"after the handshake")
    assert await r.read() == b"after the handshake"


async def test_sessions_seal_on_their_transports_pool():
    """One pool per node: every session a transport makes seals and opens on it."""
    key_i, key_r = create_new_key_pair(), create_new_key_pair()
    config = NoiseConfig(crypto_threads=1, offload_bytes=MAX_MESSAGE, split_bytes=MAX_MESSAGE)
    t_i, t_r = NoiseTransport(key_i, config=config), NoiseTransport(key_r, config=config)
    i, r = await handshake(t_i, t_r, key_r)
    big = random.Random(6).randbytes(4 * MAX_MESSAGE)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(i.write, big)
        got = bytearray()
        while len(got) < len(big):
            got += await r.read()
    assert got == big and t_i.crypto.offloaded >= 1 and t_r.crypto.offloaded >= 1


class Recording(Pipe):
    """A Pipe that keeps what was written through it."""

    def __init__(self, pipe: trio.abc.Stream) -> None:
        super().__init__(pipe)
        self.written = bytearray()

    async def write(self, data: bytes) -> None:
        self.written += data
        await super().write(data)


async def test_the_dialers_first_message_is_its_ephemeral_key_alone():
    """XX's first message is ``e``: 32 bytes, an empty payload (the spec's; nothing is sent before
    the peer is authenticated)."""
    key_i, key_r = create_new_key_pair(), create_new_key_pair()
    left, right = trio.testing.memory_stream_pair()
    raw = Recording(left)

    async def outbound() -> None:
        await NoiseTransport(key_i).secure_outbound(raw, ID.from_pubkey(key_r.public_key))  # type: ignore[arg-type]

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(outbound)
            nursery.start_soon(NoiseTransport(key_r).secure_inbound, Pipe(right))
    assert raw.written[:2] == b"\x00\x20"
    (second,) = struct.unpack_from(">H", raw.written, 34)
    assert len(raw.written) == 34 + 2 + second  # then the third message, nothing between


class Forger(noise._XX):
    """Claims another peer's identity key, signed with its own: the signature cannot verify."""

    def __init__(self, transport: Any, muxers: Any, claimed: Any) -> None:
        super().__init__(transport, muxers)
        self.claimed = claimed

    def make_handshake_payload(self, extensions: Any = None) -> Any:
        payload = super().make_handshake_payload()
        payload.id_pubkey = self.claimed
        return payload


@pytest.mark.parametrize("forger", ["responder", "initiator"])
async def test_a_payload_whose_signature_is_not_the_claimed_keys_fails_the_handshake(forger):
    """Each side signs its Noise static key with its identity key; a peer that claims an identity
    whose key did not sign (to pass for it) is refused by the side that checks, dialer or listener."""
    key_i, key_r, victim = create_new_key_pair(), create_new_key_pair(), create_new_key_pair()
    ends = {name: HandshakeTransport(key, noise_privkey=x25519().private_key) for name, key in (("i", key_i), ("r", key_r))}
    patterns = {name: (Forger(t, [], victim.public_key) if name[0] == forger[0] else noise._XX(t, []))
                for name, t in ends.items()}
    errors = await failed_handshake(lambda raw: patterns["i"].run_outbound(raw, None), patterns["r"].run_inbound)
    checker = "i" if forger == "responder" else "r"
    assert isinstance(errors[checker], InvalidSignature)


def test_a_handshake_is_taken_over_only_once_finished_and_with_the_peers_static_key():
    key = create_new_key_pair()
    unfinished = type("NoiseState", (), {"handshake_finished": False})()
    with pytest.raises(HandshakeHasNotFinished, match="^handshake is done but it is not marked as finished in `noise_state`$"):
        noise.Handshaken.of(unfinished, key.public_key)
    pattern = noise._XX(HandshakeTransport(key, noise_privkey=x25519().private_key), [])
    payload = pattern.make_handshake_payload().serialize()
    for state in (None, type("HandshakeState", (), {"rs": None})()):
        with pytest.raises(NoiseStateError, match="^the peer's static key is missing after its payload$"):
            pattern._take_payload(payload, state)


async def handshake(initiator: NoiseTransport, responder: NoiseTransport, key_r: Any) -> tuple[NoiseSession, NoiseSession]:
    """Both sides of one handshake over an in-memory pipe: (initiator's session, responder's)."""
    left, right = trio.testing.memory_stream_pair()
    result: dict[str, NoiseSession] = {}

    async def outbound() -> None:
        result["i"] = await initiator.secure_outbound(Pipe(left), ID.from_pubkey(key_r.public_key))  # type: ignore[arg-type, assignment]

    async def inbound() -> None:
        result["r"] = await responder.secure_inbound(Pipe(right))  # type: ignore[arg-type, assignment]

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(outbound)
            nursery.start_soon(inbound)
    return result["i"], result["r"]


async def test_a_muxer_far_down_a_long_list_is_agreed_by_both_sides() -> None:
    """Each side decides the muxer on its own from both lists, so both must read the lists whole: a
    responder that kept only the first 16 of the initiator's 20 chose multistream while the initiator
    went on in yamux, and the connection failed at its first frame."""
    key_i, key_r = create_new_key_pair(), create_new_key_pair()
    theirs = [f"/other/{n}" for n in range(19)] + ["/yamux/1.0.0"]
    i, r = await handshake(NoiseTransport(key_i, muxers=theirs), NoiseTransport(key_r, muxers=["/yamux/1.0.0"]), key_r)
    assert i.early_muxer == r.early_muxer == "/yamux/1.0.0"


async def test_the_dialed_peer_must_be_the_one_that_answers() -> None:
    """The dialer names the peer it wants; a listener with another key fails the handshake there,
    before a byte of the connection is trusted (what a man in the middle meets)."""
    key_i, key_r, wanted = create_new_key_pair(), create_new_key_pair(), create_new_key_pair()
    errors = await failed_handshake(lambda raw: NoiseTransport(key_i).secure_outbound(raw, ID.from_pubkey(wanted.public_key)),
                                    NoiseTransport(key_r).secure_inbound)
    assert isinstance(errors["i"], PeerIDMismatchesPubkey)
    assert str(ID.from_pubkey(wanted.public_key)) in str(errors["i"])
    assert str(ID.from_pubkey(key_r.public_key)) in str(errors["i"])
    assert "r" in errors  # the listener got no third message


async def failed_handshake(outbound: Callable[[Any], Awaitable[object]],
                           inbound: Callable[[Any], Awaitable[object]]) -> dict[str, BaseException]:
    """Both sides of a handshake that fails: the error of each ("i", "r"); a side that fails closes
    its end of the pipe, so the other sees the end rather than waiting."""
    left, right = trio.testing.memory_stream_pair()
    errors: dict[str, BaseException] = {}

    async def side(name: str, call: Callable[[Any], Awaitable[object]], end: trio.abc.Stream) -> None:
        try:
            await call(Pipe(end))
        except Exception as e:
            errors[name] = e
            await end.aclose()

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(side, "i", outbound, left)
            nursery.start_soon(side, "r", inbound, right)
    return errors
