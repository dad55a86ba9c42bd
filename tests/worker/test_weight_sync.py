"""Weight-sync helpers: bucketing a stream of named tensors, vLLM name handling, sync stats, rollout layout."""
from __future__ import annotations

import itertools

import pytest
import torch
from rljob_worker.rollout.weight_sync import (
    RolloutLayout,
    SyncStats,
    bucket_named_tensors,
    incomplete_fused,
    plan_rollout_layout,
    tensor_nbytes,
    to_vllm_names,
    vllm_param_name,
)


def stream_of(sizes: list[int], dtype=torch.float32, device="cpu"):
    """Named tensors of the given element counts: t0, t1, ..."""
    return [(f"t{i}", torch.zeros(n, dtype=dtype, device=device)) for i, n in enumerate(sizes)]


def names(buckets):
    return [[n for n, _ in b] for b in buckets]


def nbytes(bucket):
    return sum(tensor_nbytes(t) for _, t in bucket)


def test_tensor_nbytes_counts_dtype_width():
    assert tensor_nbytes(torch.zeros(3, 5, dtype=torch.float32)) == 60
    assert tensor_nbytes(torch.zeros(7, dtype=torch.bfloat16)) == 14
    assert tensor_nbytes(torch.zeros(0)) == 0


def test_buckets_are_greedy_bounded_and_ordered():
    # float32: 4 bytes per element; bucket of 40 bytes = 10 elements
    items = stream_of([3, 3, 3, 3, 5, 5, 2, 8])
    buckets = list(bucket_named_tensors(iter(items), bucket_bytes=40))
    assert names(buckets) == [["t0", "t1", "t2"], ["t3", "t4"], ["t5", "t6"], ["t7"]]
    assert all(nbytes(b) <= 40 for b in buckets)
    # greedy: a bucket is only closed when the next tensor would not fit
    for bucket, nxt in itertools.pairwise(buckets):
        assert nbytes(bucket) + tensor_nbytes(nxt[0][1]) > 40
    # order and identity preserved, exact byte accounting
    flat = [pair for b in buckets for pair in b]
    assert [n for n, _ in flat] == [n for n, _ in items]
    assert all(a is b for (_, a), (_, b) in zip(flat, items))
    assert sum(nbytes(b) for b in buckets) == sum(tensor_nbytes(t) for _, t in items) == 32 * 4


def test_oversize_tensor_goes_alone_and_flushes_the_partial_bucket():
    items = stream_of([2, 100, 2, 2, 50])
    buckets = list(bucket_named_tensors(items, bucket_bytes=40))
    assert names(buckets) == [["t0"], ["t1"], ["t2", "t3"], ["t4"]]
    assert nbytes(buckets[1]) == 400 and nbytes(buckets[3]) == 200


def test_exactly_full_bucket_is_handed_out_and_mixed_dtypes_count_bytes():
    items = [("a", torch.zeros(5, dtype=torch.float32)), ("b", torch.zeros(10, dtype=torch.bfloat16)),
             ("c", torch.zeros(20, dtype=torch.int8)), ("d", torch.zeros(1, dtype=torch.float64))]
    buckets = list(bucket_named_tensors(items, bucket_bytes=40))
    assert names(buckets) == [["a", "b"], ["c", "d"]]
    assert [nbytes(b) for b in buckets] == [40, 28]


def test_empty_stream_and_empty_tensors():
    assert list(bucket_named_tensors(iter([]), bucket_bytes=10)) == []
    buckets = list(bucket_named_tensors(stream_of([0, 0, 3]), bucket_bytes=8))
    assert names(buckets) == [["t0", "t1"], ["t2"]]


def test_bucket_size_must_be_positive():
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(bucket_named_tensors(stream_of([1]), bucket_bytes=0))


def test_stream_is_pulled_lazily():
    pulled = []

    def producer():
        for name, t in stream_of([5, 5, 5, 5]):
            pulled.append(name)
            yield name, t

    gen = bucket_named_tensors(producer(), bucket_bytes=40)
    first = next(gen)
    assert names([first]) == [["t0", "t1"]]
    assert pulled == ["t0", "t1"]  # a full bucket is handed out before the next tensor is produced
    assert names(list(gen)) == [["t2", "t3"]]


def test_to_vllm_names_drops_tied_head_and_rotary_buffers_only():
    stream = [("model.embed_tokens.weight", torch.zeros(1)),
              ("model.layers.0.self_attn.q_proj.weight", torch.zeros(1)),
              ("model.layers.0.self_attn.k_proj.weight", torch.zeros(1)),
              ("model.layers.0.self_attn.v_proj.bias", torch.zeros(1)),
              ("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(1)),
              ("model.layers.0.mlp.gate_proj.weight", torch.zeros(1)),
              ("lm_head.weight", torch.zeros(1))]
    tied = [n for n, _ in to_vllm_names(stream, tie_word_embeddings=True)]
    untied = [n for n, _ in to_vllm_names(stream, tie_word_embeddings=False)]
    kept = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.bias",
            "model.layers.0.mlp.gate_proj.weight"]
    assert tied == kept  # q/k/v stay separate: vLLM's load_weights fuses them itself
    assert untied == [*kept, "lm_head.weight"]


