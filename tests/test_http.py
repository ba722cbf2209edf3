"""p2p/http.py, the operator's HTTP endpoint: its settings, ``--metrics HOST:PORT``, and the server
over real loopback sockets, every request written by hand so that each answer is read byte for byte
(what it serves, the scrape of a real swarm: tests/test_metrics.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from p2p.errors import ConfigError
from p2p.http import DEFAULT_HOST, LINGER_BYTES, HttpConfig, HttpServer, Response, Route, parse_endpoint

from .kit import http_get

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------------- settings and --metrics


def test_the_defaults_serve_sixteen_clients_ten_seconds_each_sixteen_kib_a_request() -> None:
    config = HttpConfig()
    assert (config.max_connections, config.request_timeout, config.max_request_bytes) == (16, 10.0, 16 * 1024)
    config.validate()
    assert (DEFAULT_HOST, LINGER_BYTES) == ("127.0.0.1", 256 * 1024)
    assert Response(200, b"") == Response(200, b"", "text/plain; charset=utf-8", ())


def test_settings_at_their_limits_pass_and_past_them_are_refused_by_name() -> None:
    HttpConfig(max_connections=1, request_timeout=1e-3, max_request_bytes=1024).validate()
    for config, message in ((HttpConfig(max_connections=0), "max_connections must be at least 1, got 0"),
                            (HttpConfig(request_timeout=0.0), "request_timeout must be positive, got 0.0"),
                            (HttpConfig(request_timeout=float("nan")), "request_timeout must be positive, got nan"),
                            (HttpConfig(max_request_bytes=1023), "max_request_bytes must be at least 1024, got 1023")):
        with pytest.raises(ConfigError) as refused:
            config.validate()
        assert str(refused.value) == message
    with pytest.raises(ConfigError, match="max_connections"):
        HttpServer({}, HttpConfig(max_connections=0))  # a server checks its settings when made


def test_endpoints_parse_with_loopback_for_a_bare_port() -> None:
    assert parse_endpoint("127.0.0.1:9100") == ("127.0.0.1", 9100)
    assert parse_endpoint(":9100") == ("127.0.0.1", 9100)
    assert parse_endpoint("[::1]:0") == ("::1", 0)
    assert parse_endpoint("0.0.0.0:65535") == ("0.0.0.0", 65535)
    assert parse_endpoint("localhost:80") == ("localhost", 80)
    assert parse_endpoint("[::]:9100") == ("::", 9100)
    with pytest.raises(ConfigError, match="'X127.0.0.1' is not an IP address"):
        parse_endpoint("X127.0.0.1:9100")  # only brackets are taken off


@pytest.mark.parametrize("text, message", [
    ("9100", "--metrics '9100': give HOST:PORT (e.g. 127.0.0.1:9100) or :PORT"),
    ("example.com:80", "--metrics 'example.com:80': 'example.com' is not an IP address"),
    ("127.0.0.1:http", "--metrics '127.0.0.1:http': port 'http' is not a number"),
    ("127.0.0.1:65536", "--metrics '127.0.0.1:65536': port 65536 is out of range"),
    ("127.0.0.1:-1", "--metrics '127.0.0.1:-1': port -1 is out of range"),
])
def test_a_bad_endpoint_names_the_problem(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_endpoint(text)
    assert str(refused.value) == message
    assert refused.value.__context__ is None or refused.value.__suppress_context__  # one clear line, no chain


# ---------------------------------------------------------------------- the server


def hello(query: str) -> Response:
    return Response(200, f"hello {query}\n".encode())


class Failures(logging.Handler):
    """The server's own bugs, as its backstop logs them ("HTTP connection failed")."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage() == "HTTP connection failed":
            self.records.append(record)


