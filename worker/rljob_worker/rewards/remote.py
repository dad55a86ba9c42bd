"""Rewards scored outside the worker: an HTTP verifier (http-json) or an OpenAI-compatible LLM judge
(openai-chat), as configured by ``spec.reward.remote``.

One :class:`RemoteScorer` per endpoint. :meth:`RemoteScorer.score` sends the samples in requests
(``batchSize`` samples each for http-json, one per sample for openai-chat), at most ``concurrency`` in
flight and ``rateLimit`` started per second, retries a failed request ``retries`` times with
exponential backoff, and returns one score per sample in order, None for a sample whose request
failed every try (the trainer applies ``onFailure``). ``timeoutSeconds`` bounds each request whole, an
answer that trickles in included. Standard library only (urllib, threads).

Wire format (http-json)::

    POST url  {"samples": [{"id", "prompt", "completion", "ground_truth", "data_source", "extra_info"}, ...]}
    200       {"scores": [float, ...]}          same length and order as samples

Values of ``extra_info`` that JSON has no type for (a parquet column's dates, decimals, bytes) are sent as
their text (``str``). Every request carries ``X-Request-Id`` (the same on its retries, so a server may de-duplicate) and each
http-json sample an ``id`` (``<request id>/<index in the batch>``).

Header values from the Secret live only in this object and in request headers: errors, logs and
``repr`` never show them (:meth:`RemoteScorer._scrub` removes them from any server text quoted).
"""
from __future__ import annotations

import http.client
import json
import logging
import math
import os
import re
import socket
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Self

from rljob_api.enums import JudgeScoreRule, RemoteProtocol

from rljob_worker.rewards.registry import RewardError

log = logging.getLogger("rljob.rewards.remote")

MAX_BACKOFF_S = 60.0
_RETRY_STATUS = frozenset({408, 429})
_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_SCORE_TAG = re.compile(rf"<score>\s*({_NUMBER})\s*</score>", re.IGNORECASE)
_ANY_NUMBER = re.compile(_NUMBER)


class RemoteRewardError(RewardError):
    """A request failed for good, or the endpoint is misconfigured; the message is one line, without secrets."""


class _Retryable(Exception):
    def __init__(self, reason: str, wait_s: float | None = None):
        super().__init__(reason)
        self.wait_s = wait_s


@dataclass
class Sample:
    prompt: str
    completion: str
    ground_truth: str
    data_source: str
    extra_info: dict


@dataclass
class RemoteOutcome:
    """What one :meth:`RemoteScorer.score` call did. scores[i] is None when sample i failed every try."""

    scores: list[float | None]
    requests: int = 0  # HTTP requests sent, retries included
    retries: int = 0
    failures: int = 0  # samples without a score
    first_error: str | None = None
    seconds: float = 0.0


@dataclass
class _Counts:
    requests: int = 0
    retries: int = 0
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, requests: int = 0, retries: int = 0, error: str | None = None) -> None:
        with self.lock:
            self.requests += requests
            self.retries += retries
            if error is not None:
                self.errors.append(error)


class RateLimiter:
    """At most `rate` request starts per second over all threads (evenly spaced); None: no limit."""

    def __init__(self, rate: float | None):
        self.interval = 1.0 / rate if rate else 0.0
        self._next = 0.0
        self._lock = threading.Lock()

    def wait(self) -> None:
        if not self.interval:
            return
        with self._lock:
            now = time.monotonic()
            slot = max(now, self._next)
            self._next = slot + self.interval
        if slot > now:
            time.sleep(slot - now)


def _is_score(value) -> bool:
    """A finite JSON number (not a bool; an integer too large for a float is not one)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


class _Deadline:
    """One request's time limit over all of it. The socket timeout bounds each connect and each read, but an
    answer dripped in a byte at a time never lets a read time out: at `limit` seconds the watchdog shuts the
    request's sockets down, which ends the blocked read, and :attr:`expired` tells why it ended."""

    _current = threading.local()

    def __init__(self, limit: float):
        self.expired = False
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._timer = threading.Timer(limit, self._cut)
        self._timer.daemon = True

    def __enter__(self) -> Self:
        _Deadline._current.value = self
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self._timer.cancel()
        self._timer.join()
        _Deadline._current.value = None

    @classmethod
    def connected(cls, sock: socket.socket) -> None:
        """The current thread's request opened `sock`: watch it, or cut it now if the time is up. (urllib hands
        the socket to the response and drops it from the connection, so the socket itself is kept.)"""
        deadline = getattr(cls._current, "value", None)
        if deadline is not None:
            with deadline._lock:
                deadline._sockets.append(sock)
                if deadline.expired:
                    _shutdown(sock)

    def _cut(self) -> None:
        with self._lock:
            self.expired = True
            for sock in self._sockets:
                _shutdown(sock)


