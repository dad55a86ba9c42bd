"""A separate rollout pool (spec.rollout.placement: separate), below the trainer: where its processes sit in
the torchrun world, the rollout link's messages (sent both ways before either side receives, as the actor
leader and the rollout leader do when the pool generates ahead), and the weight push on real gloo processes:
what the rollout ranks install is bit-equal to what the trainer sent, across buckets and mixed dtypes, a newer
version replaces an untaken one, and a partial push merges into it."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from rljob_api.validation import parse_spec
from rljob_worker.rollout.weight_push import fingerprint, pack_bucket, unpack_bucket
from rljob_worker.runtime.distributed import DistEnv
from rljob_worker.runtime.pools import ACTOR, ROLLOUT, PoolLayout, rollout_group_ranks

sys.path.insert(0, str(Path(__file__).parent))
import megatron_helpers as H


def separate_spec(nnodes: int, gpus: int, rollout_gpus: int):
    return parse_spec({"nnodes": nnodes, "gpusPerNode": gpus, "model": {"path": "builtin://tiny-qwen2"},
                       "data": {"synthetic": {"task": "target-token"}},
                       "rollout": {"placement": "separate", "gpus": rollout_gpus, "mode": "async"},
                       "training": {"trainBatchSizePerNode": 6, "ppoMiniBatchSizePerNode": 6}})


def test_the_rollout_pool_takes_the_last_local_ranks_of_every_node():
    layout = PoolLayout.from_spec(separate_spec(2, 4, 1))
    assert (layout.actor_per_node, layout.critic_per_node, layout.rollout_per_node) == (3, 0, 1)
    assert layout.global_ranks(ACTOR) == [0, 1, 2, 4, 5, 6] and layout.global_ranks(ROLLOUT) == [3, 7]
    assert layout.rollout_leader == 3 and layout.placement == "spec.rollout.placement: separate"
    envs = {g: layout.pool_env(DistEnv(nnodes=2, node_rank=g // 4, nproc_per_node=4, local_rank=g % 4))
            for g in range(8)}
    assert [(envs[g].rank, envs[g].world_size) for g in (3, 7)] == [(0, 2), (1, 2)]
    assert [(envs[g].rank, envs[g].world_size) for g in (0, 4, 6)] == [(0, 6), (3, 6), (5, 6)]
    # the link's group: the actor pool first (the actor leader is its rank 0), then the rollout pool
    assert rollout_group_ranks(layout) == [0, 1, 2, 4, 5, 6, 3, 7]


def test_a_bucket_round_trips_bit_for_bit_across_dtypes():
    torch.manual_seed(0)
    named = [("a", torch.randn(3, 5, dtype=torch.bfloat16)), ("b", torch.randn(7)),
             ("c", torch.randint(-9, 9, (2, 2), dtype=torch.int64)), ("d", torch.tensor([float("nan"), -0.0]))]
    meta, flat = pack_bucket(named)
    assert flat.dtype == torch.uint8 and flat.numel() == sum(-(-t.numel() * t.element_size() // 16) * 16 for _, t in named)
    back = unpack_bucket(meta, flat.clone())
    for (name, t), (name2, t2) in zip(named, back):  # bytes, so NaN and -0.0 survive too
        assert name == name2 and t.dtype == t2.dtype and t.shape == t2.shape
        assert torch.equal(t.view(-1).view(torch.uint8), t2.reshape(-1).view(torch.uint8))
    assert fingerprint(back) == fingerprint(named) == fingerprint(reversed(named))
    changed = [(n, t.clone()) for n, t in named]
    changed[1][1][3] = torch.nextafter(changed[1][1][3], torch.tensor(1e9))  # one ulp
    assert fingerprint(changed) != fingerprint(named)


def weights(version: int) -> dict[str, torch.Tensor]:
    """A model's worth of tensors for `version` (mixed dtypes, some larger than a bucket)."""
    g = torch.Generator().manual_seed(version)
    return {"embed": torch.randn(64, 16, generator=g).to(torch.bfloat16), "layer.0.w": torch.randn(40, 40, generator=g),
            "layer.1.w": torch.randn(40, 40, generator=g), "norm": torch.randn(16, generator=g).to(torch.bfloat16),
            "step": torch.tensor([version], dtype=torch.int64)}


class _RecordingGroup:
    """A process group that notes when each broadcast is posted (time.time()), then posts it."""

    def __init__(self, group):
        self.group, self.posted = group, []

    def broadcast(self, tensors, opts):
        self.posted.append(time.time())
        return self.group.broadcast(tensors, opts)


