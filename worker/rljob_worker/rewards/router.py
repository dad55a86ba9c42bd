"""One face for every reward of a job: the local function, a remote endpoint, and the routes by data source.

``spec.reward`` (function or remote) scores samples whose data source has no route in
``spec.reward.bySource``; each route is a local function or a remote endpoint. :meth:`RewardRouter.submit`
scores local routes at once (in the calling thread, under their timeout) and remote routes in the
background when asked, so a caller can do other work and join with :meth:`PendingScores.result`.

A remote sample that failed every try becomes what its route's ``onFailure`` says: ``fail`` raises
RewardError, ``zero`` scores it 0, ``drop-group`` scores it 0 and flags it in ``Scored.dropped`` (the
trainer zeroes its group's advantages). Each is counted in ``Scored.routes``.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from rljob_api.enums import RemoteFailurePolicy

from rljob_worker.rewards.registry import RewardError, resolve_reward, score_all
from rljob_worker.rewards.remote import RemoteOutcome, RemoteRewardError, RemoteScorer, Sample

#: The route of spec.reward itself (samples whose data source has no bySource entry); not a data source name.
DEFAULT_ROUTE = "*"


@dataclass
class RouteCounts:
    """Per route, one scoring call: samples, remote requests/retries/failed samples, and what the policy did."""

    samples: int = 0
    requests: int = 0
    retries: int = 0
    failures: int = 0  # samples without a score after every retry
    zeroed: int = 0
    dropped: int = 0
    seconds: float = 0.0
    first_error: str | None = None  # the endpoint and why its first failed request failed


@dataclass
class Scored:
    scores: list[float]  # (N,), 0.0 where a failed sample was zeroed or dropped
    dropped: list[bool]  # (N,) True: failed under drop-group
    routes: dict[str, RouteCounts] = field(default_factory=dict)  # by route: DEFAULT_ROUTE or the source


class _Route:
    def __init__(self, name: str, path: str, function: str | None, remote, environ, **remote_kw):
        self.name, self.path = name, path
        self.remote = RemoteScorer(remote, f"{path}.remote", environ, **remote_kw) if remote is not None else None
        try:
            self.fn = resolve_reward(function) if remote is None else None
        except RewardError as exc:  # name the route's own field
            raise RewardError(str(exc).replace("spec.reward.function", f"{path}.function", 1)) from None
        self.function = function


class PendingScores:
    """Scores being computed; :meth:`result` joins (raises RewardError under onFailure fail)."""

    def __init__(self, router: RewardRouter, n: int, local: dict[str, list[float]],
                 remote: dict[str, Future | RemoteOutcome], index: dict[str, list[int]]):
        self._router, self._n, self._local, self._remote, self._index = router, n, local, remote, index

    def result(self) -> Scored:
        scores, dropped = [0.0] * self._n, [False] * self._n
        routes: dict[str, RouteCounts] = {}
        for name, values in self._local.items():
            for i, v in zip(self._index[name], values):
                scores[i] = v
            routes[name] = RouteCounts(samples=len(values))
        for name, pending in self._remote.items():
            outcome: RemoteOutcome = pending.result() if isinstance(pending, Future) else pending
            route = self._router.routes[name]
            policy = route.remote.spec.on_failure
            counts = RouteCounts(samples=len(outcome.scores), requests=outcome.requests, retries=outcome.retries,
                                 failures=outcome.failures, seconds=outcome.seconds, first_error=outcome.first_error)
            if outcome.failures and policy == RemoteFailurePolicy.FAIL:
                raise RewardError(
                    f"{route.path}.remote: {outcome.failures} of {len(outcome.scores)} samples could not be scored "
                    f"({outcome.first_error}); onFailure fail stops the run (zero or drop-group keep training)")
            for i, v in zip(self._index[name], outcome.scores):
                if v is not None:
                    scores[i] = v
                elif policy == RemoteFailurePolicy.DROP_GROUP:
                    dropped[i] = True
                    counts.dropped += 1
                else:
                    counts.zeroed += 1
            routes[name] = counts
        return Scored(scores, dropped, routes)


class RewardRouter:
    """spec.reward as callables and endpoints, built once (resolves functions, reads header env now)."""

    def __init__(self, reward, *, pool=None, environ: Mapping[str, str] | None = None, judge_url: str | None = None):
        """`judge_url`: where the operator-run judge (spec.reward.server) answers, for a remote without url."""
        self.spec, self.pool = reward, pool
        server = reward.server
        self.default = _Route(DEFAULT_ROUTE, "spec.reward", reward.function, reward.remote, environ,
                              url=judge_url if server is not None else None,
                              ready_timeout_s=server.ready_timeout_seconds if server is not None else None)
        self.routes: dict[str, _Route] = {DEFAULT_ROUTE: self.default}
        for source, route in reward.by_source.items():
            self.routes[source] = _Route(source, f"spec.reward.bySource.{source}", route.function, route.remote,
                                         environ)
        remotes = [r for r in self.routes.values() if r.remote is not None]
        self.has_remote = bool(remotes)
        self.overlap = bool(remotes) and all(r.remote.spec.overlap for r in remotes)
        self._background = ThreadPoolExecutor(len(remotes), thread_name_prefix="rljob-reward-route") if remotes else None

    def unused_routes_warning(self, data_sources: set[str]) -> str | None:
        """One line naming the spec.reward.bySource keys that match no row's data_source (a typo, or the data's
        sources are spelt otherwise: those rows are scored by spec.reward instead, silently); None when all match."""
        unused = sorted(k for k in self.routes if k != DEFAULT_ROUTE and k not in data_sources)
        if not unused:
            return None
        present = ", ".join(repr(s) for s in sorted(data_sources)[:8]) + (", ..." if len(data_sources) > 8 else "")
        return (f"spec.reward.bySource {', '.join(repr(k) for k in unused)}: no row of data.trainFiles / valFiles "
                f"(or data.synthetic) has that data_source, so the route is never used and those rows are scored by "
                f"spec.reward; the data's sources are {present or 'none'}: rename the key to one of them")

    def route_of(self, data_source: str) -> str:
        return data_source if data_source in self.routes and data_source != DEFAULT_ROUTE else DEFAULT_ROUTE

    def describe(self, route: str) -> str:
        """The route's reward in words, for log lines (never headers)."""
        r = self.routes[route]
        return f"remote {r.remote.endpoint}" if r.remote is not None else f"function {r.function}"

    def failure_report(self, route: str, counts: RouteCounts, *, validation: bool = False) -> str:
        """One line for a remote route some of whose samples could not be scored: how many, what became of them,
        the first error (endpoint and reason) and the fields to look at."""
        path = self.routes[route].path
        became = ("validation counts them 0" if validation else
                  f"{counts.zeroed} scored 0, {counts.dropped} dropped with their groups")
        return (f"{counts.failures} of {counts.samples} samples of reward route {route} ({self.describe(route)}) could "
                f"not be scored ({became}): {counts.first_error}; check the service at {path}.remote.url, or its "
                f"timeoutSeconds and retries")

    def probe(self) -> None:
        """Reach every remote endpoint once (rank 0, at start-up); RewardError naming the url field."""
        for route in self.routes.values():
            if route.remote is not None:
                try:
                    route.remote.probe()
                except RemoteRewardError as exc:
                    if route is self.default and self.spec.server is not None:
                        raise RewardError(f"spec.reward.server: the judge at {route.remote.url} did not answer within "
                                          f"readyTimeoutSeconds={self.spec.server.ready_timeout_seconds} ({exc}); see "
                                          "its Deployment's pods") from None
                    raise RewardError(str(exc)) from None

    def submit(self, prompts: Sequence[str], completions: Sequence[str], ground_truths: Sequence[str],
               data_sources: Sequence[str], extras: Sequence[dict], *, timeout_s: float,
               background: bool = False) -> PendingScores:
        """Score N samples: local routes now, remote routes now or (background) in threads."""
        index: dict[str, list[int]] = {}
        for i, source in enumerate(data_sources):
            index.setdefault(self.route_of(source), []).append(i)
        local: dict[str, list[float]] = {}
        remote: dict[str, Future | RemoteOutcome] = {}
        for name, rows in index.items():
            route = self.routes[name]
            if route.remote is None:
                local[name] = score_all(route.fn, [prompts[i] for i in rows], [completions[i] for i in rows],
                                        [ground_truths[i] for i in rows], [extras[i] for i in rows],
                                        pool=self.pool, timeout_s=timeout_s)
                continue
            samples = [Sample(prompts[i], completions[i], ground_truths[i], data_sources[i],
                              {k: v for k, v in extras[i].items() if k != "data_source"}) for i in rows]
            remote[name] = (self._background.submit(route.remote.score, samples) if background
                            else route.remote.score(samples))
        return PendingScores(self, len(prompts), local, remote, index)

    def score(self, *args, **kwargs) -> Scored:
        return self.submit(*args, **kwargs).result()

    def close(self) -> None:
        for route in self.routes.values():
            if route.remote is not None:
                route.remote.close()
        if self._background is not None:
            self._background.shutdown(wait=False, cancel_futures=True)