def _shutdown(sock: socket.socket) -> None:
    try:  # the plain socket's shutdown, also under TLS: the reading thread sees the connection end
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass


class _HTTPConnection(http.client.HTTPConnection):
    def connect(self):
        super().connect()
        _Deadline.connected(self.sock)


class _HTTPSConnection(http.client.HTTPSConnection):
    def connect(self):
        super().connect()
        _Deadline.connected(self.sock)


class _HTTPHandler(urllib.request.HTTPHandler):
    def http_open(self, req):
        return self.do_open(_HTTPConnection, req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def https_open(self, req):
        extra = {"check_hostname": self._check_hostname} if getattr(self, "_check_hostname", None) is not None else {}
        return self.do_open(_HTTPSConnection, req, context=self._context, **extra)


_OPENER = urllib.request.build_opener(_HTTPHandler, _HTTPSHandler)


def parse_judge_score(reply: str, rule: JudgeScoreRule) -> float | None:
    """The judge's score in [0, 1] by `rule`, or None (no number, or outside [0, 1]).

    score-tag: the number inside the last ``<score>x</score>``; last-number: the last number in the reply."""
    found = (_SCORE_TAG.findall(reply) if rule == JudgeScoreRule.SCORE_TAG else _ANY_NUMBER.findall(reply))
    if not found:
        return None
    value = float(found[-1])
    return value if 0.0 <= value <= 1.0 else None


def render_template(template: str, sample: Sample) -> str:
    """Replace {prompt}, {completion}, {ground_truth}, {data_source}; other braces stay as written."""
    out = template
    for key in ("prompt", "completion", "ground_truth", "data_source"):
        out = out.replace("{" + key + "}", str(getattr(sample, key)))
    return out


class RemoteScorer:
    """Scores samples at one endpoint (``spec.reward.remote`` or ``spec.reward.bySource.<s>.remote``).

    `path` is the spec path of the remote block, used in every error. Reads the header values from
    `environ` now: a missing variable is a RemoteRewardError naming headersSecretRef."""

    def __init__(self, remote, path: str, environ: Mapping[str, str] | None = None, url: str | None = None,
                 ready_timeout_s: float | None = None):
        """`url` stands in for an unset remote.url (the operator-run judge); with `ready_timeout_s` the probe
        keeps trying that long (a judge still loading its model) instead of `retries` times."""
        environ = os.environ if environ is None else environ
        self.ready_timeout_s = ready_timeout_s
        self.spec, self.path = remote, path
        self.protocol = RemoteProtocol(remote.protocol)
        self._headers: dict[str, str] = {"Content-Type": "application/json"}
        ref = remote.headers_secret_ref
        if ref is not None:
            for header, env in ref.env_names().items():
                value = environ.get(env)
                if not value:
                    raise RemoteRewardError(
                        f"{path}.headersSecretRef: env {env} (Secret {ref.name!r} key {ref.headers[header]!r}, header "
                        f"{header}) is not set; create the Secret with that key (the operator injects it), or export "
                        f"{env} when running locally")
                self._headers[header] = value
        # each value, and its words long enough to be a token (a server may quote "sk-..." without "Bearer")
        values = [v for k, v in self._headers.items() if k != "Content-Type"]
        self._secrets = sorted({*values, *(w for v in values for w in v.split() if len(w) >= 8)}, key=len, reverse=True)
        self.url = remote.url or url
        base = self.url.rstrip("/")
        if self.protocol == RemoteProtocol.OPENAI_CHAT:
            base = base.removesuffix("/v1")
            self.endpoint, self.probe_url = base + "/v1/chat/completions", base + "/v1/models"
        else:
            self.endpoint = self.probe_url = self.url
        self.limiter = RateLimiter(remote.rate_limit)
        self._pool = ThreadPoolExecutor(remote.concurrency, thread_name_prefix="rljob-reward")

    def __repr__(self) -> str:  # never the headers
        return f"RemoteScorer({self.protocol.value} {self.endpoint})"

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ start-up
    def probe(self) -> None:
        """Reach the endpoint once (http-json: an empty batch must come back as {"scores": []}; openai-chat:
        GET /v1/models), retrying as a scoring request would. Raises RemoteRewardError naming the url field."""
        counts, s = _Counts(), self.spec
        deadline = time.monotonic() + self.ready_timeout_s if self.ready_timeout_s else None
        for attempt in range(10**9 if deadline else s.retries + 1):
            try:
                if self.protocol == RemoteProtocol.HTTP_JSON:
                    scores = self._post_json(self.endpoint, {"samples": []}, "probe", counts).get("scores")
                    if scores != []:
                        raise _Retryable(f"an empty batch came back as {str(scores)[:80]!r}, not []")
                else:
                    self._request(self.probe_url, None, "probe", counts)
                return
            except _Retryable as exc:
                if deadline is not None and time.monotonic() < deadline:
                    time.sleep(min(10.0, max(0.0, deadline - time.monotonic())))
                    continue
                if deadline is not None or attempt == s.retries:
                    raise RemoteRewardError(
                        f"{self.path}.url: {self.probe_url} does not answer as a {self.protocol.value} endpoint "
                        f"({self._scrub(str(exc))}, after {attempt + 1} tries); check the URL and that the service "
                        "runs") from None
                time.sleep(self._backoff(attempt, exc.wait_s))
            except RemoteRewardError as exc:
                raise RemoteRewardError(f"{self.path}.url: {self.probe_url}: {self._scrub(str(exc))}; check the URL, "
                                        "the endpoint and the headers") from None

    # ------------------------------------------------------------------ scoring
    def score(self, samples: Sequence[Sample]) -> RemoteOutcome:
        """One score per sample, in order; None where the request failed every try."""
        start = time.perf_counter()
        counts = _Counts()
        scores: list[float | None] = [None] * len(samples)
        size = self.spec.batch_size if self.protocol == RemoteProtocol.HTTP_JSON else 1
        chunks = [range(i, min(i + size, len(samples))) for i in range(0, len(samples), size)]
        futures = [self._pool.submit(self._score_chunk, [samples[i] for i in idx], counts) for idx in chunks]
        for idx, fut in zip(chunks, futures):
            result = fut.result()
            if result is not None:
                for i, value in zip(idx, result):
                    scores[i] = value
        failures = sum(v is None for v in scores)
        return RemoteOutcome(scores, requests=counts.requests, retries=counts.retries, failures=failures,
                             first_error=counts.errors[0] if counts.errors else None,
                             seconds=time.perf_counter() - start)

    def _score_chunk(self, chunk: list[Sample], counts: _Counts) -> list[float] | None:
        """One request (with its retries) for `chunk`; None when every try failed (the reason goes to counts)."""
        request_id = uuid.uuid4().hex
        s = self.spec
        for attempt in range(s.retries + 1):
            try:
                return self._send(chunk, request_id, counts)
            except _Retryable as exc:
                reason = self._scrub(str(exc))
                if attempt == s.retries:
                    counts.add(error=f"{self.endpoint}: {reason} (after {attempt + 1} tries)")
                    return None
                counts.add(retries=1)
                log.debug("reward request %s to %s: %s; retry %d", request_id, self.endpoint, reason, attempt + 1)
                time.sleep(self._backoff(attempt, exc.wait_s))
            except RemoteRewardError as exc:  # not retryable (4xx)
                counts.add(error=f"{self.endpoint}: {self._scrub(str(exc))}")
                return None
        return None

    def _send(self, chunk: list[Sample], request_id: str, counts: _Counts) -> list[float]:
        if self.protocol == RemoteProtocol.HTTP_JSON:
            body = {"samples": [{"id": f"{request_id}/{i}", "prompt": x.prompt, "completion": x.completion,
                                 "ground_truth": x.ground_truth, "data_source": x.data_source,
                                 "extra_info": x.extra_info} for i, x in enumerate(chunk)]}
            scores = self._post_json(self.endpoint, body, request_id, counts).get("scores")
            if not isinstance(scores, list) or len(scores) != len(chunk):
                got = f"{len(scores)} scores" if isinstance(scores, list) else f"scores {str(scores)[:40]!r}"
                raise _Retryable(f"malformed answer: {got} for {len(chunk)} samples")
            bad = [v for v in scores if not _is_score(v)]
            if bad:
                raise _Retryable(f"malformed answer: score {str(bad[0])[:40]!r} is not a finite number")
            return [float(v) for v in scores]
        (sample,) = chunk
        judge = self.spec.judge
        messages = [{"role": "user", "content": render_template(judge.prompt_template, sample)}]
        if judge.system_prompt:
            messages.insert(0, {"role": "system", "content": judge.system_prompt})
        answer = self._post_json(self.endpoint, {"model": judge.model, "messages": messages,
                                                 "max_tokens": judge.max_tokens, "temperature": judge.temperature},
                                 request_id, counts)
        try:
            reply = answer["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise _Retryable("malformed answer: no choices[0].message.content") from None
        value = parse_judge_score(reply if isinstance(reply, str) else "", judge.score_rule)
        if value is None:
            raise _Retryable(f"judge reply has no score in [0, 1] by rule {judge.score_rule.value}: "
                             f"{str(reply)[-80:]!r}")
        return [value]

    def _post_json(self, url: str, body: dict, request_id: str, counts: _Counts) -> dict:
        # default=str: a value JSON has no type for (a dataset's date, decimal or bytes in extra_info) goes as text
        raw = self._request(url, json.dumps(body, default=str).encode(), request_id, counts)
        try:
            answer = json.loads(raw)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
            raise _Retryable(f"malformed answer: not JSON ({raw[:60]!r})") from None
        if not isinstance(answer, dict):
            raise _Retryable("malformed answer: not a JSON object")
        return answer

    def _request(self, url: str, data: bytes | None, request_id: str, counts: _Counts) -> bytes:
        self.limiter.wait()
        request = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET",
                                         headers={**self._headers, "X-Request-Id": request_id})
        counts.add(requests=1)
        limit = self.spec.timeout_seconds
        with _Deadline(limit) as deadline:
            try:
                raw = self._open(request, limit)
            except _Retryable:
                if not deadline.expired:
                    raise
        if deadline.expired:  # what came before the cut (a close-delimited body reads as complete) is not the answer
            raise _Retryable(f"no whole answer within timeoutSeconds={limit:g} s")
        return raw

    def _open(self, request: urllib.request.Request, limit: float) -> bytes:
        try:
            with _OPENER.open(request, timeout=limit) as response:
                return response.read()
        except urllib.error.HTTPError as exc:
            text = exc.read()[:200].decode("utf-8", "replace") if exc.fp is not None else ""
            reason = f"HTTP {exc.code} {text.strip()}".strip()
            if exc.code in _RETRY_STATUS or exc.code >= 500:
                raise _Retryable(reason, _retry_after(exc.headers)) from None
            raise RemoteRewardError(reason) from None
        except (urllib.error.URLError, OSError, ValueError) as exc:  # refused, reset, timed out, bad status line
            raise _Retryable(_describe(exc)) from None
        except Exception as exc:  # noqa: BLE001 - http.client's IncompleteRead, RemoteDisconnected, ...
            raise _Retryable(type(exc).__name__) from None

    def _backoff(self, attempt: int, server_wait: float | None) -> float:
        wait = min(self.spec.backoff_seconds * 2**attempt, MAX_BACKOFF_S)
        return max(wait, min(server_wait, MAX_BACKOFF_S)) if server_wait else wait

    def _scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text


def _retry_after(headers) -> float | None:
    try:
        return float(headers.get("Retry-After")) if headers is not None and headers.get("Retry-After") else None
    except ValueError:
        return None


def _describe(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None)
    return f"{type(exc).__name__}: {reason if reason is not None else exc}"
