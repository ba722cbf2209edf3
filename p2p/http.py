"""The operator's HTTP endpoint (``--metrics HOST:PORT``): Prometheus metrics and the live page.

An operator's Prometheus scrapes ``/metrics``; a browser opens ``/``. Both are
served from the node's own event loop: h11 parses HTTP/1.1 (a sans-I/O state
machine, as our Noise and Yamux cores are), trio does the sockets, and a route
is a plain function called at request time, so a scrape reads the counters as
they are (nothing is copied on a timer, no thread, no second event loop; the
standard client's ``start_http_server`` would run a thread of its own).

It serves GET and HEAD of a fixed set of paths, nothing else: a request larger
than :attr:`HttpConfig.max_request_bytes`, slower than
:attr:`HttpConfig.request_timeout` or beyond :attr:`HttpConfig.max_connections`
at once is answered with an error or closed, never buffered. It listens on
loopback unless told otherwise (the metrics name peers and addresses).
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import h11
import trio

from .errors import ConfigError

log = logging.getLogger(__name__)

#: Bytes of a refused request read and dropped before closing (so the refusal reaches the client).
LINGER_BYTES = 256 * 1024
#: Where ``--metrics`` listens when given only a port (``:9100``).
DEFAULT_HOST = "127.0.0.1"


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"
    headers: tuple[tuple[str, str], ...] = ()


#: A route: called with the query string (may be empty), returns the whole response.
Route = Callable[[str], Response]


@dataclass
class HttpConfig:
    #: Connections served at once; more wait in the kernel's backlog.
    max_connections: int = 16
    #: Longest a client may take to send a request (or to read the answer).
    request_timeout: float = 10.0
    #: Largest request (line and headers); a GET has no body.
    max_request_bytes: int = 16 * 1024

    def validate(self) -> None:
        if self.max_connections < 1:
            raise ConfigError(f"max_connections must be at least 1, got {self.max_connections}")
        if not self.request_timeout > 0:
            raise ConfigError(f"request_timeout must be positive, got {self.request_timeout}")
        if self.max_request_bytes < 1024:
            raise ConfigError(f"max_request_bytes must be at least 1024, got {self.max_request_bytes}")


def parse_endpoint(text: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[V6]:PORT`` or ``:PORT`` (loopback) -> (host, port); :class:`ConfigError` if not."""
    host, sep, port_text = text.rpartition(":")
    if not sep:
        raise ConfigError(f"--metrics {text!r}: give HOST:PORT (e.g. 127.0.0.1:9100) or :PORT")
    host = host.strip("[]") or DEFAULT_HOST
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if host != "localhost":
            raise ConfigError(f"--metrics {text!r}: {host!r} is not an IP address") from None
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"--metrics {text!r}: port {port_text!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"--metrics {text!r}: port {port} is out of range")
    return host, port


