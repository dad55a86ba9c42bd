"""Remote rewards against real HTTP servers on 127.0.0.1 (tests/worker/reward_servers.py): the http-json
verifier and the OpenAI-compatible judge, batching, the concurrency and rate limits held (seen by the
server), retries through every fault with each sample scored exactly once (server-side ids), the
onFailure policies, start-up errors naming the field, and header secrets that never leak."""
from __future__ import annotations

import datetime
import decimal
import math
import sys
import time
from pathlib import Path

import pytest
from rljob_api.enums import JudgeScoreRule
from rljob_api.models import RewardSpec, secret_header_env
from rljob_api.validation import RLJobValidationError, parse_spec
from rljob_worker.algorithms.evaluation import k_values, pass_at_k, sample_metrics
from rljob_worker.rewards import DEFAULT_ROUTE, RewardError, RewardRouter
from rljob_worker.rewards.remote import parse_judge_score, render_template

sys.path.insert(0, str(Path(__file__).parent))
from reward_servers import Judge, Verifier, dripped_response, target_token

SECRET = "sk-test-5f1c0a9e77d2"


def samples(count: int, target: str = "x"):
    """(prompts, completions, truths, sources, extras) of `count` target-token samples with known rewards."""
    completions = [target * (i % 5) + "y" * (4 - i % 5) for i in range(count)]
    return ([f"p{i}" for i in range(count)], completions, [target] * count, ["synthetic/target-token"] * count,
            [{"max_response_length": 4, "index": i} for i in range(count)])


def expected(batch) -> list[float]:
    _, completions, truths, _, extras = batch
    return [target_token({"completion": c, "ground_truth": t, "extra_info": e})
            for c, t, e in zip(completions, truths, extras)]


def router(remote: dict, environ=None, **reward) -> RewardRouter:
    spec = RewardSpec.model_validate({"remote": {"backoffSeconds": 0.05, **remote}, **reward})
    return RewardRouter(spec, environ=environ or {})


def score(r: RewardRouter, batch, background=False):
    return r.submit(*batch, timeout_s=30, background=background).result()


@pytest.fixture
def verifier():
    server = Verifier()
    yield server
    server.close()


# ---------------------------------------------------------------- http-json


def test_batches_in_order_with_ids(verifier):
    batch = samples(20)
    r = router({"url": verifier.url + "/score", "batchSize": 8, "concurrency": 1})
    out = score(r, batch)
    assert out.scores == expected(batch)
    assert verifier.batch_sizes == [8, 8, 4]
    assert sorted(verifier.scored.values()) == [1] * 20  # 20 distinct sample ids, each answered once
    counts = out.routes[DEFAULT_ROUTE]
    assert (counts.samples, counts.requests, counts.retries, counts.failures) == (20, 3, 0, 0)
    assert all(req["id"] and len(req["id"]) == 32 for req in verifier.requests)
    r.close()


def test_concurrency_limit_is_held_server_side():
    server = Verifier(delay_s=0.15)
    try:
        r = router({"url": server.url, "batchSize": 1, "concurrency": 3})
        batch = samples(15)
        out = score(r, batch)
        assert out.scores == expected(batch)
        assert server.max_in_flight == 3  # reached, never exceeded
        r.close()
    finally:
        server.close()


def test_rate_limit_spaces_request_starts(verifier):
    r = router({"url": verifier.url, "batchSize": 1, "concurrency": 8, "rateLimit": 20})
    start = time.monotonic()
    score(r, samples(11))
    # 11 starts at most 20 per second: the last starts >= 10 intervals of 50 ms after the first
    assert time.monotonic() - start >= 0.5
    r.close()


FAULTS = ["500", "429", "drop", "count", "nan-string", "huge-int", "deep-json", ("slow", 4.0)]


@pytest.mark.parametrize("fault", FAULTS, ids=[str(f) for f in FAULTS])
def test_every_fault_is_retried_and_each_sample_scored_once(verifier, fault):
    """Two faulty answers, then good ones: all samples scored, each sample id answered exactly once by the
    server, two retries counted."""
    verifier.faults = [fault, fault]
    batch = samples(12)
    # a generous timeout (this machine may be loaded), below the slow answer's 4 s
    r = router({"url": verifier.url, "batchSize": 4, "concurrency": 1, "retries": 3, "timeoutSeconds": 2.0})
    out = score(r, batch)
    assert out.scores == expected(batch)
    assert sorted(verifier.scored.values()) == [1] * 12
    counts = out.routes[DEFAULT_ROUTE]
    assert (counts.retries, counts.failures, counts.requests) == (2, 0, 5)
    r.close()


