"""A faster GPU rollout engine on the transformers model's own weights: static KV cache + CUDA graphs.

`HFEngine` runs the transformers forward with a dynamic cache: every decode step re-launches a few
hundred small kernels from Python, grows the cache by concatenation and rebuilds the attention mask,
so at batch 256 a 0.5B model spends ~10x its arithmetic time on overhead. This engine keeps the
same interface and weights, and changes the decode loop:

- the KV cache is preallocated per batch size, ``(B, kv_heads, L, head_dim)`` per layer (L: prompt width +
  new tokens, rounded up; a longer cache from an earlier call is kept), and written in place at the step's
  slot (``index_copy_``); the prompt width is state (which slots hold the prompt), not a shape, so prompts
  of another width reuse the session and its graphs;
- attention over the cache is two batched matmuls with a boolean key mask kept on the device; a decode
  step reads only the filled slots, rounded up to one of at most 8 key buckets (`kv_buckets`), not the
  whole cache;
- one decode step = forward + next-token pick + bookkeeping (store the token and its log-prob, the
  finished flags, the next input), with fixed shapes and no host sync; on CUDA it is captured as one
  CUDA graph per key bucket and sampler, so a step is one graph replay. The pick runs inside the step
  (``sample_in_step``, on by default on CUDA or with compile): greedy, or a race over uniform noise
  (`race_sample`, with top-k / top-p when set: the distribution ``sample_next`` draws from) drawn from
  a generator of the engine's own that the graph advances on every replay, seeded per chunk from the
  call's seed. Eager on a CPU the engine samples with ``sample_next`` and the call's generator instead,
  drawing exactly what `HFEngine` draws;
- prefill runs the same forward eagerly and computes logits of the last position only, in chunks
  of rows sized so that one chunk's attention scores and MLP activations stay under
  ``prefill_bytes`` (4 GiB: a 7B model's 1024-token prompts take ~0.5 GiB a row, and a whole
  batch of 256 at once would need over 100 GiB);
- the all-finished check syncs once every ``check_every`` steps instead of every step;
- ``compile_decode`` (spec.rollout.compile, default on CUDA; env ``RLJOB_HF_STATIC_COMPILE=0/1`` overrides)
  compiles the decode step with its sampler with torch.compile before capture, fusing the norms, RoPE,
  SwiGLU, the attention's softmax and the sampler's passes over the logits. By layer (``compile_scope``,
  default): one graph for every decoder layer and one for the tail, so a compile traces one layer (0.5B,
  H200: a cold pod's first step 40.9 s against 133.8 s for the whole step as one graph); the CUDA graph
  still captures the whole step. Inductor's on-disk cache (compile_config) makes a later process's first
  call cheaper. Batch, cache length and key bucket are symbolic sizes from the first compile, so each
  sampler mode (greedy, temperature, top-k/top-p) compiles once; other batches, lengths and prompt widths
  do not recompile. A failed compile leaves the uncompiled step (`compile_once`).

Linear layers, norms, MLPs and rotary embeddings are the transformers model's modules, so weight
sync (`update_weights`, inherited) writes into the very tensors the graph reads. On a GPU each layer's q/k/v and
gate/up projections run as one GEMM each (`fused_projections`: the parameters become views of the fused weight;
``fuse_projections``, env ``RLJOB_FUSE_PROJECTIONS=0`` for benchmarks). Supports the
Llama-style decoders (Llama, Qwen2, Qwen3 with q/k norms, Mistral without sliding windows);
anything else raises ``ValueError`` at construction (`make_engine` then falls back to `HFEngine`).

Selected by ``make_engine`` for ``rollout.engine: hf`` on CUDA (``RLJOB_HF_STATIC=0`` turns it off).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch

from rljob_worker.rollout import fused_projections, precompiled
from rljob_worker.rollout.base import RolloutOutput, SamplingParams
from rljob_worker.rollout.compile_once import CompileOnce
from rljob_worker.rollout.hf_engine import HFEngine, rows_to_output
from rljob_worker.rollout.sampling import greedy_pick, race_sample, sample_next

log = logging.getLogger(__name__)

SUPPORTED = {"llama", "qwen2", "qwen3", "mistral"}
# what the decode step compiles as (benchmarks): "layer" (default: one layer graph + the tail, a compile ~1/layers
# of the whole step's) or "step" (the whole step, one graph)
SCOPE_ENV = "RLJOB_COMPILE_SCOPE"
# benchmarks: "0" keeps each layer's q/k/v and gate/up as separate GEMMs on a GPU (fused_projections)
FUSE_ENV = "RLJOB_FUSE_PROJECTIONS"
MAX_STOP_TOKENS = 8  # SamplingParams.stop_token_ids the decode step checks (a fixed-size buffer)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def kv_buckets(length: int, max_graphs: int = 8, multiple: int = 64) -> list[int]:
    """Key counts the decode attention reads, ascending, the last = ``length``: multiples of a block of at least
    ``multiple`` slots, at most ``max_graphs`` of them (one CUDA graph each). A step at cache slot ``t`` reads
    the smallest bucket > t (`bucket_for`), so attention reads the filled slots plus < one block, not the whole
    cache."""
    block = max(multiple, _round_up(-(-length // max(max_graphs, 1)), multiple))
    return sorted({min(k, length) for k in range(block, length + block, block)})


def bucket_for(slot: int, buckets: list[int]) -> int:
    """The smallest bucket that holds cache slot ``slot`` (keys 0..slot)."""
    for keys in buckets:
        if keys > slot:
            return keys
    raise ValueError(f"cache slot {slot} is beyond the cache ({buckets[-1]} slots)")


def _dynamic(t: torch.Tensor, *dims: int) -> torch.Tensor:
    """t, with ``dims`` marked as sizes a compiled region should not specialise on (batch, key count)."""
    for d in dims:
        torch._dynamo.maybe_mark_dynamic(t, d)
    return t


def dynamo_compiles() -> int:
    """Graphs torch.compile has compiled in this process so far (a compile or a recompile each)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@dataclass(frozen=True)
