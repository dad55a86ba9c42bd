"""Real HTTP reward endpoints for tests, on 127.0.0.1 in a thread of the test process (or, run as a
script, in their own process):

- :class:`Verifier`: the http-json protocol (POST {"samples": [...]} -> {"scores": [...]}), scoring with
  a given function (default: the target-token reward), and
- :class:`Judge`: an OpenAI-compatible ``/v1/models`` and ``/v1/chat/completions`` whose reply is
  computed from the rendered prompt (``reply(prompt) -> str``).

Both record what they saw (request ids, sample ids, headers, the largest number of requests in
flight) and misbehave on demand: ``faults`` is a list consumed one per request (``"500"``,
``"429"``, ``"drop"`` (close the connection without an answer), ``("slow", seconds)``, ``"count"``
(one score too few), ``"nan-string"`` (a non-number), ``"huge-int"`` (an integer no float holds),
``"deep-json"`` (JSON nested deeper than a parser goes), ``("drip", seconds)`` (the whole answer, status
line first, one byte every `seconds`: no single read waits long, the answer takes long), ``"no-score"``
(a judge reply without a score), ``None`` (answer normally)); :meth:`Server.outage` closes the port for a
while (connections refused) and reopens it.

    python tests/worker/reward_servers.py verifier PORTFILE   # serves target-token until killed
"""
from __future__ import annotations

import json
import sys
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def target_token(sample: dict) -> float:
    """The quickstart's reward, as a verifier team would write it: fraction of positions holding the target."""
    max_len = int(sample["extra_info"].get("max_response_length") or max(len(sample["completion"]), 1))
    return sum(ch == sample["ground_truth"] for ch in sample["completion"][:max_len]) / max_len


def dripped_response(body: dict) -> bytes:
    """The bytes of a ``("drip", seconds)`` answer."""
    data = json.dumps(body).encode()
    return (f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
            "Connection: close\r\n\r\n").encode() + data


class _Quiet(ThreadingHTTPServer):
    def handle_error(self, request, client_address):  # a dropped connection is the point of "drop"
        pass