def test_a_dripped_answer_is_cut_at_timeout_seconds(verifier):
    """An answer that comes a byte at a time never lets one read time out; timeoutSeconds still bounds the
    request: it is cut there and retried, so a misbehaving endpoint costs a retry, never a step forever."""
    limit, every = 1.0, 0.02  # a read waits ~20 ms, far below the limit, whatever the load
    verifier.faults = [("drip", every)]
    batch = samples(16)
    r = router({"url": verifier.url, "batchSize": 16, "concurrency": 1, "retries": 1, "timeoutSeconds": limit})
    start = time.monotonic()
    out = score(r, batch)
    elapsed = time.monotonic() - start
    r.close()
    assert out.scores == expected(batch)
    counts = out.routes[DEFAULT_ROUTE]
    assert (counts.requests, counts.retries, counts.failures) == (2, 1, 0)  # the dripped answer was not taken
    # the drip alone takes its ~200 bytes x 20 ms (~4 s); it was cut at the 1 s limit, then answered at once
    assert elapsed < len(dripped_response({"scores": out.scores})) * every


def test_extra_info_values_json_cannot_hold_go_as_text(verifier):
    """A dataset's extra_info may hold what parquet gives and JSON lacks (dates, decimals, bytes): the samples
    are still sent (those values as text) and scored, instead of the step dying on a TypeError."""
    batch = samples(3)
    odd = {"when": datetime.date(2024, 1, 2), "price": decimal.Decimal("1.5"), "blob": b"\x00"}
    batch = (*batch[:4], [{**e, **odd} for e in batch[4]])
    r = router({"url": verifier.url, "batchSize": 4})
    out = score(r, batch)
    r.close()
    assert out.scores == expected(batch)
    (request,) = [q for q in verifier.bodies if q["samples"]]
    assert request["samples"][0]["extra_info"]["when"] == "2024-01-02"
    assert request["samples"][0]["extra_info"]["price"] == "1.5"


def test_an_outage_is_ridden_out(verifier):
    """The endpoint is down (connections refused) for 1.5 s, the shape of a 30 s outage: retries with
    backoff (0.25 + 0.5 + 1 + 2 s) outlast it, nothing is lost or scored twice."""
    r = router({"url": verifier.url, "batchSize": 4, "concurrency": 2, "retries": 5, "backoffSeconds": 0.25})
    reopened = verifier.outage(1.5)
    batch = samples(16)
    start = time.monotonic()
    out = score(r, batch)
    reopened.join()
    assert time.monotonic() - start >= 1.4
    assert out.scores == expected(batch)
    assert sorted(verifier.scored.values()) == [1] * 16
    assert out.routes[DEFAULT_ROUTE].retries >= 4  # each of the 4 requests failed at least once
    r.close()


def test_on_failure_fail_zero_drop_group(verifier):
    batch = samples(8)
    common = {"url": verifier.url, "batchSize": 4, "concurrency": 1, "retries": 1}

    verifier.faults = ["500", "500"]  # the first request fails both tries; the second succeeds
    with pytest.raises(RewardError) as err:
        score(router(common), batch)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("spec.reward.remote: 4 of 8 samples could not be scored")
    assert "HTTP 500" in message and "onFailure" in message

    verifier.faults = ["500", "500"]
    out = score(router({**common, "onFailure": "zero"}), batch)
    assert out.scores == [0.0] * 4 + expected(batch)[4:]
    assert (out.routes[DEFAULT_ROUTE].failures, out.routes[DEFAULT_ROUTE].zeroed) == (4, 4)
    assert out.dropped == [False] * 8

    verifier.faults = [None, "drop", "drop"]  # now the second request fails
    out = score(router({**common, "onFailure": "drop-group"}), batch)
    assert out.dropped == [False] * 4 + [True] * 4
    assert out.scores[:4] == expected(batch)[:4]
    assert out.routes[DEFAULT_ROUTE].dropped == 4


def test_background_scoring_overlaps_the_caller(verifier):
    verifier.delay_s = 1.0
    r = router({"url": verifier.url, "batchSize": 8})
    batch = samples(8)
    start = time.monotonic()
    pending = r.submit(*batch, timeout_s=30, background=True)
    submitted = time.monotonic() - start
    time.sleep(1.0)  # the caller's own work (the log-prob passes in the trainer)
    out = pending.result()
    # 1 s of scoring hid behind 1 s of work: in turn they would take at least 2 s
    assert submitted < 0.5 and time.monotonic() - start < 1.9
    assert out.scores == expected(batch)
    r.close()