@pytest.mark.parametrize("hf, expected", [
    ("model.layers.3.self_attn.q_proj.weight", ("model.layers.3.self_attn.qkv_proj.weight", "q")),
    ("model.layers.3.self_attn.k_proj.bias", ("model.layers.3.self_attn.qkv_proj.bias", "k")),
    ("model.layers.3.self_attn.v_proj.weight", ("model.layers.3.self_attn.qkv_proj.weight", "v")),
    ("model.layers.0.mlp.gate_proj.weight", ("model.layers.0.mlp.gate_up_proj.weight", 0)),
    ("model.layers.0.mlp.up_proj.weight", ("model.layers.0.mlp.gate_up_proj.weight", 1)),
    ("model.layers.0.mlp.down_proj.weight", ("model.layers.0.mlp.down_proj.weight", None)),
    ("model.layers.0.self_attn.o_proj.weight", ("model.layers.0.self_attn.o_proj.weight", None)),
    ("model.norm.weight", ("model.norm.weight", None)),
])
def test_vllm_param_name(hf, expected):
    assert vllm_param_name(hf) == expected


def test_incomplete_fused_finds_lost_parts():
    full = [f"model.layers.{i}.{m}.weight" for i in range(2) for m in
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    assert incomplete_fused(full) == {}
    biases = [f"model.layers.0.self_attn.{p}_proj.bias" for p in "qkv"]
    assert incomplete_fused([*full, *biases]) == {}
    assert incomplete_fused([*full, *biases[:2]]) == {"model.layers.0.self_attn.qkv_proj.bias": ["v"]}
    lost = [n for n in full if n not in ("model.layers.1.mlp.up_proj.weight", "model.layers.0.self_attn.q_proj.weight")]
    assert incomplete_fused(lost) == {"model.layers.1.mlp.gate_up_proj.weight": [1],
                                      "model.layers.0.self_attn.qkv_proj.weight": ["q"]}


def test_sync_stats():
    stats = SyncStats()
    assert stats.gb_per_s == 0.0 and stats.s_per_gb == 0.0
    stats.add_bucket(stream_of([250_000_000], device="meta"), load_seconds=0.2)  # 1 GB, never allocated
    stats.add_bucket(stream_of([125_000_000, 125_000_000], device="meta"), load_seconds=0.3)
    stats.seconds = 1.0
    assert (stats.bytes, stats.tensors, stats.buckets) == (2_000_000_000, 3, 2)
    assert stats.gb == pytest.approx(2.0) and stats.gb_per_s == pytest.approx(2.0)
    assert stats.s_per_gb == pytest.approx(0.5) and stats.load_seconds == pytest.approx(0.5)
    m = stats.metrics()
    assert m == {"rollout/weight_sync_s": 1.0, "rollout/weight_sync_load_s": pytest.approx(0.5),
                 "rollout/weight_sync_gb": pytest.approx(2.0), "rollout/weight_sync_gbps": pytest.approx(2.0),
                 "rollout/weight_sync_s_per_gb": pytest.approx(0.5)}


def test_rollout_layout_groups_consecutive_ranks():
    layout = plan_rollout_layout(world_size=8, gpus_per_node=4, train_tp=4, rollout_tp=2)
    assert layout.replicas == 4
    assert [layout.group(r) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [layout.replica_of(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [layout.rollout_rank_of(r) for r in range(8)] == [0, 1] * 4
    # rollout TP larger than training TP works the same way (full tensors on every rank)
    wide = plan_rollout_layout(world_size=8, gpus_per_node=8, train_tp=2, rollout_tp=8)
    assert wide.replicas == 1 and wide.group(0) == list(range(8))


@pytest.mark.parametrize("num_prompts, replicas", [(10, 4), (8, 4), (3, 4), (0, 2), (64, 1)])
def test_prompt_slices_cover_every_prompt_once(num_prompts, replicas):
    layout = RolloutLayout(world_size=replicas * 2, train_tp=1, rollout_tp=2)
    slices = [layout.prompt_slice(num_prompts, r) for r in range(replicas)]
    covered = [i for s in slices for i in range(num_prompts)[s]]
    assert covered == list(range(num_prompts))
    sizes = [s.stop - s.start for s in slices]
    assert max(sizes) - min(sizes) <= 1


def test_rollout_layout_rejects_bad_tp_naming_the_setting():
    with pytest.raises(ValueError, match=r"spec\.rollout\.tensorModelParallelSize=3 must divide the GPUs per node \(8\)"):
        plan_rollout_layout(world_size=16, gpus_per_node=8, train_tp=1, rollout_tp=3)
    with pytest.raises(ValueError, match=r"tensorModelParallelSize=8 must divide the GPUs per node \(4\)"):
        plan_rollout_layout(world_size=8, gpus_per_node=4, train_tp=1, rollout_tp=8)
    with pytest.raises(ValueError, match="must be >= 1"):
        plan_rollout_layout(world_size=8, gpus_per_node=8, train_tp=1, rollout_tp=0)
    with pytest.raises(ValueError, match="training tensor parallel size 3"):
        plan_rollout_layout(world_size=8, gpus_per_node=8, train_tp=3, rollout_tp=2)