class LayerDims:
    """The attention sizes a decode layer reads besides its module: constants of the compiled layer region."""
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    qk_norm: bool

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads


class DecodeState(NamedTuple):
    """The session tensors a decode step's tail reads and writes (each at a fixed address; `_Session`)."""
    pos: torch.Tensor
    slot: torch.Tensor
    count: torch.Tensor
    tok: torch.Tensor
    tokens: torch.Tensor
    logprobs: torch.Tensor
    done: torch.Tensor
    forced: torch.Tensor
    stops: torch.Tensor
    temperature: torch.Tensor
    noise: torch.Tensor | None


# The compiled regions are module-level functions of modules, tensors and plain values (not engine methods): the
# precompiled artefact keeps its guards, and guards on an engine would have to pickle the engine.
def decode_attention(dims: LayerDims, attn, x: torch.Tensor, cos, sin, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     write: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
    """x (B, T, hidden) -> attention output (B, T, hidden); writes K/V into this layer's cache (B, Hkv, L, D) at
    slots `write` (T,) and attends over its slots 0..keys-1 under key_mask (B, T, keys)."""
    b, t, _ = x.shape
    keys = key_mask.shape[-1]
    q, k, v = fused_projections.qkv(attn, x)
    q = q.view(b, t, dims.heads, dims.head_dim)
    k = k.view(b, t, dims.kv_heads, dims.head_dim)
    v = v.view(b, t, dims.kv_heads, dims.head_dim)
    if dims.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    c, sn = cos[:, :, None, :], sin[:, :, None, :]
    q = q * c + _rotate_half(q) * sn
    k = k * c + _rotate_half(k) * sn
    k_cache.index_copy_(2, write, k.transpose(1, 2))
    v_cache.index_copy_(2, write, v.transpose(1, 2))
    kc, vc = k_cache[:, :, :keys], v_cache[:, :, :keys]  # (B, Hkv, keys, D)
    # query head h reads kv head h // groups (as transformers' repeat_kv): (B, Hkv, groups*T, D)
    qg = q.permute(0, 2, 1, 3).reshape(b, dims.kv_heads, dims.groups * t, dims.head_dim)
    scores = torch.matmul(qg, kc.transpose(-1, -2)).float() * dims.scale  # (B, Hkv, groups*T, keys)
    scores = scores.view(b, dims.kv_heads, dims.groups, t, keys)
    scores = scores.masked_fill(~key_mask[:, None, None, :, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(vc.dtype).view(b, dims.kv_heads, dims.groups * t, keys)
    out = torch.matmul(probs, vc)  # (B, Hkv, groups*T, D)
    out = out.view(b, dims.heads, t, dims.head_dim).transpose(1, 2).reshape(b, t, dims.heads * dims.head_dim)
    return attn.o_proj(out)


def decode_layer(dims: LayerDims, layer, h: torch.Tensor, cos, sin, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 write: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
    """One decoder layer: h (B, T, hidden) -> h. The unit the decode step compiles (one graph serves every layer:
    the layer's weights and cache are inputs), so a compile traces one layer, not the whole model."""
    h = h + decode_attention(dims, layer.self_attn, layer.input_layernorm(h), cos, sin, k_cache, v_cache, write,
                             key_mask)
    return h + fused_projections.mlp(layer.mlp, layer.post_attention_layernorm(h))


def record(st: DecodeState, tok: torch.Tensor, lp: torch.Tensor, pad: int) -> None:
    """Store the picks tok, lp (B,) as token number st.count (pad / 0 for finished rows; the given token where it
    is forced) and feed them to the next step."""
    at = st.count.view(1)
    forced = st.forced.index_select(1, at).squeeze(1)
    given = st.tokens.index_select(1, at).squeeze(1)
    tok = torch.where(forced, given, tok.masked_fill(st.done, pad))
    lp = lp.float().masked_fill(st.done | forced, 0.0)
    st.tokens.index_copy_(1, at, tok[:, None])
    st.logprobs.index_copy_(1, at, lp[:, None])
    st.done.logical_or_((tok[:, None] == st.stops[None, :]).any(dim=-1) & ~forced)  # a given EOS ends nothing
    st.tok.copy_(tok[:, None])
    st.count.add_(1)


def pick(logits: torch.Tensor, st: DecodeState, mode: str, top_k: int, top_p: float):
    """logits (B, V) -> (tokens (B,), log-probs (B,)): greedy, or a race over st.noise (drawn just before)."""
    if mode == "greedy":
        return greedy_pick(logits)
    return race_sample(logits, st.temperature, st.noise, top_k, top_p)


def pick_and_record(st: DecodeState, logits: torch.Tensor, pad: int, mode: str, top_k: int, top_p: float) -> None:
    st.pos.add_(1)
    st.slot.add_(1)
    tok, lp = pick(logits, st, mode, top_k, top_p)
    record(st, tok, lp, pad)


def decode_tail(norm, lm_head, st: DecodeState, h: torch.Tensor, pad: int, mode: str, top_k: int,
                top_p: float) -> None:
    """The decode step after the layers: h (B, 1, hidden) -> logits -> the next token, recorded."""
    pick_and_record(st, lm_head(norm(h[:, -1])), pad, mode, top_k, top_p)


def tail_greedy(norm, lm_head, st: DecodeState, h: torch.Tensor, pad: int) -> None:
    decode_tail(norm, lm_head, st, h, pad, "greedy", -1, 1.0)


def tail_sample(norm, lm_head, st: DecodeState, h: torch.Tensor, pad: int) -> None:
    decode_tail(norm, lm_head, st, h, pad, "sample", -1, 1.0)


def tail_filtered(norm, lm_head, st: DecodeState, h: torch.Tensor, pad: int, top_k: int, top_p: float) -> None:
    decode_tail(norm, lm_head, st, h, pad, "sample", top_k, top_p)


TAILS = {"greedy": tail_greedy, "sample": tail_sample, "filtered": tail_filtered}


class _Session:
    """Buffers (and CUDA graphs) of one (batch, cache length) shape. Everything a decode step reads or writes
    lives here at a fixed address, so a captured step is replayed without arguments."""

    def __init__(self, engine: HFStaticEngine, batch: int, length: int):
        cfg, dev, dt = engine.cfg, engine.device, engine.dtype
        self.batch, self.length = batch, length
        shape = (batch, engine.kv_heads, length, engine.head_dim)
        self.k = [torch.zeros(shape, dtype=dt, device=dev) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=dt, device=dev) for _ in range(cfg.num_hidden_layers)]
        self.key_valid = torch.zeros((batch, length), dtype=torch.bool, device=dev)  # real prompt + generated slots
        self.slots = torch.arange(length, device=dev)
        self.tok = torch.zeros((batch, 1), dtype=torch.long, device=dev)  # decode-step input token
        self.pos = torch.zeros((batch, 1), dtype=torch.long, device=dev)  # its position id
        self.slot = torch.zeros((), dtype=torch.long, device=dev)  # its cache slot
        self.count = torch.zeros((), dtype=torch.long, device=dev)  # tokens recorded so far
        self.tokens = torch.full((batch, length), engine.pad, dtype=torch.long, device=dev)
        self.logprobs = torch.zeros((batch, length), dtype=torch.float32, device=dev)
        self.done = torch.zeros(batch, dtype=torch.bool, device=dev)
        # token numbers whose token is given, not sampled (static_stream: a tool response fed through decode steps);
        # the given token already sits in `tokens` there and is recorded with log-prob 0
        self.forced = torch.zeros((batch, length), dtype=torch.bool, device=dev)
        # tokens that finish a row: EOS and the call's stop tokens, padded with EOS to a fixed width so the
        # captured step reads a buffer of one shape whatever the call's stops are
        self.stops = torch.full((MAX_STOP_TOKENS + 1,), engine.eos, dtype=torch.long, device=dev)
        self.temperature = torch.ones((), dtype=torch.float32, device=dev)
        self.noise = torch.zeros((batch, engine.vocab), dtype=torch.float32, device=dev) if engine.sample_in_step else None
        self.gen = torch.Generator(device=dev) if engine.sample_in_step else None  # the in-step sampler's noise
        self.state = DecodeState(self.pos, self.slot, self.count, self.tok, self.tokens, self.logprobs, self.done,
                                 self.forced, self.stops, self.temperature, self.noise)
        self.graphs: dict[tuple, object] = {}  # (mode, top_k, top_p, keys) -> CUDA graph of one decode step
        self.pool = torch.cuda.graph_pool_handle() if engine.use_cuda_graph else None  # shared by those graphs
        if engine.compile_decode:  # batch and cache length compile as symbols from the start: one compile per sampler
            for t in (*self.k, *self.v):
                torch._dynamo.maybe_mark_dynamic(t, 0)
                torch._dynamo.maybe_mark_dynamic(t, 2)
            for t in (self.key_valid, self.tokens, self.logprobs, self.forced):
                torch._dynamo.maybe_mark_dynamic(t, 0)
                torch._dynamo.maybe_mark_dynamic(t, 1)
            for t in (self.slots, self.tok, self.pos, self.done, *([self.noise] if self.noise is not None else [])):
                torch._dynamo.maybe_mark_dynamic(t, 0)

    def rows(self, lo: int, hi: int) -> _Session:
        """The cache of rows lo..hi-1 (views: writes land in this session's cache)."""
        view = object.__new__(_Session)
        view.k, view.v = [t[lo:hi] for t in self.k], [t[lo:hi] for t in self.v]
        return view


class HFStaticEngine(HFEngine):
    def __init__(self, model_dir: str, *, dtype: torch.dtype, device: torch.device, eos_token_id: int,
                 pad_token_id: int, max_batch: int = 256, use_cuda_graph: bool | None = None,
                 length_multiple: int = 64, check_every: int | None = None,
                 compile_decode: bool | None = None, prefill_bytes: int = 4 * 2**30,
                 sample_in_step: bool | None = None, max_graphs: int = 8, compile_backend: str = "inductor",
                 compile_scope: str | None = None,
                 fuse_projections: bool | None = None):
        super().__init__(model_dir, dtype=dtype, device=device, eos_token_id=eos_token_id,
                         pad_token_id=pad_token_id, max_batch=max_batch)
        cfg = self.model.config
        self.cfg, self.dtype = cfg, dtype
        model_type = getattr(cfg, "model_type", None)
        if model_type not in SUPPORTED:
            raise ValueError(f"the static-cache engine supports {sorted(SUPPORTED)}, not model_type {model_type!r}")
        layer_types = getattr(cfg, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types) or (
                getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None)):
            raise ValueError("the static-cache engine does not support sliding-window attention")
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        rope_type = str(rope.get("rope_type", rope.get("type", "default"))) if isinstance(rope, dict) else "default"
        if "dynamic" in rope_type or rope_type == "longrope":
            raise ValueError(f"the static-cache engine does not support {rope_type} RoPE (it resizes on the host)")
        self.decoder = self.model.model
        self.layers = list(self.decoder.layers)
        attn = self.layers[0].self_attn
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.dims = LayerDims(self.heads, self.kv_heads, self.head_dim,
                              scale=float(getattr(attn, "scaling", self.head_dim ** -0.5)),
                              qk_norm=hasattr(attn, "q_norm") and hasattr(attn, "k_norm"))
        self.vocab = self.model.get_output_embeddings().weight.shape[0]
        on_cuda = device.type == "cuda"
        if fuse_projections is None:  # on a GPU, where a small model's decode step is bound by GEMM launches
            fuse_projections = on_cuda and os.environ.get(FUSE_ENV, "1").strip() != "0"
        self.fuse_projections = bool(fuse_projections)
        self.fused_gemms_saved = fused_projections.fuse(self.layers) if self.fuse_projections else 0
        if compile_decode is None:  # spec.rollout.compile: auto (make_engine passes the resolved value)
            from rljob_api.enums import RolloutCompile

            from rljob_worker.rollout.compile_config import compile_enabled

            compile_decode = compile_enabled(RolloutCompile.AUTO, device)
        self.compile_decode = bool(compile_decode)
        graphs_ok = on_cuda if use_cuda_graph is None else (use_cuda_graph and on_cuda)
        if sample_in_step is None:  # eager on a CPU keeps sample_next: the HF engine's draws, token for token
            sample_in_step = graphs_ok or self.compile_decode
        if self.compile_decode and not sample_in_step:
            raise ValueError("compile_decode compiles the decode step with its sampler: it needs sample_in_step")
        self.sample_in_step = bool(sample_in_step)
        self.use_cuda_graph = graphs_ok and self.sample_in_step
        # a graph-captured draw from a generator of our own needs torch's register_generator_state (torch >= 2.5);
        # without it the noise is drawn just before each replay (a launch, still no host sync)
        self.noise_in_graph = hasattr(torch.cuda.CUDAGraph, "register_generator_state") if on_cuda else False
        self.length_multiple = length_multiple
        self.max_graphs = max_graphs
        self.prefill_bytes = prefill_bytes
        self.check_every = check_every if check_every is not None else (16 if on_cuda else 1)
        self._session: _Session | None = None
        self.graph_captures = 0  # how many CUDA graphs were captured (tests, metrics)
        # One compiled entry per sampler mode (each its own dynamo cache and recompile budget). Batch, cache length
        # and key bucket are marked dynamic (_Session, _run_step), so each mode compiles once with symbolic sizes;
        # the prompt width is not part of any shape the step sees, so new widths never recompile.
        self._eager_steps = {"greedy": self._step_greedy, "sample": self._step_sample, "filtered": self._step_filtered}
        compile_scope = compile_scope or os.environ.get(SCOPE_ENV, "").strip() or "layer"
        if compile_scope not in ("layer", "step"):
            raise ValueError(f"compile scope {compile_scope!r} ({SCOPE_ENV}): 'layer' (one graph for every layer, "
                             "and the tail; the default) or 'step' (the whole decode step as one graph)")
        self.compile_scope = compile_scope
        self._compiled_steps: dict = {}
        if self.compile_decode and compile_scope == "step":
            self._compiled_steps = {m: torch.compile(f, fullgraph=True, backend=compile_backend)
                                    for m, f in self._eager_steps.items()}
        elif self.compile_decode:
            region = self._region_compiler(compile_backend)
            self._compiled_layer = region(decode_layer, "decode-layer")
            self._compiled_tails = {m: region(f, f"decode-tail-{m}") for m, f in TAILS.items()}
            self._compiled_steps = {m: functools.partial(self._step_in_regions, mode=m) for m in TAILS}
        # each sampler's compile (mode, top_k, top_p: the values a filtered step is specialised on) runs once, before
        # the first rollout that needs it (never beside it: compile_once says why); a failed one leaves the step
        # uncompiled
        self.compiles = CompileOnce(announce=os.environ.get("RANK", "0") == "0")

    def _region_compiler(self, backend: str):
        """``(fn, name) -> fn`` compiled as a region of the decode step: plain torch.compile, or with
        ``RLJOB_PRECOMPILE=1`` and inductor, precompiled and kept beside the compile cache (`precompiled`: a
        restored pod loads it without tracing)."""
        folder = precompiled.precompile_folder() if backend == "inductor" else None
        if folder is None:
            return lambda fn, name: torch.compile(fn, fullgraph=True, backend=backend)
        parts = {"model": self.cfg.to_dict(), "dtype": str(self.dtype), "fused": self.fuse_projections,
                 "sample_in_step": self.sample_in_step}
        key = precompiled.artefact_key(parts, (__name__, fused_projections.__name__, race_sample.__module__),
                                       self.device)
        return lambda fn, name: precompiled.PrecompiledRegion(fn, name, folder, key)

    # -- memory
    def release_cache(self) -> None:
        """Free the KV cache and the CUDA graphs (the next generate() allocates and captures again), so
        the actor's update gets that memory; the weights stay where they are."""
        self._session = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def sleep(self) -> None:
        self._session = None  # the graphs and the cache point at device memory that is about to move
        if self.device.type == "cuda":  # a moved view becomes a tensor of its own: fuse again on waking
            fused_projections.unfuse(self.layers)
        super().sleep()

    # -- compiling the decode step
    def compiled_ready(self, sampler: tuple[str, int, float]) -> bool:
        return self.compile_decode and self.compiles.ready(sampler)

    def _ensure_compile(self, sampler: tuple[str, int, float], s: _Session, keys: int) -> bool:
        """Compile this sampler's step unless tried before, on the call's own session before its prefill; True when
        the compiled step can be used."""
        if not self.compile_decode:
            return False
        if self._saved_regions(sampler[0]):
            expect = "loading its regions precompiled by an earlier pod (about 1 s)"
        elif self.compile_scope == "layer":
            expect = ("by layer: ~25 s with a cold compile cache at 0.5B on an H200, a few s with one restored from "
                      "the job's storage; rollout.compile: disabled skips it")
        else:
            expect = ("the whole step: about 2-5 min with a cold compile cache (0.5B on an H200: 123 s; 7B on an "
                      "H100: ~270 s), ~20 s restored; rollout.compile: disabled skips it")
        return self.compiles.ensure(sampler, lambda: self._compile_step(sampler, keys, s),
                                    f"the decode step ({sampler[0]} sampler)", expect=expect)

    def _saved_regions(self, mode: str) -> bool:
        """Whether the layer and this sampler's tail have precompiled artefacts on disk (a restored pod)."""
        if self.compile_scope != "layer" or not self.compile_decode:
            return False
        regions = (self._compiled_layer, self._compiled_tails[mode])
        return all(isinstance(r, precompiled.PrecompiledRegion) and r.path is not None and r.path.exists()
                   for r in regions)

    def _compile_step(self, sampler: tuple[str, int, float], keys: int, s: _Session) -> None:
        """Run the compiled step twice (the compile, then one warm call) on session ``s`` (its buffers are reset
        by the prefill that follows)."""
        mode, top_k, top_p = sampler
        cuda = self.device.type == "cuda"
        stream = torch.cuda.Stream(device=self.device) if cuda else None
        if cuda:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.no_grad(), (torch.cuda.stream(stream) if cuda else contextlib.nullcontext()):
            for _ in range(2):
                s.slot.zero_()
                s.count.zero_()
                self._run_step(s, keys, mode, top_k, top_p, draw=True, compiled=True)
        if cuda:
            stream.synchronize()

    def prefill_rows(self, width: int) -> int:
        """Rows per prefill chunk: one row's float32 attention scores (~3.5 live copies of heads x width^2)
        and MLP activations (3 of width x intermediate) must fit ``prefill_bytes`` together with the rest."""
        per_row = 3.5 * self.heads * width * width * 4 + 3 * width * self.cfg.intermediate_size * self.dtype.itemsize
        return max(1, int(self.prefill_bytes // per_row))

    def wake_up(self, tags: list[str] | None = None) -> None:
        super().wake_up()
        if self.fuse_projections:
            fused_projections.fuse(self.layers)
        self._params = dict(self.model.named_parameters())

    # -- the forward
    def _layer(self, layer, h: torch.Tensor, cos, sin, k_cache: torch.Tensor, v_cache: torch.Tensor,
               write: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        return decode_layer(self.dims, layer, h, cos, sin, k_cache, v_cache, write, key_mask)

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, s: _Session, write: torch.Tensor,
                 key_mask: torch.Tensor) -> torch.Tensor:
        """ids, pos (B, T) -> logits of the last position (B, V)."""
        h = self.decoder.embed_tokens(ids)
        cos, sin = self.decoder.rotary_emb(h, pos)
        for i, layer in enumerate(self.layers):
            h = self._layer(layer, h, cos, sin, s.k[i], s.v[i], write, key_mask)
        return self.model.lm_head(self.decoder.norm(h[:, -1]))

    def _decode_logits(self, s: _Session, key_slots: torch.Tensor) -> torch.Tensor:
        """The forward of s.tok at cache slot s.slot over keys 0..len(key_slots)-1 -> logits (B, V). Fixed shapes,
        no host sync; the key count is a shape (of key_slots), so dynamo sees one dynamic dim, not a constant."""
        keys = key_slots.shape[0]
        slot = s.slot.view(1)
        s.key_valid.index_fill_(1, slot, True)
        return self._forward(s.tok, s.pos, s, slot, s.key_valid[:, None, :keys])

    def _record(self, s: _Session, tok: torch.Tensor, lp: torch.Tensor) -> None:
        record(s.state, tok, lp, self.pad)

    def _pick(self, logits: torch.Tensor, s: _Session, mode: str, top_k: int, top_p: float):
        return pick(logits, s.state, mode, top_k, top_p)

    def _step(self, s: _Session, key_slots: torch.Tensor, mode: str, top_k: int, top_p: float) -> None:
        """One whole decode step: forward, pick the next token, record it (graph-capturable)."""
        logits = self._decode_logits(s, key_slots)
        self._pick_and_record(s, logits, mode, top_k, top_p)

    def _pick_and_record(self, s: _Session, logits: torch.Tensor, mode: str, top_k: int, top_p: float) -> None:
        pick_and_record(s.state, logits, self.pad, mode, top_k, top_p)

    def _step_in_regions(self, s: _Session, key_slots: torch.Tensor, top_k: int = -1, top_p: float = 1.0, *,
                         mode: str) -> None:
        """The decode step compiled by regions (compile_scope "layer"): the embedding eagerly, every layer through
        one compiled layer graph, then the compiled tail (norm, head, pick, record). The same kernels as the whole
        step compiled but for the fusions across a layer boundary, at a compile that traces one layer, not all
        of them. Sizes that change between calls are marked dynamic on each region's inputs."""
        keys = key_slots.shape[0]
        slot = s.slot.view(1)
        s.key_valid.index_fill_(1, slot, True)
        key_mask = _dynamic(s.key_valid[:, None, :keys], 0, 2)
        h = _dynamic(self.decoder.embed_tokens(s.tok), 0)
        cos, sin = (_dynamic(t, 0) for t in self.decoder.rotary_emb(h, s.pos))
        for i, layer in enumerate(self.layers):
            h = _dynamic(self._compiled_layer(self.dims, layer, h, cos, sin, s.k[i], s.v[i], slot, key_mask), 0)
        tail = (self.decoder.norm, self.model.lm_head, s.state, h, self.pad)
        if mode == "filtered":
            self._compiled_tails[mode](*tail, top_k, top_p)
        else:
            self._compiled_tails[mode](*tail)

    def _step_greedy(self, s: _Session, key_slots: torch.Tensor) -> None:
        self._step(s, key_slots, "greedy", -1, 1.0)

    def _step_sample(self, s: _Session, key_slots: torch.Tensor) -> None:
        self._step(s, key_slots, "sample", -1, 1.0)

    def _step_filtered(self, s: _Session, key_slots: torch.Tensor, top_k: int, top_p: float) -> None:
        self._step(s, key_slots, "sample", top_k, top_p)

    def _run_step(self, s: _Session, keys: int, mode: str, top_k: int, top_p: float, draw: bool,
                  compiled: bool | None = None) -> None:
        """The decode step, with its noise drawn first when ``draw``: compiled when ``compiled`` (None: when this
        sampler's compile is ready), else the same code eagerly."""
        if draw and mode != "greedy":
            s.noise.uniform_(0.0, 1.0, generator=s.gen)
        key_slots = s.slots[:keys]
        if compiled is None:
            compiled = self.compiled_ready((mode, top_k, top_p))
        if compiled:
            torch._dynamo.maybe_mark_dynamic(key_slots, 0)  # the key bucket changes within every rollout
        step = (self._compiled_steps if compiled else self._eager_steps)[mode]
        if mode == "filtered":
            step(s, key_slots, top_k, top_p)
        else:
            step(s, key_slots)

    def _capture(self, s: _Session, mode: str, top_k: int, top_p: float, keys: int, compiled: bool) -> None:
        """Capture one decode step (noise draw, forward over `keys` slots, pick, record), compiled or not, as a
        CUDA graph. Runs before the chunk's prefill: the warm-ups and the capture write wherever the counters
        point, and the chunk resets every buffer they touch."""
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside capture (workspace allocation, lazy init)
                s.slot.zero_()
                s.count.zero_()
                self._run_step(s, keys, mode, top_k, top_p, draw=True, compiled=compiled)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        s.slot.zero_()
        s.count.zero_()
        graph = torch.cuda.CUDAGraph()
        if self.noise_in_graph and mode != "greedy":
            graph.register_generator_state(s.gen)  # each replay draws fresh noise from s.gen's current state
        # thread_local: a separate rollout pool receives weights in a thread of its own meanwhile (weight_push)
        with torch.cuda.graph(graph, pool=s.pool, capture_error_mode="thread_local"):
            self._run_step(s, keys, mode, top_k, top_p, draw=self.noise_in_graph, compiled=compiled)
        s.graphs[(mode, top_k, top_p, keys)] = graph
        self.graph_captures += 1

    def _session_for(self, batch: int, length: int) -> _Session:
        """A session of at least this batch size with a cache of at least ``length`` slots: a longer one is kept
        (its graphs stay valid and the key buckets bound what a step reads), so prompt widths that alternate
        around a length boundary do not re-allocate and re-capture every rollout. With CUDA graphs a larger batch
        is kept too (the call's extra rows start finished): the agent loop's later turns, a chunk's remainder and
        dynamic sampling's refills call with fewer rows, and a new session costs an allocation and a capture of
        every key bucket's graph (~0.2 s a call at 1.5B, bench/NOTES.md), while a padded decode step costs about
        the same as a full one where decoding reads weights, not rows. Without graphs the batch is exact."""
        s = self._session
        fits = s is not None and s.length >= length and (s.batch == batch or (self.use_cuda_graph and s.batch > batch))
        if not fits:
            if s is not None and self.use_cuda_graph:
                batch = max(batch, s.batch)
            self._session = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            s = self._session = _Session(self, batch, length)
        return s

    # -- generation
    @staticmethod
    def _mode(params: SamplingParams, vocab: int) -> tuple[str, int, float]:
        if params.temperature == 0:
            return "greedy", -1, 1.0
        top_k = params.top_k if 0 < params.top_k < vocab else -1
        if top_k == -1 and params.top_p >= 1.0:
            return "sample", -1, 1.0
        return "filtered", top_k, float(params.top_p)

    def _chunk_seed(self, gen: torch.Generator | None) -> int:
        """A seed for the in-step sampler's generator: drawn from the call's generator (seeded calls repeat), else
        from torch's global one."""
        if gen is None:
            return int(torch.randint(0, 2**62, (1,)).item())
        return int(torch.randint(0, 2**62, (1,), generator=gen, device=gen.device).item())

    def _generate_chunk(self, prompts: list[list[int]], params: SamplingParams, gen) -> RolloutOutput:
        real, steps = len(prompts), params.max_new_tokens
        self._check_stops(params)
        if steps <= 0:
            return RolloutOutput([[] for _ in prompts], [[] for _ in prompts], [False] * real)
        width = _round_up(max(len(p) for p in prompts), 16)
        s = self._session_for(real, _round_up(width + steps, self.length_multiple))
        buckets = kv_buckets(s.length, self.max_graphs)
        mode, top_k, top_p = self._mode(params, self.vocab)
        with torch.no_grad():
            self._capture_buckets(s, (mode, top_k, top_p), {bucket_for(t, buckets) for t in range(width, width + steps - 1)})
            self._start(s, prompts, width, params, gen)
            taken = 1
            while taken < steps:
                if taken % self.check_every == 0 and bool(s.done.all()):
                    break
                self._advance(s, bucket_for(width + taken - 1, buckets), (mode, top_k, top_p), params, gen)
                taken += 1
            tokens, logprobs = s.tokens[:real, :taken].cpu(), s.logprobs[:real, :taken].cpu()
        return rows_to_output(tokens, logprobs, {self.eos, *params.stop_token_ids})

    @staticmethod
    def _check_stops(params: SamplingParams) -> None:
        if len(params.stop_token_ids) > MAX_STOP_TOKENS:
            raise ValueError(f"the static-cache engine checks at most {MAX_STOP_TOKENS} stop tokens, "
                             f"got {len(params.stop_token_ids)}")

    def _capture_buckets(self, s: _Session, sampler: tuple[str, int, float], keys_needed: set[int]) -> None:
        """Capture the decode step's graph for each key bucket a call will read (before its prefill: a capture
        writes wherever the counters point). A failed capture turns graphs off and decoding goes on eagerly. The
        sampler's compile runs first, so the graphs capture the compiled step (the uncompiled one if it failed)."""
        compiled = self._ensure_compile(sampler, s, min(keys_needed, default=64))
        if not self.use_cuda_graph:
            return
        for keys in sorted(keys_needed):
            if (*sampler, keys) in s.graphs:
                continue
            try:
                self._capture(s, *sampler, keys, compiled)
            except Exception as exc:  # noqa: BLE001 - keep generating without the graphs
                log.warning("CUDA graph capture failed (%s: %s); decoding without graphs", type(exc).__name__, exc)
                self.use_cuda_graph = False
                s.graphs.clear()
                torch.cuda.synchronize(self.device)
                return

    def _start(self, s: _Session, prompts: list[list[int]], width: int, params: SamplingParams, gen) -> None:
        """Reset the session's buffers for ``prompts`` (<= s.batch rows, left-padded to ``width``; the session's
        extra rows start finished), prefill them and record each row's first token (count 1, next slot width)."""
        real, batch = len(prompts), s.batch
        prompts = prompts + [[self.pad]] * (batch - real)
        mode, top_k, top_p = self._mode(params, self.vocab)
        input_ids, position_ids, valid = self._left_padded(prompts, width)
        s.key_valid.zero_()
        s.key_valid[:, :width] = valid
        s.tokens.fill_(self.pad)
        s.logprobs.zero_()
        s.forced.zero_()
        s.done.zero_()
        s.done[real:] = True
        s.count.zero_()
        s.stops.fill_(self.eos)
        s.stops[1:1 + len(params.stop_token_ids)] = torch.tensor(params.stop_token_ids, dtype=torch.long)
        s.temperature.fill_(params.temperature if params.temperature > 0 else 1.0)
        if self.sample_in_step and mode != "greedy":
            s.gen.manual_seed(self._chunk_seed(gen))
        key_mask = self._prefill_mask(valid)
        rows = self.prefill_rows(width)
        logits = torch.cat([self._forward(input_ids[lo:lo + rows], position_ids[lo:lo + rows], s.rows(lo, lo + rows),
                                          s.slots[:width], key_mask[lo:lo + rows])
                            for lo in range(0, batch, rows)])
        s.slot.fill_(width)
        s.pos.copy_(position_ids[:, -1:] + 1)
        if self.sample_in_step:
            if mode != "greedy":
                s.noise.uniform_(0.0, 1.0, generator=s.gen)
            tok, lp = self._pick(logits, s, mode, top_k, top_p)
        else:
            tok, lp = sample_next(logits, params.temperature, params.top_k, params.top_p, gen)
        self._record(s, tok, lp)

    def _prefill_mask(self, valid: torch.Tensor) -> torch.Tensor:
        """valid (B, W) -> the prefill's key mask (B, W, W): query i sees real prompt keys j <= i, and itself (so a
        padded query's softmax stays finite)."""
        width = valid.shape[1]
        ar = torch.arange(width, device=self.device)
        causal = ar[None, :] <= ar[:, None]
        return (valid[:, None, :] & causal[None]) | torch.eye(width, dtype=torch.bool, device=self.device)[None]

    def _advance(self, s: _Session, keys: int, sampler: tuple[str, int, float], params: SamplingParams, gen) -> None:
        """One decode step over ``keys`` cache slots: a graph replay where one was captured, else eagerly."""
        mode, top_k, top_p = sampler
        graph = s.graphs.get((*sampler, keys)) if self.use_cuda_graph else None
        if graph is not None:
            if not self.noise_in_graph and mode != "greedy":
                s.noise.uniform_(0.0, 1.0, generator=s.gen)
            graph.replay()
        elif self.sample_in_step:
            self._run_step(s, keys, mode, top_k, top_p, draw=True)
        else:  # eager, sampled on the host side with the call's generator (the HF engine's draws)
            logits = self._decode_logits(s, s.slots[:keys])
            s.pos.add_(1)
            s.slot.add_(1)
            self._record(s, *sample_next(logits, params.temperature, params.top_k, params.top_p, gen))