@asynccontextmanager
async def serving(routes: Mapping[str, Route], *, bugs_expected: bool = False,
                  **settings: float) -> AsyncIterator[tuple[HttpServer, tuple[str, int]]]:
    server = HttpServer(routes, HttpConfig(**settings))  # type: ignore[arg-type]
    failures = Failures()
    logger = logging.getLogger("p2p.http")
    logger.addHandler(failures)
    try:
        async with trio.open_nursery() as nursery:
            address = await nursery.start(server.serve, "127.0.0.1", 0)
            yield server, address
            # let the handlers still running finish first: a handler's error raised after its client
            # left must fail the test, not be lost to the cancel
            await trio.testing.wait_all_tasks_blocked(0.05)
            nursery.cancel_scope.cancel()
    finally:
        logger.removeHandler(failures)
    # the backstop keeps a bug from ending the server; in a test it must not hide one either
    assert bugs_expected or not failures.records, failures.records[0].exc_info


async def exchange(address: tuple[str, int], request: bytes, *, limit: float = 10) -> bytes:
    """Send ``request`` as it is and read until the server closes."""
    stream = await trio.open_tcp_stream(*address)
    async with stream:
        await stream.send_all(request)
        reply = b""
        with trio.fail_after(limit):
            while chunk := await stream.receive_some(65536):
                reply += chunk
    return reply


def head_of(reply: bytes) -> tuple[str, list[tuple[str, str]], bytes]:
    head, _, body = reply.partition(b"\r\n\r\n")
    status, *lines = head.decode().split("\r\n")
    return status, [(k.lower(), v.strip()) for k, _, v in (line.partition(":") for line in lines)], body


async def test_the_server_says_where_it_listens_and_answers_a_get_with_its_route_s_response() -> None:
    async with serving({"/hello": hello}) as (server, address):
        assert address[0] == "127.0.0.1" and isinstance(address[1], int) and address[1] > 0
        reply = await exchange(address, b"GET /hello?x=1&y HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        assert reply == (b"HTTP/1.1 200 \r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: 12\r\n"
                         b"cache-control: no-store\r\nx-content-type-options: nosniff\r\nConnection: close\r\n\r\n"
                         b"hello x=1&y\n")  # byte for byte: our names in lower case (h11 adds its Connection)
        assert server.served == 1 and server.refused == 0


async def test_a_route_s_own_content_type_and_headers_are_sent_and_a_bare_path_has_an_empty_query() -> None:
    queries: list[str] = []

    def page(query: str) -> Response:
        queries.append(query)
        return Response(201, b"<p>", "text/html", (("x-one", "1"), ("x-two", "2")))

    async with serving({"/": page}) as (_, address):
        status, headers, body = head_of(await exchange(address, b"GET / HTTP/1.1\r\nHost: t\r\n"
                                                                b"Connection: close\r\n\r\n"))
    assert status.startswith("HTTP/1.1 201") and body == b"<p>" and queries == [""]
    assert headers[:2] == [("content-type", "text/html"), ("content-length", "3")]
    assert ("x-one", "1") in headers and ("x-two", "2") in headers


async def test_an_empty_body_is_sent_as_nothing() -> None:
    async with serving({"/empty": lambda query: Response(200, b"")}) as (_, address):
        status, headers, body = head_of(await exchange(address, b"GET /empty HTTP/1.1\r\nHost: t\r\n"
                                                                b"Connection: close\r\n\r\n"))
    assert status.startswith("HTTP/1.1 200") and ("content-length", "0") in headers and body == b""


async def test_head_sends_the_headers_of_a_get_and_no_body() -> None:
    async with serving({"/hello": hello}) as (server, address):
        status, headers, body = await http_get(address, "/hello", method="HEAD")
        assert (status, headers["content-length"], body) == (200, "7", b"")
        assert server.served == 1


