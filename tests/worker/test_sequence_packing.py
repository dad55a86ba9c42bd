"""Concatenated micro-batches (megatron/packing.py ``pack_concatenated``): the rows' real tokens in one
sequence, attention and RoPE per row's segment. Every token must see what it sees in the rows layout, so
log-probs, entropy, logits, values and gradients equal the rows layout's within the fp32 reordering bounds
(tolerances.py); the bookkeeping that takes values back to the ``(B, T)`` grid is checked exactly."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import megatron_helpers as H
from rljob_worker.megatron import packing
from rljob_worker.megatron.actor import MegatronActor, OptimConfig, ParallelConfig, valid_logprob_mask

_IDS, _MASK = H.varied_batch()  # 15, 7, 11 and 13 real tokens; left, right and both-sided padding
# the fp32 model tests run the CPU path (gloo, torch AdamW); the GPU's own tests are marked gpu
cpu_path = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU (gloo) path; GPU tests below")


def test_pack_concatenated_lays_rows_end_to_end_with_their_own_positions():
    ids = torch.arange(1, 13).reshape(3, 4)
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])  # a hole-free row, an empty one, a full one
    got_ids, positions, dest, lengths, segments = packing.pack_concatenated(ids, mask, multiple=4)
    assert got_ids.tolist() == [[2, 3, 9, 10, 11, 12, 0, 0]]  # 6 real tokens rounded up to 8
    assert positions.tolist() == [[0, 1, 0, 1, 2, 3, 0, 1]]
    assert dest.tolist() == [1, 2, 8, 9, 10, 11, 12, 12]  # flat (row * 4 + col); padding -> 12 (= B * T)
    assert lengths.tolist() == [2, 0, 4]
    assert segments.lengths == (2, 4, 2) and segments.cu_seqlens.tolist() == [0, 2, 6, 8]  # no empty segment
    assert segments.cu_seqlens.dtype == torch.int32 and segments.max_len == 4


def test_unpack_returns_values_to_their_columns_and_drops_each_rows_first_token():
    ids = torch.arange(1, 13).reshape(3, 4)
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    got_ids, positions, dest, _, _ = packing.pack_concatenated(ids, mask, multiple=4)
    values = got_ids.float().requires_grad_()  # each token's value: its own id
    grid = packing.unpack_concatenated(values, dest, positions, 3, 4)
    assert grid.tolist() == [[0, 0, 3, 0], [0, 0, 0, 0], [0, 10, 11, 12]]
    raw = packing.unpack_concatenated(values[..., None].expand(1, 8, 2), dest, positions, 3, 4, drop_first=False)
    assert raw[..., 1].tolist() == (ids * mask).tolist()
    grid.sum().backward()  # a gradient reaches exactly the tokens that were kept
    assert values.grad.tolist() == [[0, 1, 0, 1, 1, 1, 0, 0]]


def test_rows_and_concatenated_unpack_agree_on_the_same_micro_batch():
    order_ids, order, lengths = packing.pack(_IDS, _MASK)
    cat_ids, positions, dest, _, segments = packing.pack_concatenated(_IDS, _MASK)
    rows = packing.PackedMicroBatch(order_ids, None, order, lengths, 15, {})
    cat = packing.PackedMicroBatch(cat_ids, positions, None, lengths, 15, {}, segments=segments, dest=dest)
    assert cat.unpack(cat_ids.float()).tolist() == rows.unpack(order_ids.float()).tolist()
    assert cat.rows == rows.rows == 4


def _skip_without_compile() -> None:
    """The compiled RoPE runs for real on CPU (inductor's C++ backend): skip, saying why, without a compiler."""
    from test_fused_elementwise import _compile_unavailable

    if reason := _compile_unavailable():
        pytest.skip(reason)


def test_the_setting_is_auto_on_or_off_and_a_bad_value_is_named(monkeypatch):
    monkeypatch.delenv(packing.CONCATENATION_VAR, raising=False)
    assert packing.concatenation_wanted(on_gpu=True, dtype=torch.bfloat16)
    assert not packing.concatenation_wanted(on_gpu=True, dtype=torch.float32)
    assert not packing.concatenation_wanted(on_gpu=False, dtype=torch.bfloat16)
    monkeypatch.setenv(packing.CONCATENATION_VAR, "on")
    assert packing.concatenation_wanted(on_gpu=False, dtype=torch.float32)
    monkeypatch.setenv(packing.CONCATENATION_VAR, "off")
    assert not packing.concatenation_wanted(on_gpu=True, dtype=torch.bfloat16)
    monkeypatch.setenv(packing.CONCATENATION_VAR, "yes")
    with pytest.raises(ValueError, match=r"RLJOB_SEQUENCE_PACKING='yes': use auto .*, on or off"):
        packing.concatenation_wanted(on_gpu=True, dtype=torch.bfloat16)


def test_compiled_thd_rope_equals_megatrons_per_segment_rope():
    """The compiled kernel megatron's ``apply_rope_fusion`` finds for concatenated sequences rotates each
    token by its position in its own segment, as megatron's per-segment reference does. Both are the same
    elementwise fp32 expression (one compiled, one eager): a few ulps of the rotated values."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd
    from rljob_worker.megatron.fused_elementwise import fused_apply_rotary_pos_emb_thd, segment_positions

    _skip_without_compile()

    class OneRank:
        def size(self):
            return 1

        def rank(self):
            return 0

    cu = torch.tensor([0, 5, 6, 13, 16], dtype=torch.int32)
    assert segment_positions(cu, 16).tolist() == [0, 1, 2, 3, 4, 0, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2]
    t = torch.randn(16, 3, 8, generator=torch.Generator().manual_seed(0))
    inv = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    freqs = torch.outer(torch.arange(7).float(), inv)
    freqs = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]  # (max_len, 1, 1, d): megatron's layout
    want = _apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=OneRank())
    got = fused_apply_rotary_pos_emb_thd(t, cu, freqs)
    assert got.shape == t.shape
    torch.testing.assert_close(got, want, rtol=0, atol=8 * torch.finfo(torch.float32).eps * float(t.abs().max()))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return H.make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("hf") / "qwen2")


@pytest.fixture(scope="module")
def tol(hf_dir):
    """The two layouts differ only in the order of the model's sums (matmuls over (1, 22) vs (2, 15) tokens;
    the attention runs the same row either way): the fp32 reordering bounds of the model on this batch."""
    return H.reorder_bounds(hf_dir, _IDS, _MASK)


def _actor(hf_dir, concatenated: bool, fused_elementwise: bool = False, recompute: str = "none") -> MegatronActor:
    from rljob_worker.megatron.engine_config import RecomputeConfig

    actor = MegatronActor.from_hf(hf_dir, ParallelConfig(), OptimConfig(lr=1e-3), seed=1,
                                  fused_elementwise=fused_elementwise, recompute=RecomputeConfig(recompute))
    actor.concatenate_sequences = concatenated
    return actor


def _tokens_seen(actor) -> tuple[list, dict]:
    """(the [s, b] shape of every micro-batch the first layer's norm sees, log-probs + entropy of the batch)."""
    seen = []
    norm = actor.core.decoder.layers[0].input_layernorm
    hook = norm.register_forward_hook(lambda mod, args, out: seen.append(tuple(args[0].shape[:2])))
    out = actor.compute_logprobs({"input_ids": _IDS, "attention_mask": _MASK}, micro_batch_size=2, with_entropy=True)
    hook.remove()
    return seen, out


@cpu_path
@pytest.mark.parametrize("fused_elementwise", [False, True], ids=["eager", "compiled-rope"])
def test_concatenated_log_probs_entropy_and_logits_equal_the_rows_layout(hf_dir, tol, fused_elementwise):
    if fused_elementwise:
        _skip_without_compile()
    rows_seen, rows = _tokens_seen(_actor(hf_dir, False, fused_elementwise))
    actor = _actor(hf_dir, True, fused_elementwise)
    cat_seen, cat = _tokens_seen(actor)
    assert rows_seen == [(15, 2), (13, 2)]  # rows cut to the longest: 30 and 26 token slots
    assert cat_seen == [(22, 1), (24, 1)]  # 15 + 7 and 11 + 13: no padding
    assert (cat["logprobs"] - rows["logprobs"]).abs().max() <= tol["lp"]
    assert (cat["entropy"] - rows["entropy"]).abs().max() <= tol["ent"]
    assert torch.all(cat["logprobs"][~valid_logprob_mask(_MASK)] == 0)
    logits = actor.forward_logits(_IDS, _MASK)
    actor.concatenate_sequences = False
    want = actor.forward_logits(_IDS, _MASK)
    assert float((logits - want).abs().max() / want.abs().max()) <= tol["logit"]


def _update(hf_dir, concatenated: bool, recompute: str = "none", **split) -> tuple[dict, dict]:
    actor = _actor(hf_dir, concatenated, recompute=recompute)
    grads, step = {}, actor._cpu_step

    def snapshot_then_step(lr):
        grads.update({n: p.grad.clone() for n, p in actor.core.named_parameters() if p.grad is not None})
        return step(lr)

    actor._cpu_step = snapshot_then_step
    batch = {"input_ids": _IDS, "attention_mask": _MASK, "valid": valid_logprob_mask(_MASK).float()}

    def loss_fn(logprobs, entropy, mb, num_tokens=None, num_sequences=None):
        return -(logprobs * mb["valid"]).sum() / num_tokens + 0.1 * (entropy * mb["valid"]).sum() / num_tokens, {}

    metrics = actor.update(batch, loss_fn, with_entropy=True, normalise_by="valid", **split)
    return grads, metrics


@cpu_path
@pytest.mark.parametrize("split", [{"micro_batch_size": 2}, {"micro_batch_size": 1, "max_tokens_per_micro_batch": 26},
                                   {"micro_batch_size": 2, "recompute": "full"},
                                   {"micro_batch_size": 2, "recompute": "selective"}],
                         ids=["two-rows", "budget-26", "full-recompute", "selective-recompute"])
def test_concatenated_update_gives_the_rows_layouts_gradient(hf_dir, tol, split):
    """A budget of 26 concatenated tokens packs first-fit [15, 11] and [13, 7]: other micro-batches than the rows
    layout's (2 rows each), the same mini-batch gradient (the loss is normalised over the whole mini-batch).
    Recomputed layers (full) and recomputed core attention (selective) get the segments again in the backward."""
    want, want_metrics = _update(hf_dir, False, micro_batch_size=2)
    got, metrics = _update(hf_dir, True, **split)
    assert got.keys() == want.keys() and len(got) > 10
    for name, g in got.items():
        assert (g - want[name]).abs().max() <= tol["grad"] * want[name].abs().max(), name
    assert metrics["grad_norm"] == pytest.approx(want_metrics["grad_norm"], rel=tol["grad"])


@cpu_path
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_concatenated_log_probs_equal_the_rows_layout_with_scaled_rope_and_qk_norms(tmp_path, arch):
    """llama: llama3 RoPE scaling (megatron's scaled frequencies, taken per segment); qwen3: q/k norms and a
    head dim other than hidden / heads."""
    hf = H.make_tiny_hf_model(arch, tmp_path / arch)
    bound = H.reorder_bounds(hf, _IDS, _MASK)["lp"]
    got = {}
    for concatenated in (False, True):
        got[concatenated] = _tokens_seen(_actor(hf, concatenated))[1]["logprobs"]
    assert (got[True] - got[False]).abs().max() <= bound


@cpu_path
def test_concatenated_critic_values_equal_the_rows_layout(hf_dir, tol):
    from rljob_worker.megatron.critic import MegatronCritic

    values = {}
    for concatenated in (False, True):
        critic = MegatronCritic.from_hf(hf_dir, ParallelConfig(), OptimConfig(lr=1e-3), seed=3)
        critic.concatenate_sequences = concatenated
        values[concatenated] = critic.compute_values({"input_ids": _IDS, "attention_mask": _MASK}, micro_batch_size=2)
    scale = float(values[False].abs().max())
    assert scale > 0 and float((values[True] - values[False]).abs().max()) <= tol["logit"] * scale
    assert torch.all(values[True][~_MASK.bool()] == 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_varlen_attention_keeps_every_segment_to_itself():
    """bf16 varlen flash attention over four concatenated segments (one of a single token) against a float64
    reference of each segment alone, on the same bf16 values: the bounds of the flash kernel's own test
    (test_attention_backend.py: 4u on the output, 8u on the query gradient, u = 2^-8). Attention leaking
    across a boundary would mix unrelated values: errors of order 1."""
    from rljob_worker.megatron.sdpa_attention import varlen_causal
    from test_attention_backend import _reference, _relative

    lengths = (97, 1, 256, 301)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(sum(lengths), 4, 64, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    kv = torch.randn(sum(lengths), 2, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    out = varlen_causal(q, kv, kv, cu, max(lengths), 64**-0.5)
    out.float().square().sum().backward()
    u = 2.0**-8
    grads, want_grads = [], []
    for start, n in zip(cu[:-1].tolist(), lengths):
        seg = slice(start, start + n)  # [n, h, d] -> [1, h, n, d]: one row of the rows layout
        want_out, want_grad = _reference(q[seg].permute(1, 0, 2)[None], kv[seg].permute(1, 0, 2)[None])
        assert _relative(out[seg].permute(1, 0, 2)[None], want_out) <= 4 * u, n
        grads.append(q.grad[seg].permute(1, 0, 2)[None].flatten())
        want_grads.append(want_grad.flatten())
    # the gradient over all segments: a one-token segment's is exactly 0 (its softmax is constant), so its
    # kernel rounding (~1e-6) has no norm of its own to be relative to
    assert _relative(torch.cat(grads), torch.cat(want_grads)) <= 8 * u


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bf16_concatenated_log_probs_are_as_close_to_fp32_as_the_rows_layout(tmp_path):
    """The GPU default (bf16, varlen flash, compiled thd RoPE) against an fp32 run of the rows layout: its
    log-probs are within bf16 rounding of it as the bf16 rows layout's are. Both bf16 runs do the same
    arithmetic in another order, so their mean errors over ~2,000 tokens agree to a few percent; 1.5x
    leaves room for that, and a token attending across rows or rotated by a wrong position is off by
    whole nats (the mean error grows by orders of magnitude)."""
    hf = H.make_tiny_hf_model("qwen2", tmp_path / "hf", num_hidden_layers=4, hidden_size=256, intermediate_size=512,
                              num_attention_heads=8, num_key_value_heads=2, vocab_size=512)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, 200, (16,), generator=g)
    ids = torch.randint(0, 512, (16, 200), generator=g)
    mask = (torch.arange(200)[None, :] < lengths[:, None]).long()
    batch = {"input_ids": ids, "attention_mask": mask}
    valid = valid_logprob_mask(mask)

    def logprobs(dtype, concatenated):
        actor = MegatronActor.from_hf(hf, ParallelConfig(), OptimConfig(lr=1e-3), dtype=dtype, seed=1,
                                      trainable=False)
        actor.concatenate_sequences = concatenated
        return actor.compute_logprobs(batch, micro_batch_size=4)["logprobs"]

    reference = logprobs(torch.float32, False)
    rows_err = (logprobs(torch.bfloat16, False) - reference)[valid].abs().mean()
    cat_err = (logprobs(torch.bfloat16, True) - reference)[valid].abs().mean()
    assert 0 < cat_err <= 1.5 * rows_err, (float(cat_err), float(rows_err))


@cpu_path
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_concatenated_mixture_of_experts_equals_the_rows_layout(tmp_path, arch):
    """Routers see each token once either way: log-probs, and an update's loss, load-balancing loss (real tokens
    only: the padding mask covers the concatenated sequence's padding) and gradient norm, within the model's
    reordering bounds."""
    hf = H.make_tiny_hf_model(arch, tmp_path / arch)
    tol = H.reorder_bounds(hf, _IDS, _MASK)
    batch = {"input_ids": _IDS, "attention_mask": _MASK}
    got = {}
    for concatenated in (False, True):
        actor = _actor(hf, concatenated)
        logprobs = actor.compute_logprobs(batch, micro_batch_size=2)["logprobs"]
        got[concatenated] = (logprobs, actor.update(batch, H.seq_nll_loss, micro_batch_size=2, with_entropy=True))
    assert (got[True][0] - got[False][0]).abs().max() <= tol["lp"]
    want = got[False][1]
    bounds = H.metric_bounds(tol, want)
    assert want["moe_aux_loss"] > 0
    for key in ("loss", "entropy", "grad_norm", "moe_aux_loss"):
        assert got[True][1][key] == pytest.approx(want[key], abs=bounds[key]), key


@cpu_path
def test_concatenated_routing_replay_routes_each_token_to_its_recorded_experts(tmp_path):
    """Replayed routing reaches each token in the concatenated layout: random recorded experts move the log-probs
    exactly as in the rows layout (within rounding), far from the routers' own choice."""
    from test_routing_replay import random_routing

    hf = H.make_tiny_hf_model("qwen3_moe", tmp_path / "moe")
    routed = random_routing(*_IDS.shape, 2)
    tol = H.reorder_bounds(hf, _IDS, _MASK)["lp"]
    got = {}
    for concatenated in (False, True):
        actor = _actor(hf, concatenated)
        actor.enable_routing_replay()
        got[concatenated] = actor.compute_logprobs({"input_ids": _IDS, "attention_mask": _MASK,
                                                    "routed_experts": routed}, micro_batch_size=2)["logprobs"]
        own = actor.compute_logprobs({"input_ids": _IDS, "attention_mask": _MASK}, micro_batch_size=2)["logprobs"]
    assert (got[True] - got[False]).abs().max() <= tol
    assert (got[True] - own)[valid_logprob_mask(_MASK)].abs().max() > 4 * tol
