"""A loopback HTTP server whose answers can be endless: a 200 whose body streams without end (an attacker
or a broken proxy), bounded here, for the tests' sake, by ``max_bytes`` of payload and ``max_s`` seconds
per answer (on the wire: a gzip answer decodes to ~1000 x that). Also a meter of this process's peak
memory.

Routes map a path to what it answers, and may be changed while the server runs:

- :func:`json_answer`: a JSON body of its own (``status``, extra headers);
- :func:`endless`: a 200 (extra headers too), then bytes until the client goes away or the bound is
  reached, framed as ``mode`` says: ``chunked`` (Transfer-Encoding), ``close`` (no length: the body
  ends when the connection does), ``length`` (a Content-Length of 1 TiB), ``gzip`` (chunked,
  Content-Encoding gzip: a stream of zeros that decodes to ~1000 x its size on the wire).

A path without a route answers 404. ``HEAD`` answers a route's status and headers, no body. Each
answer is recorded in ``answers`` (method, path, payload bytes sent, whether the client left first).
"""

from __future__ import annotations

import json
import re
import threading
import time
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

_PIECE = 64 << 10


@dataclass
class Route:
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes | None = None       # None: endless
    mode: str = "chunked"


def json_answer(obj, status: int = 200, headers: dict[str, str] | None = None) -> Route:
    return Route(status, {"Content-Type": "application/json", **(headers or {})}, json.dumps(obj).encode())


def endless(mode: str = "chunked", headers: dict[str, str] | None = None, status: int = 200) -> Route:
    assert mode in ("chunked", "close", "length", "gzip"), mode
    return Route(status, {"Content-Type": "application/json", **(headers or {})}, None, mode)


@dataclass
class Answer:
    method: str
    path: str
    sent: int = 0                  # payload bytes (decoded, for gzip) written before the answer ended
    client_left: bool = False      # the client closed the connection before the server's bound
    done: bool = False


def _gzip_pieces() -> tuple[bytes, bytes, int]:
    """The start of a gzip stream and a piece that may follow it any number of times (a full flush makes
    each piece independent of the ones before), and how many zero bytes each piece decodes to."""
    zeros = bytes(_PIECE * 16)
    c = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    head = c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)
    piece = c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)
    return head, piece, len(zeros)


class EndlessServer:
    def __init__(self, routes: dict[str, Route] | None = None, max_bytes: int = 64 << 20,
                 max_s: float = 20.0):
        self.routes: dict[str, Route] = dict(routes or {})
        self.max_bytes, self.max_s = max_bytes, max_s
        self.answers: list[Answer] = []
        self.lock = threading.Lock()
        server = self
        payload = b'{"choices": [{"message": {"content": "' + b"x" * (_PIECE - 38)
        framed = b"%x\r\n" % len(payload) + payload + b"\r\n"
        gz_head, gz_piece, gz_decoded = _gzip_pieces()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _route(self) -> Route:
                n = int(self.headers.get("Content-Length") or 0)
                if n:
                    self.rfile.read(n)
                path = self.path.split("?")[0]
                return server.routes.get(path) or json_answer({"error": "not found"}, 404)

            def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
                route = self._route()
                with server.lock:
                    server.answers.append(Answer("HEAD", self.path, done=True))
                self.send_response(route.status)
                for k, v in route.headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_GET(self) -> None:  # noqa: N802
                self._answer("GET")

            def do_POST(self) -> None:  # noqa: N802
                self._answer("POST")

            def _answer(self, method: str) -> None:
                route = self._route()
                rec = Answer(method, self.path)
                with server.lock:
                    server.answers.append(rec)
                try:
                    self._send(route, rec)
                finally:
                    rec.done = True

            def _send(self, route: Route, rec: Answer) -> None:
                self.send_response(route.status)
                for k, v in route.headers.items():
                    self.send_header(k, v)
                if route.body is not None:
                    self.send_header("Content-Length", str(len(route.body)))
                    self.end_headers()
                    self.wfile.write(route.body)
                    return
                if route.mode in ("chunked", "gzip"):
                    self.send_header("Transfer-Encoding", "chunked")
                if route.mode == "gzip":
                    self.send_header("Content-Encoding", "gzip")
                elif route.mode == "close":
                    self.send_header("Connection", "close")
                    self.close_connection = True
                elif route.mode == "length":
                    self.send_header("Content-Length", str(1 << 40))
                self.end_headers()
                t0, wire = time.monotonic(), 0
                try:
                    if route.mode == "gzip":
                        self.wfile.write(b"%x\r\n" % len(gz_head) + gz_head + b"\r\n")
                        rec.sent += gz_decoded
                        piece, step = b"%x\r\n" % len(gz_piece) + gz_piece + b"\r\n", gz_decoded
                    elif route.mode == "chunked":
                        piece, step = framed, len(payload)
                    else:
                        piece, step = payload, len(payload)
                    while wire < server.max_bytes and time.monotonic() - t0 < server.max_s:
                        self.wfile.write(piece)
                        rec.sent += step
                        wire += len(piece)
                    if route.mode in ("chunked", "gzip"):
                        self.wfile.write(b"0\r\n\r\n")
                    self.close_connection = True
                except (BrokenPipeError, ConnectionResetError):
                    rec.client_left = True
                    self.close_connection = True

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02},
                                       daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def answers_to(self, path: str) -> list[Answer]:
        """The answers to ``path`` so far, once each has ended (waits a little for that)."""
        deadline = time.monotonic() + 10
        while True:
            with self.lock:
                got = [a for a in self.answers if a.path.split("?")[0] == path]
            if all(a.done for a in got) or time.monotonic() > deadline:
                return got
            time.sleep(0.02)

    def __enter__(self) -> EndlessServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


# ---------------------------------------------------------------------------- memory


def _status_kb(key: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{key}:\s+(\d+) kB", text, re.M).group(1))


class PeakMemory:
    """This process's peak resident memory while the ``with`` block runs, over what it held at the start
    (``growth_mb``): the kernel's high-water mark (VmHWM), reset at the start (``/proc/self/clear_refs``)."""

    def __enter__(self) -> PeakMemory:
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError as e:
            pytest.skip(f"cannot reset this process's peak memory ({e})")
        self.start_kb = _status_kb("VmRSS")
        self.growth_mb = float("nan")
        return self

    def __exit__(self, *exc) -> None:
        self.growth_mb = (_status_kb("VmHWM") - self.start_kb) / 1024
