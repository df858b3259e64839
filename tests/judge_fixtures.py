"""A small OpenAI-compatible server of the tests' own, for an LLM judge's faults.

What it answers depends on the user message (the tests' template is just ``{completion}``):

- ``say:TEXT``: replies TEXT;
- ``429once:ID``: 429 (``Retry-After: 0``) the first time ID is asked, then ``7``;
- ``500:N:ID``: 500 the first N times ID is asked, then ``8``; ``500always``: always 500;
- ``slow:S``: waits S seconds, then ``5``;
- ``malformed``: a 200 whose body is not JSON; ``nochoices``: JSON without ``choices``;
- ``bad_request``: 400 (not worth asking again);
- ``key?``: ``yes`` when the ``Authorization`` header carries ``Bearer`` + the server's ``expected_key``;
- anything else: ``Score: N``, N (0-9) a checksum of the message.

``GET /v1/models`` lists one model, ``tiny-judge``. The server counts requests (``hits``, by message),
tracks how many are in flight at once (``peak``) and records every request body (``bodies``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FaultServer:
    def __init__(self, delay_s: float = 0.0, expected_key: str = ""):
        self.delay_s = delay_s
        self.expected_key = expected_key
        self.hits: Counter = Counter()
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.in_flight = 0
        self.peak = 0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body go out as two writes: no 40 ms ACK stall

            def log_message(self, *args) -> None:  # quiet
                pass

            def _send(self, status: int, body: bytes, headers: dict | None = None) -> None:
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    for k, v in (headers or {}).items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (a deadline): nothing to answer

            def do_GET(self) -> None:
                if self.path == "/stats":
                    with server.lock:
                        stats = {"peak": server.peak, "requests": server.requests()}
                    self._send(200, json.dumps(stats).encode())
                elif self.path.endswith("/models"):
                    self._send(200, json.dumps({"object": "list", "data": [{"id": "tiny-judge"}]}).encode())
                else:
                    self._send(404, b'{"error": "not found"}')

            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(n))
                msg = body["messages"][-1]["content"]
                with server.lock:
                    server.hits[msg] += 1
                    count = server.hits[msg]
                    server.bodies.append(body)
                    server.headers.append(dict(self.headers))
                    server.in_flight += 1
                    server.peak = max(server.peak, server.in_flight)
                try:
                    if server.delay_s:
                        time.sleep(server.delay_s)
                    self._answer(msg, count)
                finally:
                    with server.lock:
                        server.in_flight -= 1

            def _answer(self, msg: str, count: int) -> None:
                def reply(text: str) -> None:
                    self._send(200, json.dumps({
                        "id": "x", "object": "chat.completion", "model": "tiny-judge",
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                     "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": len(msg), "completion_tokens": len(text),
                                  "total_tokens": len(msg) + len(text)}}).encode())

                if msg.startswith("say:"):
                    return reply(msg[4:])
                if msg.startswith("429once:"):
                    if count == 1:
                        return self._send(429, b'{"error": "rate limited"}', {"Retry-After": "0"})
                    return reply("7")
                if msg == "500always":
                    return self._send(500, b'{"error": "boom"}')
                if msg.startswith("500:"):
                    times = int(msg.split(":")[1])
                    return self._send(500, b'{"error": "boom"}') if count <= times else reply("8")
                if msg.startswith("slow:"):
                    time.sleep(float(msg.split(":")[1]))
                    return reply("5")
                if msg == "bad_request":
                    return self._send(400, b'{"error": {"message": "context too long"}}')
                if msg == "malformed":
                    return self._send(200, b"<html>oops</html>")
                if msg == "nochoices":
                    return self._send(200, b'{"object": "chat.completion"}')
                if msg == "key?":
                    ok = self.headers.get("Authorization") == f"Bearer {server.expected_key}"
                    return reply("yes" if ok else "no")
                return reply(f"Score: {sum(map(ord, msg)) % 10}")  # anything else: a score of its text

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02},
                                       daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def requests(self) -> int:
        return sum(self.hits.values())

    def __enter__(self) -> FaultServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class ServerProcess:
    """The same server in a process of its own (``python -m tests.judge_fixtures``), so that timing the
    judge does not time the server's Python threads against the judge's for one GIL."""

    def __init__(self, delay_s: float = 0.0):
        self.delay_s = delay_s
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def __enter__(self) -> ServerProcess:
        cmd = [sys.executable, "-m", "tests.judge_fixtures", "--delay", str(self.delay_s)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        port = int(self.proc.stdout.readline())
        self.url = f"http://127.0.0.1:{port}/v1"
        return self

    def stats(self) -> dict:
        with urllib.request.urlopen(self.url.rsplit("/v1", 1)[0] + "/stats", timeout=5) as r:
            return json.loads(r.read())

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--delay", type=float, default=0.0)
    a = ap.parse_args()
    srv = FaultServer(delay_s=a.delay)
    print(srv.httpd.server_address[1], flush=True)
    srv.httpd.serve_forever(poll_interval=0.05)


if __name__ == "__main__":
    main()