# ---------------------------------------------------------------- openai-chat judge


def judge_reply(prompt: str) -> str:
    """Grades 'answer: X / reference: Y' prompts: 1 when equal."""
    answer = prompt.split("answer: ")[1].split(" /")[0]
    reference = prompt.split("reference: ")[1]
    return f"Comparing {answer} with {reference}, 2 numbers. <score>{1 if answer == reference else 0}</score>"


JUDGE = {"model": "judge-1", "promptTemplate": "Grade {\"json\": true} answer: {completion} / reference: {ground_truth}"}


def test_openai_chat_judge_scores_each_sample():
    server = Judge(judge_reply)
    try:
        r = router({"url": server.url + "/v1", "protocol": "openai-chat", "concurrency": 4, "judge": JUDGE})
        r.probe()  # GET /v1/models
        batch = (["q"] * 6, ["1", "2", "3", "4", "5", "6"], ["1", "0", "3", "0", "5", "0"], ["s"] * 6, [{}] * 6)
        server.faults = ["no-score"]  # one reply without a score: retried
        out = score(r, batch)
        assert out.scores == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
        assert out.routes[DEFAULT_ROUTE].retries == 1
        assert sorted(server.scored.values()) == [1] * 6  # one good answer per request id
        assert 'Grade {"json": true} answer: 1 / reference: 1' in server.prompts  # other braces kept
        r.close()
    finally:
        server.close()


def test_zeroed_samples_are_reported_with_their_cause():
    """onFailure zero keeps training on 0s; the line the trainer logs says why: the endpoint, the server's
    answer (here an expired key: HTTP 401), and the field to fix."""
    server = Verifier(required_headers={"Authorization": "Bearer fresh"})
    try:
        r = router({"url": server.url + "/score", "batchSize": 4, "retries": 2, "onFailure": "zero",
                    "headersSecretRef": {"name": "verifier-key", "headers": {"Authorization": "token"}}},
                   environ={secret_header_env("verifier-key", "token"): "Bearer expired-key-0123"})
        out = score(r, samples(4))
        counts = out.routes[DEFAULT_ROUTE]
        assert out.scores == [0.0] * 4 and (counts.failures, counts.zeroed, counts.requests) == (4, 4, 1)
        line = r.failure_report(DEFAULT_ROUTE, counts)
        assert "\n" not in line and "expired-key" not in line
        assert line.startswith(f"4 of 4 samples of reward route * (remote {server.url}/score) could not be scored "
                               "(4 scored 0, 0 dropped with their groups)")
        assert f"{server.url}/score: HTTP 401" in line and "spec.reward.remote.url" in line
        r.close()
    finally:
        server.close()


def test_client_errors_are_not_retried():
    server = Judge(judge_reply)
    try:
        r = router({"url": server.url, "protocol": "openai-chat", "retries": 3, "onFailure": "zero",
                    "judge": {**JUDGE, "model": "no-such-model"}})
        out = score(r, (["q"], ["1"], ["1"], ["s"], [{}]))
        assert out.scores == [0.0] and out.routes[DEFAULT_ROUTE].requests == 1  # HTTP 404: no retry
    finally:
        server.close()


@pytest.mark.parametrize(("reply", "rule", "value"), [
    ("<score>0.7</score>", JudgeScoreRule.SCORE_TAG, 0.7),
    ("first <score>1</score> then <SCORE> 0 </SCORE>", JudgeScoreRule.SCORE_TAG, 0.0),
    ("score 1 of 10 ... <score>0.5</score> 3", JudgeScoreRule.SCORE_TAG, 0.5),
    ("no tag 1", JudgeScoreRule.SCORE_TAG, None),
    ("<score>7</score>", JudgeScoreRule.SCORE_TAG, None),  # outside [0, 1]
    ("steps 1, 2 and 3; final: 1", JudgeScoreRule.LAST_NUMBER, 1.0),
    ("final .25", JudgeScoreRule.LAST_NUMBER, 0.25),
    ("final: 3", JudgeScoreRule.LAST_NUMBER, None),
    ("nothing", JudgeScoreRule.LAST_NUMBER, None),
])
def test_judge_score_rules(reply, rule, value):
    assert parse_judge_score(reply, rule) == value


def test_template_keeps_foreign_braces():
    from rljob_worker.rewards.remote import Sample

    sample = Sample("P", "C", "G", "D", {})
    assert render_template("{prompt}|{completion}|{ground_truth}|{data_source}|{other}|{}", sample) == "P|C|G|D|{other}|{}"