async def test_other_methods_are_refused_with_what_is_allowed() -> None:
    async with serving({"/hello": hello}) as (server, address):
        for method in ("POST", "PUT", "DELETE"):
            status, headers, body = await http_get(address, "/hello", method=method)
            assert (status, headers["allow"], body) == (405, "GET, HEAD", b"only GET and HEAD\n")
        assert server.served == 3
        assert b"\r\nallow: GET, HEAD\r\n" in await exchange(address, b"PUT /hello HTTP/1.1\r\nHost: t\r\n"
                                                                     b"Connection: close\r\n\r\n")


async def test_an_unknown_path_is_not_found_and_says_which() -> None:
    async with serving({"/hello": hello}) as (_, address):
        assert await http_get(address, "/nothing?x=1") == (404, {
            "content-type": "text/plain; charset=utf-8", "content-length": "23", "cache-control": "no-store",
            "x-content-type-options": "nosniff", "connection": "close"}, b"no such page: /nothing\n")


async def test_a_failing_route_answers_500_is_logged_and_the_server_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    def broken(query: str) -> Response:
        raise KeyError("bug")

    async with serving({"/hello": hello, "/broken": broken}) as (server, address):
        with caplog.at_level(logging.ERROR, logger="p2p.http"):
            status, _, body = await http_get(address, "/broken")
        assert (status, body) == (500, b"internal error: KeyError\n")
        assert [r.getMessage() for r in caplog.records if r.name == "p2p.http"] == ["HTTP route /broken failed"]
        assert caplog.records[-1].exc_info is not None
        assert (await http_get(address, "/hello"))[0] == 200
        assert server.served == 2


@pytest.mark.parametrize("response, reason", [
    (Response(99, b""), "status_code should be in range [200, 1000), not 99"),
    (Response(1000, b""), "status_code should be in range [200, 1000), not 1000"),
    (Response(200, b"", headers=(("x-evil", "a\r\nset-cookie: b"),)), "Illegal header value"),
    (Response(200, b"", headers=(("x bad", "1"),)), "Illegal header name"),
    (Response(200, b"", "text/plain; charset=\u00fc"), "'ascii' codec can't encode"),
    (Response(204, b"abc"), "a 204 response has no body, got 3 bytes"),
    (Response(304, b"a"), "a 304 response has no body, got 1 bytes"),
], ids=["status-low", "status-high", "header-value", "header-name", "content-type", "204-body", "304-body"])
async def test_a_response_http_cannot_carry_answers_500_before_anything_is_sent(
        caplog: pytest.LogCaptureFixture, response: Response, reason: str) -> None:
    async with serving({"/hello": hello, "/bad": lambda query: response}) as (server, address):
        with caplog.at_level(logging.ERROR, logger="p2p.http"):
            status, headers, body = await http_get(address, "/bad")
        assert status == 500 and body.startswith(b"internal error: ") and "x-evil" not in headers
        records = [r for r in caplog.records if r.name == "p2p.http"]
        assert [r.getMessage() for r in records] == ["HTTP route /bad failed"]
        assert records[0].exc_info is not None and reason in str(records[0].exc_info[1])
        assert (await http_get(address, "/hello"))[0] == 200  # and the server goes on
        assert server.served == 2


async def test_a_204_without_a_body_is_sent() -> None:
    async with serving({"/none": lambda query: Response(204, b"")}) as (_, address):
        reply = await exchange(address, b"GET /none HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 204 ") and reply.endswith(b"\r\n\r\n")