@dataclass
class HttpServer:
    """Serves ``routes`` (path -> :data:`Route`); run :meth:`serve` in a nursery with ``nursery.start``."""

    routes: Mapping[str, Route]
    config: HttpConfig = field(default_factory=HttpConfig)
    served: int = 0
    refused: int = 0

    def __post_init__(self) -> None:
        self.config.validate()
        self._slots = trio.Semaphore(self.config.max_connections)

    async def serve(self, host: str, port: int, *,
                    task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on ``host:port`` (0: any free port) until cancelled; ``task_status`` gets the bound address."""
        try:
            listeners = await trio.open_tcp_listeners(port, host=host)
        except OSError as e:
            raise ConfigError(f"cannot listen for HTTP on {host}:{port}: {e.strerror or e}") from None
        bound = listeners[0].socket.getsockname()
        task_status.started((str(bound[0]), int(bound[1])))
        await trio.serve_listeners(self._connection, listeners)

    async def _connection(self, stream: trio.SocketStream) -> None:
        async with stream:
            try:
                self._slots.acquire_nowait()
            except trio.WouldBlock:
                self.refused += 1
                # before any request: h11 answers only a request, so by hand
                await self._close_with(stream, b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n"
                                       b"connection: close\r\n\r\n")
                return
            try:
                await self._serve_requests(stream)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass  # the client went away
            except Exception:  # our own bug: it costs this connection, never the server (nor the node)
                log.exception("HTTP connection failed")
            finally:
                self._slots.release()

    async def _serve_requests(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=self.config.max_request_bytes)
        while True:
            request: h11.Request | None = None
            with trio.move_on_after(self.config.request_timeout):
                try:
                    request = await self._read_request(stream, conn)
                except h11.RemoteProtocolError as e:
                    await self._send_simple(stream, conn, e.error_status_hint, f"bad request: {e}\n")
                    return
            if request is None:
                return  # timed out or closed before a whole request
            with trio.move_on_after(self.config.request_timeout):
                await self._respond(stream, conn, request)
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return
            try:
                conn.start_next_cycle()
            except h11.LocalProtocolError:
                return

    async def _read_request(self, stream: trio.SocketStream, conn: h11.Connection) -> h11.Request | None:
        request: h11.Request | None = None
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(4096)
                conn.receive_data(data)  # b"" marks the end
                continue
            if isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.EndOfMessage):
                return request
            elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                return None
            # h11.Data of a request body: read and ignored (GET has none; the size cap still holds)

    async def _respond(self, stream: trio.SocketStream, conn: h11.Connection, request: h11.Request) -> None:
        # h11 admits only ASCII here (a method is a token, a target visible ASCII): nothing to replace
        method = request.method.decode("ascii")
        path, _, query = request.target.decode("ascii").partition("?")
        head, body = self._answer(method, path, query)
        self.served += 1
        await stream.send_all(conn.send(head) or b"")
        if method != "HEAD":
            await stream.send_all(conn.send(h11.Data(data=body)) or b"")
        await stream.send_all(conn.send(h11.EndOfMessage()) or b"")

    def _answer(self, method: str, path: str, query: str) -> tuple[h11.Response, bytes]:
        """The response to send, as h11's event (checked: status, header names and values) and body.
        A route's error, or a response of its that HTTP cannot carry (a status out of range, a
        newline in a header, a body on a 204), answers 500 and is logged: it is found before anything is sent,
        while a clean error can still be sent, and the server goes on."""
        route = self.routes.get(path)
        if method not in ("GET", "HEAD"):
            return _head(Response(405, b"only GET and HEAD\n", headers=(("allow", "GET, HEAD"),)))
        if route is None:
            return _head(Response(404, f"no such page: {path}\n".encode()))
        try:
            return _head(route(query))
        except Exception as e:
            log.exception("HTTP route %s failed", path)
            return _head(Response(500, f"internal error: {type(e).__name__}\n".encode()))

    async def _send_simple(self, stream: trio.SocketStream, conn: h11.Connection, status: int, text: str) -> None:
        body = text.encode()
        try:
            data = conn.send(h11.Response(status_code=status, headers=[
                ("content-type", "text/plain; charset=utf-8"), ("content-length", str(len(body))),
                ("connection", "close")])) or b""
            data += (conn.send(h11.Data(data=body)) or b"") + (conn.send(h11.EndOfMessage()) or b"")
        except h11.LocalProtocolError:
            return  # a response was already under way
        await self._close_with(stream, data)

    async def _close_with(self, stream: trio.SocketStream, data: bytes) -> None:
        """Send ``data`` and end the connection. What the client still sends is read (bounded) first:
        closing with unread bytes makes the kernel reset the connection, and the answer is lost."""
        with trio.move_on_after(self.config.request_timeout):
            try:
                await stream.send_all(data)
                await stream.send_eof()
                with trio.move_on_after(1.0):
                    drained = 0
                    while drained < LINGER_BYTES and (chunk := await stream.receive_some(16384)):
                        drained += len(chunk)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass


def _head(response: Response) -> tuple[h11.Response, bytes]:
    if response.status in (204, 304) and response.body:  # h11 would find it only once the head is sent
        raise ValueError(f"a {response.status} response has no body, got {len(response.body)} bytes")
    headers = [("content-type", response.content_type), ("content-length", str(len(response.body))),
               ("cache-control", "no-store"), ("x-content-type-options", "nosniff"), *response.headers]
    return h11.Response(status_code=response.status, headers=headers), response.body


__all__ = ["DEFAULT_HOST", "HttpConfig", "HttpServer", "Response", "Route", "parse_endpoint"]
