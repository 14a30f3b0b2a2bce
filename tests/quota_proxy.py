"""A real HTTP service with a quota, on 127.0.0.1, for the services tests and benchmarks: it answers 429 (with
``Retry-After``) to any request beyond ``requests_per_second`` in the sliding second before it arrives, and
otherwise either answers itself after ``latency_s`` (``answer(path, body)``, or an echo, with ``usage``) or
forwards the request to an upstream server (vLLM's OpenAI-compatible server, for the judge). Counts what it served
and refused."""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx


class QuotaProxy:
    def __init__(self, requests_per_second: float, latency_s: float = 0.05, upstream: str | None = None,
                 retry_after_s: float = 1.0, tokens: int = 10, answer: Callable[[str, dict], dict] | None = None
                 ) -> None:
        self.rps, self.latency_s, self.upstream, self.answer = requests_per_second, latency_s, upstream, answer
        self.retry_after_s, self.tokens = retry_after_s, tokens
        self.lock = threading.Lock()
        self.recent: deque[float] = deque()
        self.served: list[float] = []  # arrival times of the requests served
        self.refused = 0
        self.refused_at: list[float] = []  # arrival times of the requests refused
        self.in_flight = self.peak_in_flight = 0
        self.http = httpx.Client(timeout=120) if upstream else None
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                status, payload, headers = proxy.handle(self.path, body)
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def handle(self, path: str, body: bytes) -> tuple[int, bytes, dict]:
        if path.endswith("/refuse"):
            return 400, b'{"error": "bad request"}', {}
        now = time.monotonic()
        with self.lock:
            while self.recent and self.recent[0] <= now - 1.0:
                self.recent.popleft()
            if len(self.recent) >= self.rps:
                self.refused += 1
                self.refused_at.append(now)
                return 429, b'{"error": "rate limited"}', {"Retry-After": f"{self.retry_after_s:g}"}
            self.recent.append(now)
            self.served.append(now)
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            if self.upstream is not None:
                answer = self.http.post(self.upstream + path, content=body,
                                        headers={"Content-Type": "application/json"})
                return answer.status_code, answer.content, {}
            time.sleep(self.latency_s)
            request = json.loads(body or b"{}")
            reply = self.answer(path, request) if self.answer is not None else {"echo": request}
            return 200, json.dumps({**reply, "usage": {"total_tokens": self.tokens}}).encode(), {}
        finally:
            with self.lock:
                self.in_flight -= 1

    def served_rate(self, start: float, end: float) -> float:
        """Requests served a second between two ``time.monotonic()`` readings."""
        return sum(start <= t < end for t in self.served) / (end - start)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
