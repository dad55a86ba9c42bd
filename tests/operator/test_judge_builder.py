"""The operator-run judge of spec.reward.server: its Deployment and Service (pure builders), what `rljob
render` shows, and the worker side: an unset remote.url reaches the judge's Service and start-up waits
for it (against a real OpenAI-compatible server on 127.0.0.1)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import opschema
import pytest
import yaml
from rljob_api.models import RewardSpec, judge_url
from rljob_api.validation import parse_rljob
from rljob_operator import builders
from rljob_operator.judge_builder import build_judge_children
from rljob_operator.settings import OperatorSettings

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "qwen2.5-7b-grpo-judge.yaml"
UID = "5d0c1e9a-0000-4000-8000-000000000033"


def job(**spec_changes):
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"].update({"namespace": "team-a", "uid": UID})
    doc["spec"].update(spec_changes)
    return parse_rljob(doc)


def test_judge_deployment_and_service():
    deployment, service = build_judge_children(job(), OperatorSettings())
    name = "qwen2-5-7b-grpo-judge-judge"
    for child in (deployment, service):
        assert child["metadata"]["name"] == name and child["metadata"]["namespace"] == "team-a"
        (owner,) = child["metadata"]["ownerReferences"]  # deleted with the RLJob by the garbage collector
        assert (owner["kind"], owner["uid"], owner["controller"]) == ("RLJob", UID, True)
        assert opschema.builtin_errors(child) == []  # kubernetes-validate --strict
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["vllm", "serve"]
    assert container["args"][:3] == ["Qwen/Qwen2.5-7B-Instruct", "--served-model-name", "judge"]  # = judge.model
    assert container["args"][-4:] == ["--max-model-len", "8192", "--gpu-memory-utilization", "0.9"]
    assert container["resources"] == {"limits": {"nvidia.com/gpu": "1"}}
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8000}
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()  # the Service reaches the judge's pods only
    assert service["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": 8000, "protocol": "TCP"}]
    assert judge_url("qwen2-5-7b-grpo-judge", "team-a") == f"http://{name}.team-a.svc:8000"


def test_tensor_parallel_follows_gpus_and_suspend_scales_to_zero():
    doc = job()
    doc.spec.reward.server.gpus = 4
    (container,) = build_judge_children(doc, OperatorSettings())[0]["spec"]["template"]["spec"]["containers"]
    assert container["args"][container["args"].index("--tensor-parallel-size") + 1] == "4"
    assert build_judge_children(job(suspend=True), OperatorSettings())[0]["spec"]["replicas"] == 0


def test_children_include_the_judge_before_the_trainer_and_only_with_a_server():
    kinds = [c["kind"] for c in builders.build_children(job(), OperatorSettings())]
    assert kinds.index("Deployment") < kinds.index("PyTorchJob") and "Service" in kinds
    doc = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    assert "Deployment" not in [c["kind"] for c in builders.build_children(parse_rljob(doc), OperatorSettings())]


def test_rljob_render_shows_the_judge():
    out = subprocess.run([sys.executable, "-m", "rljob_cli.main", "render", str(EXAMPLE)], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    judge = [d for d in docs if d["metadata"]["name"] == "qwen2-5-7b-grpo-judge-judge"]
    assert sorted(d["kind"] for d in judge) == ["Deployment", "Service"]


@pytest.mark.parametrize(("reward", "path"), [
    ({"server": {"model": "m"}}, "spec.reward.server"),
    ({"remote": {"protocol": "openai-chat", "judge": {"model": "m", "promptTemplate": "t"}}}, "spec.reward.remote.url"),
    ({"function": "gsm8k", "bySource": {"x": {"remote": {"protocol": "http-json"}}}}, "spec.reward.bySource.x.remote.url"),
])
def test_server_and_url_rules(reward, path):
    from rljob_api.validation import RLJobValidationError

    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["reward"] = reward
    with pytest.raises(RLJobValidationError) as err:
        parse_rljob(doc)
    assert path in [e.path for e in err.value.errors], err.value.errors


def test_worker_reaches_and_waits_for_the_judge_service():
    """remote.url unset: the worker's router uses the judge's Service URL and, at start-up, waits for it to
    come up (readyTimeoutSeconds); a judge that never answers is one line naming spec.reward.server."""
    sys.path.insert(0, str(REPO / "tests" / "worker"))
    from reward_servers import Judge
    from rljob_worker.rewards import RewardError, RewardRouter

    reward = RewardSpec.model_validate({
        "remote": {"protocol": "openai-chat", "retries": 0, "judge": {"model": "judge", "promptTemplate": "{completion}"}},
        "server": {"model": "m", "readyTimeoutSeconds": 30}})
    server = Judge(lambda prompt: f"<score>{prompt}</score>", model="judge")
    try:
        server.outage(1.5)  # still loading its model
        router = RewardRouter(reward, environ={}, judge_url=server.url)
        router.probe()  # returns once the judge answers
        out = router.score(["q"], ["0.5"], [""], ["s"], [{}], timeout_s=10)
        assert out.scores == [0.5]
        router.close()
    finally:
        server.close()
    reward.server.ready_timeout_seconds = 1
    with pytest.raises(RewardError, match=r"^spec.reward.server: the judge at http://127.0.0.1:9 did not answer"):
        RewardRouter(reward, environ={}, judge_url="http://127.0.0.1:9").probe()


# ---------------------------------------------------------------------------- the judge's lifecycle (reconcile)

JUDGE_REWARD = {"remote": {"protocol": "openai-chat", "judge": {"model": "judge", "promptTemplate": "{completion}"}},
                "server": {"model": "Qwen/Qwen2.5-0.5B-Instruct"}}


def _judge_world(**spec_changes):
    """A stored quickstart RLJob with an operator-run judge, and what exists of it (the reconcile tests' helpers)."""
    import copy

    import test_reconcile as R

    body = R.stored(reward=JUDGE_REWARD, **spec_changes)
    deployment = copy.deepcopy(R.children_of(body)["Deployment"])
    return R, body, deployment


def _plan(R, body, deployment, *ptj_conds, suspend=None):
    from rljob_operator.reconcile import Observed, reconcile

    ptj = R.ptj_of(body, *ptj_conds, suspend=suspend)
    return reconcile(body, Observed(now=R.T1, pytorchjob=ptj, configmap=R.cm_of(body), judge=deployment), R.SETTINGS)


def test_a_new_job_creates_the_judge_and_says_it_is_missing_until_it_exists():
    from rljob_operator import conditions as c
    from rljob_operator.reconcile import Observed, reconcile

    R, body, _ = _judge_world()
    plan = reconcile(body, Observed(now=R.T0), R.SETTINGS)
    created = {x.body["kind"]: x.body for x in plan.create}
    assert created["Deployment"]["spec"]["replicas"] == 1 and "Service" in created
    assert R.cond(plan, c.JUDGE_READY)["reason"] == c.REASON_JUDGE_MISSING


def test_judge_ready_follows_the_deployments_available_replicas():
    from rljob_operator import conditions as c

    R, body, deployment = _judge_world()
    plan = _plan(R, body, deployment, ("Running", "PyTorchJobRunning"))
    starting = R.cond(plan, c.JUDGE_READY)
    assert (starting["status"], starting["reason"]) == ("False", c.REASON_JUDGE_STARTING)
    assert "/health" in starting["message"] and not plan.patch
    deployment["status"] = {"availableReplicas": 1, "readyReplicas": 1}
    plan = _plan(R, R.step(body, plan), deployment, ("Running", "PyTorchJobRunning"))
    assert (R.cond(plan, c.JUDGE_READY)["status"], R.cond(plan, c.JUDGE_READY)["reason"]) == ("True", c.REASON_JUDGE_READY)
    deployment["status"] = {"conditions": [{"type": "Progressing", "status": "False",
                                            "reason": "ProgressDeadlineExceeded",
                                            "message": 'ReplicaSet "x" has timed out progressing.'}]}
    plan = _plan(R, R.step(body, plan), deployment, ("Running", "PyTorchJobRunning"))
    stuck = R.cond(plan, c.JUDGE_READY)
    assert stuck["reason"] == c.REASON_JUDGE_STUCK and "timed out progressing" in stuck["message"]


@pytest.mark.parametrize(("spec_changes", "ptj_conds", "want_replicas", "word"), [
    ({"suspend": True}, (), 0, "suspended"),
    ({}, (("Succeeded", "PyTorchJobSucceeded"),), 0, "finished"),
    ({}, (("Failed", "PyTorchJobFailed"),), 0, "finished"),
])
def test_a_suspended_or_finished_job_scales_the_judge_to_zero(spec_changes, ptj_conds, want_replicas, word):
    from rljob_operator import conditions as c

    R, body, deployment = _judge_world(**spec_changes)
    deployment["spec"]["replicas"] = 1
    deployment["status"] = {"availableReplicas": 1}
    plan = _plan(R, body, deployment, *ptj_conds, suspend=spec_changes.get("suspend"))
    (patch,) = [p for p in plan.patch if p.ref.kind == "Deployment"]
    assert patch.body == {"spec": {"replicas": want_replicas}}
    down = R.cond(plan, c.JUDGE_READY)
    assert down["reason"] == c.REASON_JUDGE_SCALED_DOWN and word in down["message"]


def test_resuming_scales_the_judge_back_up_and_a_foreign_deployment_is_left_alone():
    from rljob_operator import conditions as c

    R, body, deployment = _judge_world()
    deployment["spec"]["replicas"] = 0  # scaled down by an earlier suspend
    plan = _plan(R, body, deployment, ("Running", "PyTorchJobRunning"))
    assert [p.body for p in plan.patch if p.ref.kind == "Deployment"] == [{"spec": {"replicas": 1}}]
    assert R.cond(plan, c.JUDGE_READY)["reason"] == c.REASON_JUDGE_STARTING
    deployment["metadata"]["ownerReferences"] = []  # someone else's Deployment with the judge's name
    plan = _plan(R, body, deployment, ("Running", "PyTorchJobRunning"))
    assert not [p for p in plan.patch if p.ref.kind == "Deployment"]
    assert R.cond(plan, c.JUDGE_READY)["reason"] == c.REASON_JUDGE_MISSING