# ---------------------------------------------------------------- start-up, secrets, routing


def test_wrong_url_is_a_one_line_startup_error():
    closed = Verifier()
    url = closed.url
    closed.close()  # nothing listens there now
    r = router({"url": url + "/score", "retries": 1})
    with pytest.raises(RewardError) as err:
        r.probe()
    message = str(err.value)
    assert message.startswith(f"spec.reward.remote.url: {url}/score does not answer") and "\n" not in message


def test_probe_refuses_an_endpoint_that_is_not_a_verifier():
    server = Judge(judge_reply)  # a chat server: POST /score is 404
    try:
        with pytest.raises(RewardError, match=r"^spec.reward.remote.url: .*HTTP 404"):
            router({"url": server.url + "/score"}).probe()
    finally:
        server.close()


def test_missing_secret_env_names_the_field():
    remote = {"url": "http://127.0.0.1:9/x", "headersSecretRef": {"name": "judge-key", "headers": {"Authorization": "token"}}}
    with pytest.raises(RewardError) as err:  # a configuration error: one line at start-up
        router(remote, environ={"UNRELATED": "1"})
    message = str(err.value)
    assert message.startswith("spec.reward.remote.headersSecretRef: env RLJOB_REWARD_HEADER_JUDGE_KEY_TOKEN_")
    assert "Secret 'judge-key' key 'token'" in message and "\n" not in message
    with pytest.raises(RewardError, match=r"^spec.reward.bySource.math.remote.headersSecretRef: env "):
        RewardRouter(RewardSpec.model_validate({"function": "gsm8k", "bySource": {"math": {"remote": remote}}}),
                     environ={})


class EchoingVerifier(Verifier):
    """Refuses every request with a 401 whose body quotes the Authorization header it got."""

    def _post(self, handler):
        self._record(handler, "401")
        self._read(handler)
        token = handler.headers.get("Authorization")
        self._send(handler, 401, {"error": f"bad token {token} ({token.split()[-1]})"})


def test_secret_header_is_sent_and_never_shown(caplog):
    from rljob_api.models import secret_header_env

    env = {secret_header_env("judge-key", "token"): f"Bearer {SECRET}"}
    remote = {"headersSecretRef": {"name": "judge-key", "headers": {"Authorization": "token"}}, "retries": 1}
    good = Verifier()
    echo = EchoingVerifier()
    try:
        r = router({"url": good.url, **remote}, environ=env)
        score(r, samples(3))
        assert good.requests[-1]["headers"]["Authorization"] == f"Bearer {SECRET}"
        bad = router({"url": echo.url, **remote}, environ=env)
        with pytest.raises(RewardError) as err:
            bad.probe()
        with pytest.raises(RewardError) as err2:
            score(bad, samples(2))
        assert "bad token" in str(err.value) and "bad token" in str(err2.value)  # the server's words, scrubbed
        for text in (str(err.value), str(err2.value), repr(bad), repr(bad.default.remote), caplog.text):
            assert SECRET not in text
    finally:
        good.close()
        echo.close()


def test_routes_by_data_source(verifier):
    spec = RewardSpec.model_validate({"function": "digit-sum", "bySource": {
        "remote-src": {"remote": {"url": verifier.url}}, "local-src": {"function": "target-token"}}})
    r = RewardRouter(spec, environ={})
    batch = (["p"] * 4, ["xxxx", "xxyy", "7", "xx"], ["x", "x", "7", "x"],
             ["remote-src", "local-src", "other", "remote-src"], [{"max_response_length": 4}] * 4)
    out = score(r, batch)
    assert out.scores == [1.0, 0.5, 1.0, 0.5]
    assert {k: v.samples for k, v in out.routes.items()} == {"remote-src": 2, "local-src": 1, DEFAULT_ROUTE: 1}
    assert verifier.batch_sizes == [2]
    r.close()


# ---------------------------------------------------------------- spec validation and the operator's env


def quick_spec(reward: dict, **algorithm) -> dict:
    return {"device": "cpu", "gpusPerNode": 1, "model": {"path": "builtin://tiny-qwen2"},
            "data": {"synthetic": {"task": "target-token"}}, "reward": reward, "algorithm": algorithm}


