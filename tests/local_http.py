"""A real HTTP server on localhost for the tests of stages that wait, and clients for it.

The server (standard library, a thread of the test process) answers ``GET /v/<key>`` with
the body ``<key>``. Query options make it misbehave, per path, which the tests count on:

* ``delay=s``: answer after ``s`` seconds (``delay=30``: a request that never ends in time);
* ``fail=k``: answer ``500`` the first ``k`` times this path is asked (``fail=-1``: always);
* ``drop=k``: close the connection without an answer the first ``k`` times (``-1``: always).

It counts requests per path and the most requests it held at once (``peak``). The clients
(importable in workers: the tests directory is on their ``sys.path``) raise
:class:`HTTPFailed` for anything but a ``200``.

Its fixtures are a plugin of the suite (``pytest_plugins`` in ``tests/conftest.py``):
``server``, one server per test module that asks for it, and ``fresh_server``, autouse,
which resets the counts before each test that asks for ``server`` (other tests start none).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


class HTTPFailed(Exception):
    """A request got no ``200`` answer (a status, or a dropped connection)."""


class LocalServer:
    """The server's state: its address, requests per path, and the peak of requests in hand."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.asked: Counter[str] = Counter()
        self.in_hand = 0
        self.peak = 0
        self.httpd: ThreadingHTTPServer | None = None
        self.url = ""

    def reset(self) -> None:
        with self.lock:
            self.asked.clear()
            self.in_hand = 0
            self.peak = 0

    def times(self, key: object) -> int:
        """How many requests reached ``/v/<key>`` (whatever the query)."""
        with self.lock:
            return sum(n for path, n in self.asked.items() if path == f"/v/{key}")


def _handler(state: LocalServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, *args: object) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            parts = urllib.parse.urlsplit(self.path)
            query = dict(urllib.parse.parse_qsl(parts.query))
            with state.lock:
                state.asked[parts.path] += 1
                n = state.asked[parts.path]
                state.in_hand += 1
                state.peak = max(state.peak, state.in_hand)
            try:
                time.sleep(float(query.get("delay", 0)))
            finally:
                # (out of hand before the answer goes: a client that has it may ask again
                # at once, and is not holding two requests)
                with state.lock:
                    state.in_hand -= 1
            drop = int(query.get("drop", 0))
            if drop < 0 or n <= drop:
                self.close_connection = True
                with contextlib.suppress(OSError):
                    self.connection.shutdown(2)
                return
            fail = int(query.get("fail", 0))
            if fail < 0 or n <= fail:
                self.send_error(500, "told to fail")
                return
            body = parts.path.rsplit("/", 1)[-1].encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # (the default 5 drops connections of a burst: 1 s retries)


@contextlib.contextmanager
def serving() -> Iterator[LocalServer]:
    """Run a server on a free localhost port for the block; yields its state."""
    state = LocalServer()
    httpd = _Server(("127.0.0.1", 0), _handler(state))
    state.httpd = httpd
    state.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05})
    thread.daemon = True
    thread.start()
    try:
        yield state
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    """A server for the test module (started by the first test that asks for it)."""
    with serving() as state:
        yield state


@pytest.fixture(autouse=True)
def fresh_server(request: pytest.FixtureRequest) -> None:
    """Counts start from zero in each test that uses ``server`` (no server for the others)."""
    if "server" in request.fixturenames:
        request.getfixturevalue("server").reset()


async def aget(url: str) -> str:
    """GET ``url`` with asyncio streams; the body as text (:class:`HTTPFailed` unless 200)."""
    parts = urllib.parse.urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        writer.write(f"GET {target} HTTP/1.0\r\nHost: {parts.netloc}\r\n\r\n".encode())
        await writer.drain()
        raw = await reader.read()
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    if not raw:
        msg = f"{url}: the server closed the connection without an answer"
        raise HTTPFailed(msg)
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if status != 200:
        msg = f"{url}: HTTP {status}"
        raise HTTPFailed(msg)
    return body.decode()


def get(url: str) -> str:
    """GET ``url`` with urllib (blocking); the body as text (:class:`HTTPFailed` unless 200)."""
    try:
        with urllib.request.urlopen(url, timeout=60) as answer:
            return str(answer.read().decode())
    except (urllib.error.URLError, ConnectionError, OSError) as exc:
        msg = f"{url}: {exc}"
        raise HTTPFailed(msg) from exc