async def test_a_bug_in_the_server_s_own_code_costs_that_connection_only(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    async with serving({"/hello": hello}, bugs_expected=True) as (server, address):
        original = HttpServer._answer

        def buggy(self: HttpServer, method: str, path: str, query: str) -> object:
            if query == "bug":
                raise RuntimeError("a bug of ours")
            return original(self, method, path, query)

        monkeypatch.setattr(HttpServer, "_answer", buggy)
        with caplog.at_level(logging.ERROR, logger="p2p.http"):
            reply = await exchange(address, b"GET /hello?bug HTTP/1.1\r\nHost: t\r\n\r\n")
        assert reply == b""  # closed, nothing sent
        records = [r for r in caplog.records if r.name == "p2p.http"]
        assert [r.getMessage() for r in records] == ["HTTP connection failed"]
        assert records[0].exc_info is not None and str(records[0].exc_info[1]) == "a bug of ours"
        assert (await http_get(address, "/hello?ok"))[:3:2] == (200, b"hello ok\n")
        assert server.served == 1


async def test_a_connection_kept_alive_is_answered_request_after_request() -> None:
    async with serving({"/hello": hello}) as (server, address):
        reply = await exchange(address, b"GET /hello?1 HTTP/1.1\r\nHost: t\r\n\r\n"
                                        b"GET /hello?2 HTTP/1.1\r\nHost: t\r\n\r\n"
                                        b"GET /hello?3 HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        assert reply.count(b"HTTP/1.1 200") == 3
        assert reply.index(b"hello 1") < reply.index(b"hello 2") < reply.index(b"hello 3")
        assert server.served == 3


async def test_a_request_body_is_read_and_dropped() -> None:
    async with serving({"/hello": hello}) as (_, address):
        reply = await exchange(address, b"GET /hello?a HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nabcde"
                                        b"GET /hello?b HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        assert reply.count(b"HTTP/1.1 200") == 2 and b"hello a\n" in reply and b"hello b\n" in reply
        assert b"abcde" not in reply


async def test_a_garbled_request_gets_400_with_the_reason_and_the_connection_closes() -> None:
    async with serving({"/hello": hello}) as (server, address):
        reply = await exchange(address, b"GET /hello HTTP/1.1\r\nno colon here\r\n\r\n")
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head == (b"HTTP/1.1 400 \r\ncontent-type: text/plain; charset=utf-8\r\n"
                        b"content-length: %d\r\nconnection: close" % len(body))
        assert body.startswith(b"bad request: ")
        assert server.served == 0  # a refusal is not a page served
        assert (await http_get(address, "/hello"))[0] == 200


async def test_a_request_over_the_size_cap_gets_431_and_is_drained_so_that_the_answer_arrives() -> None:
    async with serving({"/hello": hello}, max_request_bytes=1024) as (_, address):
        # 200 KB after the cap (within LINGER_BYTES): closing with them unread would reset the
        # connection, and the 431 would be lost
        request = b"GET /hello HTTP/1.1\r\nHost: t\r\nX-Junk: " + b"a" * 200_000 + b"\r\n\r\n"
        status, headers, body = head_of(await exchange(address, request))
        assert status.startswith("HTTP/1.1 431") and ("connection", "close") in headers
        assert body.startswith(b"bad request: ")


async def test_the_size_cap_is_the_setting_s() -> None:
    header = b"GET /hello HTTP/1.1\r\nHost: t\r\nConnection: close\r\nX-Junk: " + b"a" * 24_000 + b"\r\n\r\n"
    async with serving({"/hello": hello}, max_request_bytes=32 * 1024) as (_, address):
        assert head_of(await exchange(address, header))[0].startswith("HTTP/1.1 200")  # over h11's own 16 KiB
    async with serving({"/hello": hello}, max_request_bytes=16 * 1024) as (_, address):
        assert head_of(await exchange(address, header))[0].startswith("HTTP/1.1 431")


@asynccontextmanager
async def refused_client() -> AsyncIterator[trio.SocketStream]:
    """A client past ``max_connections=1``: another holds the one slot."""
    async with serving({"/hello": hello}, max_connections=1) as (_, address):
        async with await trio.open_tcp_stream(*address):
            await trio.sleep(0.1)
            async with await trio.open_tcp_stream(*address) as stream:
                yield stream


async def test_a_refused_client_is_let_go_a_second_after_its_answer() -> None:
    async with refused_client() as stream:
        with trio.fail_after(5):
            assert (await stream.receive_some(4096)).startswith(b"HTTP/1.1 503")
            assert await stream.receive_some(4096) == b""  # the answer, then the end
        await trio.sleep(1.3)  # past the second the server reads what a refused client still sends
        with pytest.raises(trio.BrokenResourceError):
            for _ in range(8):  # the closed socket answers a reset; a later write sees it (by 1.7 s)
                await stream.send_all(b"x")
                await trio.sleep(0.05)


async def test_a_refused_client_that_keeps_sending_is_cut_once_the_linger_bytes_are_read() -> None:
    async with refused_client() as stream:
        began = time.monotonic()
        with pytest.raises(trio.BrokenResourceError), trio.fail_after(5):
            for _ in range(4096):  # 64 MiB at most: far past LINGER_BYTES
                await stream.send_all(bytes(16384))
        assert time.monotonic() - began < 0.8  # cut at 256 KiB read, not at the second's end


async def test_a_client_that_sends_nothing_is_closed_after_the_request_timeout() -> None:
    async with serving({"/hello": hello}, request_timeout=0.3) as (_, address):
        for start_of_a_request in (b"", b"GET /hello HTTP/1.1\r\n"):
            began = time.monotonic()
            assert await exchange(address, start_of_a_request) == b""  # closed without an answer
            assert 0.25 <= time.monotonic() - began < 3


async def test_a_client_that_does_not_read_its_answer_is_dropped_after_the_request_timeout() -> None:
    big = Response(200, bytes(64 << 20))
    async with serving({"/big": lambda query: big, "/hello": hello}, max_connections=1,
                       request_timeout=0.3) as (_, address):
        stream = await trio.open_tcp_stream(*address)
        async with stream:
            await stream.send_all(b"GET /big HTTP/1.1\r\nHost: t\r\n\r\n")
            began = time.monotonic()
            with trio.fail_after(5):  # its slot is freed for the next client once its time is up
                while (await http_get(address, "/hello"))[0] == 503:
                    await trio.sleep(0.05)
            assert time.monotonic() - began >= 0.25
            assert await stream.receive_some(10) != b""  # it had begun to be answered


async def test_past_max_connections_a_client_gets_503_and_the_others_are_served() -> None:
    async with serving({"/hello": hello}, max_connections=2, request_timeout=5) as (server, address):
        idle = [await trio.open_tcp_stream(*address) for _ in range(2)]
        await trio.sleep(0.1)
        reply = await exchange(address, b"GET /hello HTTP/1.1\r\nHost: t\r\n\r\n")
        assert reply == b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
        assert (server.refused, server.served) == (1, 0)
        assert (await http_get(address, "/hello"))[0] == 503 and server.refused == 2
        await idle[0].send_all(b"GET /hello?kept HTTP/1.1\r\nHost: t\r\n\r\n")
        answer = b""
        with trio.fail_after(5):  # the held ones are served meanwhile
            while b"hello kept" not in answer:
                answer += await idle[0].receive_some(4096)
        for s in idle:
            await s.aclose()
        await trio.sleep(0.1)
        assert (await http_get(address, "/hello"))[0] == 200  # both slots are back
        assert (await http_get(address, "/hello"))[0] == 200


async def test_a_client_that_leaves_mid_request_gives_its_slot_back() -> None:
    async with serving({"/hello": hello}, max_connections=1) as (_, address):
        for _ in range(3):
            stream = await trio.open_tcp_stream(*address)
            await stream.send_all(b"GET /hel")
            await stream.aclose()
            with trio.fail_after(5):
                while (await http_get(address, "/hello"))[0] != 200:
                    await trio.sleep(0.05)


async def test_a_port_already_taken_is_a_config_error_with_the_reason() -> None:
    busy = trio.socket.socket()
    await busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    with busy, pytest.raises(ConfigError) as refused:
        await HttpServer({}).serve("127.0.0.1", port)
    assert str(refused.value) == f"cannot listen for HTTP on 127.0.0.1:{port}: Address already in use"
    assert refused.value.__cause__ is None and refused.value.__suppress_context__