@pytest.mark.parametrize(("reward", "algorithm", "path", "words"), [
    ({"remote": {"url": "http://user:hunter2@judge:8000"}}, {}, "spec.reward.remote.url", "headersSecretRef"),
    ({"remote": {"url": "judge:8000"}}, {}, "spec.reward.remote.url", "http://"),
    ({"remote": {"url": "http://j", "protocol": "openai-chat"}}, {}, "spec.reward.remote.judge", "needs a judge"),
    ({"remote": {"url": "http://j", "judge": {"model": "m", "promptTemplate": "t"}}}, {}, "spec.reward.remote.judge",
     "only used by protocol openai-chat"),
    ({"bySource": {"gsm8k": {}}}, {}, "spec.reward.bySource.gsm8k", "exactly one of function"),
    ({"remote": {"url": "http://j", "onFailure": "drop-group"}}, {"dynamicSampling": True},
     "spec.reward.remote.onFailure", "dynamicSampling"),
    ({"remote": {"url": "http://j", "concurrency": 0}}, {}, "spec.reward.remote.concurrency", ""),
])
def test_validation_names_the_field(reward, algorithm, path, words):
    with pytest.raises(RLJobValidationError) as err:
        parse_spec(quick_spec(reward, **algorithm))
    found = [e for e in err.value.errors if e.path == path]
    assert found and words in found[0].message, err.value.errors
    assert "hunter2" not in str(err.value)


def test_operator_injects_header_secrets_as_env_references():
    from rljob_api.models import secret_header_env
    from rljob_operator.builders import reward_header_env

    ref = {"name": "judge-key", "headers": {"Authorization": "token", "X-Org": "org"}}
    spec = parse_spec(quick_spec({"remote": {"url": "http://j", "headersSecretRef": ref},
                                  "bySource": {"b": {"remote": {"url": "http://k", "headersSecretRef": ref}}}}))
    env = reward_header_env(spec)
    assert env == [
        {"name": secret_header_env("judge-key", "token"),
         "valueFrom": {"secretKeyRef": {"name": "judge-key", "key": "token"}}},
        {"name": secret_header_env("judge-key", "org"), "valueFrom": {"secretKeyRef": {"name": "judge-key", "key": "org"}}},
    ]  # one entry per Secret key, shared by the routes that use it
    assert secret_header_env("a-b", "c") != secret_header_env("a_b", "c")


# ---------------------------------------------------------------- pass@k


@pytest.mark.parametrize(("n", "c", "k"), [(1, 0, 1), (1, 1, 1), (5, 2, 1), (5, 2, 3), (8, 3, 2), (8, 3, 6),
                                           (16, 1, 16), (64, 7, 8), (10, 0, 10)])
def test_pass_at_k_is_the_unbiased_estimator(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_pass_at_k_metrics_per_source():
    # prompt a: 2 of 4 correct; prompt b: none; prompt c (source t): all
    scores = [1, 0, 1, 0.5] + [0, 0, 0, 0] + [1, 1, 1, 1]
    m = sample_metrics(scores, 4, ["s", "s", "t"])
    assert k_values(4) == [1, 2, 4] and k_values(6) == [1, 2, 4, 6] and k_values(1) == [1]
    assert m["val/s/pass@1"] == pytest.approx((0.5 + 0) / 2)
    assert m["val/s/pass@2"] == pytest.approx((1 - 1 / 6) / 2)  # 1 - C(2,2)/C(4,2) for prompt a
    assert m["val/s/pass@4"] == pytest.approx(0.5) and m["val/t/pass@4"] == 1.0
    assert m["val/s/mean@4"] == pytest.approx(2.5 / 8) and m["val/s/prompts"] == 2
    assert m["val/pass@1"] == pytest.approx((0.5 + 0 + 1) / 3) == m["val/accuracy"]


def test_the_readme_verifier_serves_the_protocol():
    """The ten-line verifier of the README, run as written (on a free port), passes the probe and scores."""
    import re
    import threading
    from http.server import HTTPServer

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.DOTALL) if "class Verifier(" in b]
    lines = code.strip().splitlines()
    assert len(lines) <= 13 and lines[-1] == 'HTTPServer(("0.0.0.0", 8000), Verifier).serve_forever()'
    namespace: dict = {}
    exec("\n".join(lines[:-1]), namespace)  # noqa: S102 - the README's own code
    httpd = HTTPServer(("127.0.0.1", 0), namespace["Verifier"])
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        r = router({"url": f"http://127.0.0.1:{httpd.server_address[1]}/"})
        r.probe()
        out = score(r, (["q", "q"], [" 4", "5"], ["4", "4"], ["s", "s"], [{}, {}]))
        assert out.scores == [1.0, 0.0]
    finally:
        httpd.shutdown()
        httpd.server_close()