class Server:
    """Common part: the listening server, its thread, fault list and records."""

    def __init__(self, port: int = 0, delay_s: float = 0.0):
        self.delay_s = delay_s
        self.faults: list = []
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        self.requests: list[dict] = []  # {"id", "headers", "outcome"} per request, in arrival order
        self.scored = Counter()  # sample id (http-json) or request id (judge) -> answers sent with a score
        self._httpd = None
        self._start(port)

    # ------------------------------------------------------------------ lifecycle
    def _start(self, port: int) -> None:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                owner._get(self)

            def do_POST(self):
                owner._post(self)

        self._httpd = _Quiet(("127.0.0.1", port), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def outage(self, seconds: float) -> threading.Thread:
        """Close the port now (connections refused) and reopen it on the same port after `seconds`."""
        port = self.port
        self.close()

        def reopen():
            time.sleep(seconds)
            self._start(port)

        t = threading.Thread(target=reopen, daemon=True)
        t.start()
        return t

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ------------------------------------------------------------------ request handling
    def _next_fault(self):
        with self.lock:
            return self.faults.pop(0) if self.faults else None

    def _enter(self, handler) -> None:
        with self.lock:
            handler.rljob_in_flight = True
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def _leave(self, handler) -> None:
        """A request stops counting once its answer starts to go out: the client may read it and send its
        next request before this handler thread runs again."""
        with self.lock:
            if getattr(handler, "rljob_in_flight", False):
                handler.rljob_in_flight = False
                self.in_flight -= 1

    def _record(self, handler, outcome: str) -> None:
        with self.lock:
            self.requests.append({"id": handler.headers.get("X-Request-Id"), "headers": dict(handler.headers),
                                  "outcome": outcome, "path": handler.path})

    def _send(self, handler, status: int, body: dict | str) -> None:
        data = (json.dumps(body) if not isinstance(body, str) else body).encode()
        self._leave(handler)
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def _drip(self, handler, body: dict, seconds: float) -> None:
        """Answer 200 with `body`, every byte of the response (status line and headers too) on its own after
        `seconds`; stops when the client has gone."""
        raw = dripped_response(body)
        self._leave(handler)
        handler.close_connection = True
        try:
            for i in range(len(raw)):
                time.sleep(seconds)
                handler.connection.sendall(raw[i:i + 1])
        except OSError:  # the client cut the connection
            pass

    def _read(self, handler) -> dict:
        length = int(handler.headers.get("Content-Length", 0))
        return json.loads(handler.rfile.read(length) or b"{}")

    def _faulty(self, handler, fault) -> bool:
        """Apply a transport fault; True when the request was answered (or dropped) by it."""
        if isinstance(fault, tuple) and fault[0] == "slow":
            time.sleep(fault[1])
            return False
        if fault in ("500", "429"):
            self._record(handler, fault)
            self._send(handler, int(fault), {"error": "injected"})
            return True
        if fault == "drop":
            self._record(handler, "drop")
            handler.close_connection = True
            handler.connection.shutdown(2)
            return True
        return False

    def _get(self, handler) -> None:
        self._send(handler, 404, {"error": "not found"})

    def _post(self, handler) -> None:
        self._send(handler, 404, {"error": "not found"})


class Verifier(Server):
    """http-json: {"samples": [...]} -> {"scores": [...]}."""

    def __init__(self, score=target_token, required_headers: dict | None = None, **kw):
        self.score = score
        self.required_headers = required_headers or {}
        self.batch_sizes: list[int] = []
        self.bodies: list[dict] = []  # every request body, in arrival order
        super().__init__(**kw)

    def _post(self, handler) -> None:
        self._enter(handler)
        try:
            body = self._read(handler)
            with self.lock:
                self.bodies.append(body)
            if any(handler.headers.get(k) != v for k, v in self.required_headers.items()):
                self._record(handler, "401")
                self._send(handler, 401, {"error": "unauthorized"})
                return
            fault = self._next_fault()
            if self.delay_s:
                time.sleep(self.delay_s)
            if self._faulty(handler, fault):
                return
            samples = body["samples"]
            scores = [self.score(s) for s in samples]
            if fault == "count":
                scores = scores[:-1]
            elif fault == "nan-string":
                scores = ["NaN"] + scores[1:]
            elif fault == "deep-json":
                self._record(handler, fault)
                self._send(handler, 200, '{"scores": ' + "[" * 100_000 + "]" * 100_000 + "}")
                return
            self._record(handler, str(fault or "ok"))
            with self.lock:
                if samples:
                    self.batch_sizes.append(len(samples))
                if fault is None:
                    self.scored.update(s["id"] for s in samples)
            if fault == "huge-int":
                self._send(handler, 200, json.dumps({"scores": scores[1:]})
                           .replace('{"scores": [', '{"scores": [1' + "0" * 400 + (", " if scores[1:] else ""), 1))
            elif isinstance(fault, tuple) and fault[0] == "drip":
                self._drip(handler, {"scores": scores}, fault[1])
            else:
                self._send(handler, 200, {"scores": scores})
        finally:
            self._leave(handler)


class Judge(Server):
    """OpenAI-compatible chat completions; the reply is reply(user message)."""

    def __init__(self, reply, model: str = "judge-1", **kw):
        self.reply, self.model = reply, model
        self.prompts: list[str] = []
        super().__init__(**kw)

    def _get(self, handler) -> None:
        self._record(handler, "models")
        if handler.path.rstrip("/") == "/v1/models":
            self._send(handler, 200, {"object": "list", "data": [{"id": self.model, "object": "model"}]})
        else:
            self._send(handler, 404, {"error": "not found"})

    def _post(self, handler) -> None:
        if handler.path != "/v1/chat/completions":
            self._send(handler, 404, {"error": "not found"})
            return
        self._enter(handler)
        try:
            body = self._read(handler)
            fault = self._next_fault()
            if self.delay_s:
                time.sleep(self.delay_s)
            if self._faulty(handler, fault):
                return
            if body.get("model") != self.model:
                self._record(handler, "bad-model")
                self._send(handler, 404, {"error": f"model {body.get('model')!r} does not exist"})
                return
            user = [m["content"] for m in body["messages"] if m["role"] == "user"][-1]
            content = "I cannot tell." if fault == "no-score" else self.reply(user)
            self._record(handler, fault or "ok")
            with self.lock:
                self.prompts.append(user)
                if fault is None:
                    self.scored[handler.headers.get("X-Request-Id")] += 1
            self._send(handler, 200, {"id": "chatcmpl-1", "object": "chat.completion", "model": self.model,
                                      "choices": [{"index": 0, "finish_reason": "stop",
                                                   "message": {"role": "assistant", "content": content}}]})
        finally:
            self._leave(handler)


if __name__ == "__main__":
    kind, port_file = sys.argv[1], Path(sys.argv[2])
    assert kind == "verifier", kind
    server = Verifier()
    port_file.write_text(str(server.port))
    while True:
        time.sleep(3600)