def _member(local_rank: int, port: int, out_dir: str) -> None:
    """1 actor process + 2 rollout processes. The actor leader and the rollout leader both send before either
    receives (the link must not deadlock); then versions 1 (full), 2 (full) and 3 (partial: layer.1.w only) are
    pushed before the rollout leader takes any, in buckets of 4 KiB; the rollout ranks install what it takes.
    The actor leader pushes only after a pause, noting when it started; the rollout leader notes when its
    receiving thread first posted a broadcast on the tensors group."""
    import dataclasses

    import torch.distributed as dist
    from rljob_worker.rollout.rollout_pool import _broadcast_tensors
    from rljob_worker.rollout.weight_push import WeightReceiver, push_weights, stop_receivers
    from rljob_worker.runtime.pools import init_pools

    env = DistEnv(nnodes=1, node_rank=0, nproc_per_node=3, local_rank=local_rank, master_port=port)
    layout = PoolLayout(1, 1, rollout_per_node=2)
    pools = init_pools(env, layout, backend="gloo", timeout_s=60)
    cpu, out = torch.device("cpu"), {"role": pools.role}
    leader = rollout_group_ranks(layout).index(layout.rollout_leader)
    if env.rank == 0:
        sends = [pools.rollout_link.send_object({"request": i}, leader) for i in range(3)]
        out["replies"] = [pools.rollout_link.recv_object(leader)["reply"] for _ in range(3)]
        for s in sends:
            s.wait()
        sent = {}
        time.sleep(1.0)  # the receiving thread is waiting by now
        out["push_started"] = time.time()
        for version in (1, 2):
            sent = weights(version)
            push_weights(pools.weights_link, iter(sent.items()), version=version, device=cpu, check=True,
                         bucket_bytes=4096)
        push_weights(pools.weights_link, iter([("layer.1.w", weights(3)["layer.1.w"])]), version=3, device=cpu,
                     partial=True, check=True, bucket_bytes=4096)
        stop_receivers(pools.weights_link)
    elif pools.is_rollout:
        receiver = None
        if dist.get_rank() == 0:  # the rollout leader
            recording = _RecordingGroup(pools.weights_link.tensors)
            receiver = WeightReceiver(dataclasses.replace(pools.weights_link, tensors=recording), cpu)
            receiver.start()
            sends = [pools.rollout_link.send_object({"reply": i * 10}, 0) for i in range(3)]
            out["requests"] = [pools.rollout_link.recv_object(0)["request"] for _ in range(3)]
            for s in sends:
                s.wait()
            out["newest"] = receiver.wait_for(3, timeout_s=60)
            version, tensors, partial, digest = receiver.take()
            out["taken"] = [version, partial, digest is None, receiver.take() is None]
            receiver.join(timeout=60)
            out["first_tensor_post"] = recording.posted[0]
        header = [None if receiver is None else version]
        dist.broadcast_object_list(header, src=0)
        installed = _broadcast_tensors(tensors if receiver is not None else None, cpu)
        want = {**weights(2), "layer.1.w": weights(3)["layer.1.w"]}
        out["version"] = header[0]
        out["bit_equal"] = sorted(installed) == sorted(want) and all(
            installed[n].dtype == want[n].dtype and torch.equal(installed[n].view(-1).view(torch.uint8),
                                                                 want[n].reshape(-1).view(torch.uint8))
            for n in want)
    Path(out_dir, f"{env.rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def test_weights_pushed_to_the_rollout_pool_arrive_bit_equal_and_the_newest_wins(tmp_path):
    mp.start_processes(_member, args=(H.free_port(), str(tmp_path)), nprocs=3, start_method="spawn")
    got = {g: json.loads((tmp_path / f"{g}.json").read_text()) for g in range(3)}
    assert got[0]["role"] == ACTOR and got[0]["replies"] == [0, 10, 20]
    # between pushes the receiving thread waits on the header group (CPU): no collective is left waiting for the
    # trainer on the tensors group, which on a GPU holds up every synchronising call of the rollout process
    assert got[1]["first_tensor_post"] >= got[0]["push_started"]
    assert got[1]["requests"] == [0, 1, 2]
    # three versions arrived before any was taken: one slot, version 3 merged over version 2 (a partial push
    # carries no whole-model fingerprint)
    assert got[1]["newest"] == 3 and got[1]["taken"] == [3, False, True, True]
    assert all(got[g]["role"] == ROLLOUT and got[g]["version"] == 3 and got[g]["bit_equal"] for g in (1, 2))


@pytest.mark.parametrize("bucket_bytes", [64, 1 << 20])
def test_bucket_size_does_not_change_what_arrives(bucket_bytes):
    from rljob_worker.rollout.weight_sync import bucket_named_tensors

    named = list(weights(5).items())
    rebuilt = {}
    for bucket in bucket_named_tensors(iter(named), bucket_bytes):
        meta, flat = pack_bucket(bucket)
        rebuilt.update(unpack_bucket(meta, flat))
    assert fingerprint(rebuilt.items()) == fingerprint(named)


# ----------------------------------------------------------------------------- whole jobs through `rljob run`

def pool_job(name: str, mode: str, max_staleness: int = 2, steps: int = 20) -> dict:
    from test_parallel_training import job

    doc = job(name, gpusPerNode=2, **{"training.totalTrainingSteps": steps})  # 1 trainer + 1 rollout process
    doc["spec"]["rollout"].update(placement="separate", gpus=1, mode=mode, maxStaleness=max_staleness)
    return doc


def test_routing_replay_reaches_the_trainer_from_a_separate_pool(tmp_path):
    """An MoE model (builtin://tiny-qwen3-moe) with algorithm.routingReplay, its rollout in a pool of its own (sync):
    the pool's engine records each token's experts, its replies carry them, the actor replays them, and the
    trainer's log-probs equal the pool's (the same weights, fp32: no token off by 0.1) while the task is learned."""
    from test_ppo_split import by_step, finish, launch

    doc = pool_job("pool-moe-replay", "sync")
    doc["spec"]["model"]["path"] = "builtin://tiny-qwen3-moe"
    doc["spec"]["algorithm"]["routingReplay"] = True
    proc, work = launch(doc, tmp_path)
    out = finish(proc, work)
    steps = by_step(work)
    assert sorted(steps) == list(range(1, 21)), out[-3000:]
    assert all(s["rollout/logprob_mismatch_frac"] == 0 for s in steps.values())
    first, last = (sum(steps[k]["reward/mean"] for k in ks) / 4 for ks in (range(1, 5), range(17, 21)))
    assert first < 0.3 and last > 0.6, (first, last)


def staleness_bound(mode: str, max_staleness: int) -> int:
    return {"sync": 0, "one-step": 1, "async": max_staleness}[mode]


@pytest.mark.parametrize("mode", ["sync", "one-step", "async"])
def test_a_separate_rollout_pool_learns_and_no_sample_is_older_than_the_mode_allows(tmp_path, monkeypatch, mode):
    """The quickstart with its rollout in a process of its own: every step's oldest sample (staleness_max, the
    max over each sample's version gap) is within the mode's bound and reaches it (the pool really generates
    ahead), nothing is dropped, the rollout's weights are checked bit-equal to the trainer's after every push
    (RLJOB_CHECK_WEIGHT_PUSH), and the target-token reward rises from ~0.1 as the colocated run's does."""
    from test_ppo_split import by_step, finish, launch

    monkeypatch.setenv("RLJOB_CHECK_WEIGHT_PUSH", "1")
    proc, work = launch(pool_job(f"pool-{mode}", mode), tmp_path)
    out = finish(proc, work)
    assert "1 pod(s) x 2 process(es)" in out, out[-2000:]
    steps = by_step(work)
    bound = staleness_bound(mode, 2)
    assert sorted(steps) == list(range(1, 21))
    assert all(s["rollout/staleness_max"] <= bound and s["rollout/dropped_stale_samples"] == 0 for s in steps.values())
    assert max(s["rollout/staleness_max"] for s in steps.values()) == bound
    assert all(steps[k].get("rollout/weights_verified") == 1.0 for k in range(bound + 2, 21)), \
        [steps[k].get("rollout/weights_verified") for k in steps]
    first = sum(steps[k]["reward/mean"] for k in range(1, 5)) / 4
    last = sum(steps[k]["reward/mean"] for k in range(17, 21)) / 4
    assert first < 0.3 and last > 0.6, (first, last)


@pytest.mark.parametrize("engine", ["hf", "static"])
def test_partial_rollouts_continue_responses_under_newer_weights_and_bound_the_oldest_token(tmp_path, monkeypatch,
                                                                                          engine):
    """rollout.partial with async: the pool loads each pushed version between chunks (hf: the chunked
    batch-at-a-time loop) or between runs of its refilling rows (static: later batches decode in the rows an
    earlier batch's tail leaves free), so responses of one batch carry tokens of several versions
    (rollout/partial_resumed_frac > 0 on some steps); staleness counts a response's oldest token and stays within
    maxStaleness; the run learns as the unchunked one does."""
    from test_ppo_split import by_step, finish, launch

    monkeypatch.setenv("RLJOB_CHECK_WEIGHT_PUSH", "1")
    monkeypatch.setenv("RLJOB_HF_STATIC", "force" if engine == "static" else "0")
    doc = pool_job(f"pool-partial-{engine}", "async")
    doc["spec"]["rollout"]["partial"] = True
    proc, work = launch(doc, tmp_path)
    out = finish(proc, work)
    assert ("refilling rows" in out) == (engine == "static"), out[-3000:]
    steps = by_step(work)
    resumed = [round(steps[k]["rollout/partial_resumed_frac"], 2) for k in sorted(steps)]
    print(f"\nshare of each step's responses continued under a newer version: {resumed}")
    assert all(s["rollout/staleness_max"] <= 2 and s["rollout/dropped_stale_samples"] == 0 for s in steps.values())
    assert max(resumed) > 0, resumed
    first = sum(steps[k]["reward/mean"] for k in range(1, 5)) / 4
    last = sum(steps[k]["reward/mean"] for k in range(17, 21)) / 4
    assert first < 0.3 and last > 0.6, (first, last)


@pytest.mark.parametrize("refilling", [False, True])
def test_a_killed_async_run_resumes_from_its_last_commit_with_the_staleness_bound_held(tmp_path, monkeypatch,
                                                                                       refilling):
    """SIGKILL mid-run (the batches generated ahead are lost with it, also the responses in a refilling session):
    `rljob run` again resumes from the last committed step, the rollout pool starts from the checkpoint's weights
    (the first resumed step is on-policy), and the rest of the run keeps the bound."""
    from test_ppo_split import by_step, finish, launch, wait_for_step

    monkeypatch.setenv("RLJOB_HF_STATIC", "force" if refilling else "0")
    doc = pool_job(f"pool-killed-{int(refilling)}", "async", steps=10)
    doc["spec"]["rollout"]["partial"] = refilling
    doc["spec"]["checkpoint"]["saveFreq"] = 4
    proc, work = launch(doc, tmp_path)
    wait_for_step(proc, work, 6)
    # step 4's commit lands in the background; under load it can trail the training by more than two steps, so the
    # kill waits for it (the premise: a commit exists to resume from), then the run is past it and mid-flight
    commit = tmp_path / "ckpt" / "default" / f"pool-killed-{int(refilling)}" / "step_000004" / "COMMIT"
    deadline = time.monotonic() + 120
    while not commit.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.kill()
    proc.communicate()
    assert commit.exists()
    proc, work = launch(doc, tmp_path)
    out = finish(proc, work)
    assert "resumed from step" in out, out[-3000:]
    steps = by_step(work)
    assert sorted(steps) == list(range(1, 11))
    resumed = [json.loads(line) for line in (work / "work" / "metrics.jsonl").read_text().splitlines()]
    first_after = next(r for r in resumed[6:] if r["step"] <= 6)  # the resumed run's first step
    assert first_after["rollout/staleness_max"] == 0, first_after
    assert all(s["rollout/staleness_max"] <= 2 for s in steps.values())


@pytest.mark.parametrize("engine", ["hf", "static"])
def test_two_nodes_two_trainer_ranks_and_two_rollout_replicas(tmp_path, monkeypatch, engine):
    """nnodes 2: the actor at DP2 (its second rank joins every weight export) and a rollout replica per node
    (the rollout leader hands each version to the other replica, and both sample a share of the prompts), with
    partial rollouts (the replicas load weights between chunks, or between runs of their refilling rows, in
    lockstep): the run finishes with every push checked on both replicas and the bound held."""
    from test_ppo_split import by_step, finish, launch

    monkeypatch.setenv("RLJOB_CHECK_WEIGHT_PUSH", "1")
    monkeypatch.setenv("RLJOB_HF_STATIC", "force" if engine == "static" else "0")
    doc = pool_job(f"pool-two-nodes-{engine}", "async", steps=6)
    doc["spec"]["nnodes"] = 2
    doc["spec"]["rollout"]["partial"] = True
    proc, work = launch(doc, tmp_path)
    out = finish(proc, work)
    assert "2 pod(s) x 2 process(es)" in out and ("refilling rows" in out) == (engine == "static"), out[-3000:]
    steps = by_step(work)
    assert sorted(steps) == list(range(1, 7)) and all(s["rollout/staleness_max"] <= 2 for s in steps.values())
    assert all(steps[k].get("rollout/weights_verified") == 1.0 for k in range(4, 7))
