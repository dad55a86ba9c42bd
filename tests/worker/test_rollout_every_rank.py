"""Every-rank rollout, the pure parts: prompt shares, seeds, the gather into batch order, the layout rules."""
from __future__ import annotations

import pytest
from rljob_worker.rollout.base import RolloutOutput
from rljob_worker.rollout.every_rank import (
    RolloutLayoutError,
    check_hf_engine_layout,
    gather_in_batch_order,
    group_owner,
    prompt_shares,
    replica_seed,
    samples_on_every_rank,
    smallest_fitting_tp,
)

GIB = 2**30


def test_prompt_shares_by_hand():
    assert prompt_shares(10, 4) == [slice(0, 3), slice(3, 6), slice(6, 8), slice(8, 10)]
    assert prompt_shares(32, 4) == [slice(0, 8), slice(8, 16), slice(16, 24), slice(24, 32)]
    assert prompt_shares(2, 4) == [slice(0, 1), slice(1, 2), slice(2, 2), slice(2, 2)]
    assert prompt_shares(7, 1) == [slice(0, 7)]


@pytest.mark.parametrize("replicas", range(1, 9))
@pytest.mark.parametrize("num_prompts", [0, 1, 3, 8, 13, 32, 64])
def test_prompt_shares_are_disjoint_cover_the_batch_and_differ_by_at_most_one(num_prompts, replicas):
    shares = prompt_shares(num_prompts, replicas)
    assert len(shares) == replicas
    owned = [i for s in shares for i in range(s.start, s.stop)]
    assert owned == list(range(num_prompts))  # each prompt once, in order
    sizes = [s.stop - s.start for s in shares]
    assert max(sizes) - min(sizes) <= 1


def test_prompt_shares_reject_no_replicas():
    with pytest.raises(ValueError, match="replicas"):
        prompt_shares(4, 0)


def test_replica_seeds_by_hand_and_distinct_per_share():
    assert replica_seed(100, slice(3, 6), 8) == 124
    assert replica_seed(None, slice(3, 6), 8) is None
    shares = prompt_shares(32, 4)
    seeds = [replica_seed(7, s, 8) for s in shares]
    assert seeds == [7, 71, 135, 199]
    assert replica_seed(7, shares[2], 8) == seeds[2]  # same share, same seed


def _piece(share: slice, n: int) -> RolloutOutput:
    """What a replica returns: response ids that say which (prompt, sample) they are."""
    ids = [[p, j] for p in range(share.start, share.stop) for j in range(n)]
    return RolloutOutput(ids, [[-0.5, -0.25] for _ in ids], [True] * len(ids))


@pytest.mark.parametrize(("num_prompts", "replicas", "n"), [(10, 4, 3), (32, 4, 8), (2, 4, 2), (5, 1, 4)])
def test_gather_puts_sample_j_of_prompt_i_at_row_i_n_plus_j(num_prompts, replicas, n):
    shares = prompt_shares(num_prompts, replicas)
    pieces = [_piece(s, n) if s.stop > s.start else None for s in shares]
    out = gather_in_batch_order(pieces, shares, n)
    assert out.response_ids == [[i, j] for i in range(num_prompts) for j in range(n)]
    assert len(out.response_logprobs) == len(out.finished) == num_prompts * n
    # a group is never split: all n rows of prompt i come from the one replica that owns prompt i
    for i in range(num_prompts):
        owner = group_owner(i, shares)
        assert all(row in pieces[owner].response_ids for row in out.response_ids[i * n:(i + 1) * n])


def test_gather_refuses_a_piece_that_lost_or_duplicated_a_group():
    shares = prompt_shares(6, 2)
    short = _piece(slice(0, 2), 2)  # replica 0 owns prompts 0..2 but returned two prompts' samples
    with pytest.raises(ValueError, match=r"replica 0 returned 4 responses for prompts 0\.\.2 x 2 samples; expected 6"):
        gather_in_batch_order([short, _piece(shares[1], 2)], shares, 2)
    with pytest.raises(ValueError, match="2 rollout pieces for 3 replicas"):
        gather_in_batch_order([None, None], prompt_shares(6, 3), 2)
    with pytest.raises(ValueError, match="replica 1's share starts at prompt 4"):
        gather_in_batch_order([_piece(slice(0, 3), 1), _piece(slice(4, 6), 1)], [slice(0, 3), slice(4, 6)], 1)


def test_hf_engine_refuses_rollout_tensor_parallelism():
    with pytest.raises(RolloutLayoutError, match=r"spec\.rollout\.tensorModelParallelSize=2 needs spec\.rollout\.engine: vllm"):
        check_hf_engine_layout(rollout_tp=2)
    check_hf_engine_layout(rollout_tp=1)  # CPU: nothing else to check


def test_hf_engine_serves_a_7b_model_on_an_80gb_card():
    weights = 7_615_616_512 * 2  # Qwen2.5-7B shape in bf16: 14.2 GiB
    check_hf_engine_layout(rollout_tp=1, weight_bytes=weights, card_bytes=80 * GIB, gpu_memory_utilization=0.6,
                           gpus_per_node=4)


def test_hf_engine_refuses_a_model_that_does_not_fit_one_card_and_names_the_fix():
    weights = 70_553_706_496 * 2  # a 70B model in bf16: 131.4 GiB
    with pytest.raises(RolloutLayoutError) as err:
        check_hf_engine_layout(rollout_tp=1, weight_bytes=weights, card_bytes=80 * GIB, gpu_memory_utilization=0.6,
                               gpus_per_node=8)
    message = str(err.value)
    assert "131.4 GiB in bfloat16" in message
    assert "spec.rollout.gpuMemoryUtilization=0.6 x 80.0 GiB per GPU = 48.0 GiB" in message
    # 131.4 / 2 = 65.7 > 48 and 3 does not divide 8, so the first shard that fits is a quarter (32.9 GiB)
    assert "use spec.rollout.engine: vllm with spec.rollout.tensorModelParallelSize: 4" in message
    with pytest.raises(RolloutLayoutError, match="no size up to gpusPerNode=1"):
        check_hf_engine_layout(rollout_tp=1, weight_bytes=weights, card_bytes=80 * GIB, gpus_per_node=1)


def test_smallest_fitting_tp_by_hand():
    assert smallest_fitting_tp(100, 100, 8) == 1
    assert smallest_fitting_tp(101, 100, 8) == 2
    assert smallest_fitting_tp(250, 100, 6) == 3
    assert smallest_fitting_tp(250, 100, 8) == 4
    assert smallest_fitting_tp(1000, 100, 8) is None


@pytest.mark.parametrize(("ranks", "vllm", "gpu", "world", "expected"), [
    ("auto", False, True, 4, True),  # hf on GPUs: every rank samples
    ("auto", False, False, 4, False),  # hf on CPU: rank 0 (layout-independent samples)
    ("every-rank", False, False, 2, True),
    ("rank0", False, True, 4, False),
    ("every-rank", False, True, 1, False),  # one process samples everything anyway
    ("auto", True, True, 4, True),  # vLLM: always every rollout-TP group
    ("every-rank", True, True, 2, True),
])
def test_samples_on_every_rank(ranks, vllm, gpu, world, expected):
    assert samples_on_every_rank(ranks, engine_is_vllm=vllm, on_gpu=gpu, world_size=world) is expected


def test_vllm_refuses_rank0_rollout():
    with pytest.raises(RolloutLayoutError, match=r"spec\.rollout\.ranks: rank0 is for the hf engines"):
        samples_on_every_rank("rank0", engine_is_vllm=True, on_gpu=True, world_size=4)
