"""A faster GPU rollout engine on the transformers model's own weights: static KV cache + CUDA graph.

`HFEngine` runs the transformers forward with a dynamic cache: every decode step re-launches a few
hundred small kernels from Python, grows the cache by concatenation and rebuilds the attention mask,
so at batch 256 a 0.5B model spends ~10x its arithmetic time on overhead. This engine keeps the
same interface, weights and sampling code, and changes only the decode loop:

- the KV cache is preallocated once per (batch, prompt width, length) shape, ``(B, kv_heads, L,
  head_dim)`` per layer, and written in place at the step's slot (``index_copy_``);
- attention over the cache is two batched matmuls with a boolean key mask built on the device from
  the prompt's padding mask and a step counter, so a decode step has fixed shapes and no host sync;
- on CUDA the whole decode-step forward (all layers + final norm + lm_head of the last position)
  is captured once into a CUDA graph and replayed every step; sampling (``sample_next``, the same
  code as `HFEngine`, with the caller's generator) runs eagerly on the graph's logits buffer;
- prefill runs the same forward eagerly and computes logits of the last position only, in chunks
  of rows sized so that one chunk's attention scores and MLP activations stay under
  ``prefill_bytes`` (4 GiB: a 7B model's 1024-token prompts take ~0.5 GiB a row, and a whole
  batch of 256 at once would need over 100 GiB);
- the all-finished check syncs once every ``check_every`` steps instead of every step;
- optionally (``compile_decode``, env ``RLJOB_HF_STATIC_COMPILE=1``) the decode step is compiled
  with torch.compile before capture, fusing the norms, RoPE, SwiGLU and the attention's softmax
  (a few hundred small kernels fewer per step); the first call of each shape pays the compile.
  Plain temperature sampling (no top-k / top-p) then also runs compiled, as a race over Gumbel
  noise (`race_sample`: the same distribution as ``sample_next``, drawn from the caller's
  generator, without materialising probabilities).

Linear layers, norms, MLPs and rotary embeddings are the transformers model's modules, so weight
sync (`update_weights`, inherited) writes into the very tensors the graph reads. Supports the
Llama-style decoders (Llama, Qwen2, Qwen3 with q/k norms, Mistral without sliding windows);
anything else raises ``ValueError`` at construction (`make_engine` then falls back to `HFEngine`).

Selected by ``make_engine`` for ``rollout.engine: hf`` on CUDA when ``RLJOB_HF_STATIC=1``.
"""
from __future__ import annotations

import logging
import os

import torch

from rljob_worker.rollout.base import RolloutOutput, SamplingParams
from rljob_worker.rollout.hf_engine import HFEngine
from rljob_worker.rollout.sampling import race_sample, sample_next

log = logging.getLogger(__name__)

SUPPORTED = {"llama", "qwen2", "qwen3", "mistral"}


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Session:
    """Buffers (and the CUDA graph) of one (batch, prompt width, cache length) shape."""

    def __init__(self, engine: HFStaticEngine, batch: int, width: int, length: int):
        cfg, dev, dt = engine.cfg, engine.device, engine.dtype
        self.batch, self.width, self.length = batch, width, length
        shape = (batch, engine.kv_heads, length, engine.head_dim)
        self.k = [torch.zeros(shape, dtype=dt, device=dev) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=dt, device=dev) for _ in range(cfg.num_hidden_layers)]
        self.prompt_valid = torch.zeros((batch, length), dtype=torch.bool, device=dev)  # real prompt slots
        self.slots = torch.arange(length, device=dev)
        self.tok = torch.zeros((batch, 1), dtype=torch.long, device=dev)  # decode-step input token
        self.pos = torch.zeros((batch, 1), dtype=torch.long, device=dev)  # its position id
        self.step = torch.zeros((), dtype=torch.long, device=dev)  # decode steps taken
        self.logits: torch.Tensor | None = None
        self.graph = None

    def rows(self, lo: int, hi: int) -> _Session:
        """The cache of rows lo..hi-1 (views: writes land in this session's cache)."""
        view = object.__new__(_Session)
        view.k, view.v = [t[lo:hi] for t in self.k], [t[lo:hi] for t in self.v]
        return view


class HFStaticEngine(HFEngine):
    def __init__(self, model_dir: str, *, dtype: torch.dtype, device: torch.device, eos_token_id: int,
                 pad_token_id: int, max_batch: int = 256, use_cuda_graph: bool | None = None,
                 length_multiple: int = 64, check_every: int | None = None,
                 compile_decode: bool | None = None, prefill_bytes: int = 4 * 2**30):
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
        self.groups = self.heads // self.kv_heads
        self.scale = float(getattr(attn, "scaling", self.head_dim ** -0.5))
        self.qk_norm = hasattr(attn, "q_norm") and hasattr(attn, "k_norm")
        on_cuda = device.type == "cuda"
        self.use_cuda_graph = on_cuda if use_cuda_graph is None else (use_cuda_graph and on_cuda)
        self.length_multiple = length_multiple
        self.prefill_bytes = prefill_bytes
        self.check_every = check_every if check_every is not None else (16 if on_cuda else 1)
        self._session: _Session | None = None
        self.graph_captures = 0  # how many CUDA graphs were captured (tests, metrics)
        if compile_decode is None:  # an explicit True compiles on CPU too (tests)
            compile_decode = on_cuda and os.environ.get("RLJOB_HF_STATIC_COMPILE", "0") == "1"
        self.compile_decode = bool(compile_decode)
        # dynamic=None: the first shape compiles static kernels; a second shape recompiles once with
        # symbolic sizes instead of once per (batch, width, length) bucket
        self._step_fn = torch.compile(self._decode_step, fullgraph=True) if self.compile_decode else self._decode_step
        self._race_sample = torch.compile(race_sample, fullgraph=True) if self.compile_decode else None

    # -- memory
    def release_cache(self) -> None:
        """Free the KV cache and the CUDA graph (the next generate() allocates and captures again), so
        the actor's update gets that memory; the weights stay where they are."""
        self._session = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def sleep(self) -> None:
        self._session = None  # the graph and the cache point at device memory that is about to move
        super().sleep()

    def prefill_rows(self, width: int) -> int:
        """Rows per prefill chunk: one row's float32 attention scores (~3.5 live copies of heads x width^2)
        and MLP activations (3 of width x intermediate) must fit ``prefill_bytes`` together with the rest."""
        per_row = 3.5 * self.heads * width * width * 4 + 3 * width * self.cfg.intermediate_size * self.dtype.itemsize
        return max(1, int(self.prefill_bytes // per_row))

    def wake_up(self, tags: list[str] | None = None) -> None:
        super().wake_up()
        self._params = dict(self.model.named_parameters())

    # -- the forward
    def _attention(self, layer, x: torch.Tensor, cos, sin, s: _Session, write: torch.Tensor,
                   key_mask: torch.Tensor, keys: int) -> torch.Tensor:
        """x (B, T, hidden) -> attention output (B, T, hidden); writes K/V at cache slots `write` (T,)."""
        attn = layer.self_attn
        b, t, _ = x.shape
        q = attn.q_proj(x).view(b, t, self.heads, self.head_dim)
        k = attn.k_proj(x).view(b, t, self.kv_heads, self.head_dim)
        v = attn.v_proj(x).view(b, t, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        c, sn = cos[:, :, None, :], sin[:, :, None, :]
        q = q * c + _rotate_half(q) * sn
        k = k * c + _rotate_half(k) * sn
        i = layer.self_attn.layer_idx if hasattr(layer.self_attn, "layer_idx") else self.layers.index(layer)
        s.k[i].index_copy_(2, write, k.transpose(1, 2))
        s.v[i].index_copy_(2, write, v.transpose(1, 2))
        kc, vc = s.k[i][:, :, :keys], s.v[i][:, :, :keys]  # (B, Hkv, keys, D)
        # query head h reads kv head h // groups (as transformers' repeat_kv): (B, Hkv, groups*T, D)
        qg = q.permute(0, 2, 1, 3).reshape(b, self.kv_heads, self.groups * t, self.head_dim)
        scores = torch.matmul(qg, kc.transpose(-1, -2)).float() * self.scale  # (B, Hkv, groups*T, keys)
        scores = scores.view(b, self.kv_heads, self.groups, t, keys)
        scores = scores.masked_fill(~key_mask[:, None, None, :, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(vc.dtype).view(b, self.kv_heads, self.groups * t, keys)
        out = torch.matmul(probs, vc)  # (B, Hkv, groups*T, D)
        out = out.view(b, self.heads, t, self.head_dim).transpose(1, 2).reshape(b, t, self.heads * self.head_dim)
        return attn.o_proj(out)

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, s: _Session, write: torch.Tensor,
                 key_mask: torch.Tensor, keys: int) -> torch.Tensor:
        """ids, pos (B, T) -> logits of the last position (B, V)."""
        h = self.decoder.embed_tokens(ids)
        cos, sin = self.decoder.rotary_emb(h, pos)
        for layer in self.layers:
            h = h + self._attention(layer, layer.input_layernorm(h), cos, sin, s, write, key_mask, keys)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.lm_head(self.decoder.norm(h[:, -1]))

    def _decode_step(self, s: _Session) -> torch.Tensor:
        """One decode step from the session's buffers; fixed shapes, no host sync (graph-capturable)."""
        slot = (s.step + s.width).view(1)
        gen = (s.slots >= s.width) & (s.slots <= slot)
        key_mask = (s.prompt_valid | gen[None, :])[:, None, :]  # (B, 1, L)
        return self._forward(s.tok, s.pos, s, slot, key_mask, s.length)

    def _capture(self, s: _Session) -> None:
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside capture (workspace allocation, lazy init, compile)
                self._step_fn(s)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            s.logits = self._step_fn(s)
        s.graph = graph
        self.graph_captures += 1

    def _session_for(self, batch: int, width: int, length: int) -> _Session:
        s = self._session
        if s is None or (s.batch, s.width, s.length) != (batch, width, length):
            self._session = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            s = self._session = _Session(self, batch, width, length)
        return s

    # -- generation
    def _sample(self, logits: torch.Tensor, params: SamplingParams, gen) -> tuple[torch.Tensor, torch.Tensor]:
        plain = params.temperature > 0 and not (0 < params.top_k < logits.shape[-1]) and params.top_p >= 1.0
        if self._race_sample is None or not plain:
            return sample_next(logits, params.temperature, params.top_k, params.top_p, gen)
        uniform = torch.rand(logits.shape, generator=gen, device=logits.device, dtype=torch.float32)
        return self._race_sample(logits, params.temperature, uniform)

    def _generate_chunk(self, prompts: list[list[int]], params: SamplingParams, gen) -> RolloutOutput:
        batch = len(prompts)
        width = _round_up(max(len(p) for p in prompts), 16)
        length = _round_up(width + max(params.max_new_tokens, 1), self.length_multiple)
        s = self._session_for(batch, width, length)
        input_ids = torch.full((batch, width), self.pad, dtype=torch.long)
        attention = torch.zeros((batch, width), dtype=torch.long)
        for i, ids in enumerate(prompts):  # left padding, as HFEngine
            input_ids[i, width - len(ids):] = torch.tensor(ids)
            attention[i, width - len(ids):] = 1
        input_ids, attention = input_ids.to(self.device), attention.to(self.device)
        position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
        valid = attention.bool()
        s.prompt_valid.zero_()
        s.prompt_valid[:, :width] = valid
        with torch.no_grad():
            # prefill: query i sees real prompt keys j <= i (and itself, so padded rows stay finite)
            ar = torch.arange(width, device=self.device)
            causal = ar[None, :] <= ar[:, None]
            key_mask = (valid[:, None, :] & causal[None]) | torch.eye(width, dtype=torch.bool, device=self.device)[None]
            rows = self.prefill_rows(width)
            logits = torch.cat([self._forward(input_ids[lo:lo + rows], position_ids[lo:lo + rows], s.rows(lo, lo + rows),
                                              s.slots[:width], key_mask[lo:lo + rows], width)
                                for lo in range(0, batch, rows)])
            s.step.zero_()
            s.pos.copy_(position_ids[:, -1:] + 1)
            if self.use_cuda_graph and s.graph is None:
                s.tok.fill_(self.pad)
                try:
                    self._capture(s)
                except Exception as exc:  # noqa: BLE001 - keep generating without the graph
                    log.warning("CUDA graph capture failed (%s: %s); decoding eagerly", type(exc).__name__, exc)
                    self.use_cuda_graph, s.graph = False, None
                    torch.cuda.synchronize(self.device)
                s.step.zero_()
                s.pos.copy_(position_ids[:, -1:] + 1)
            steps = params.max_new_tokens
            tokens = torch.full((batch, steps), self.pad, dtype=torch.long, device=self.device)
            logprobs = torch.zeros((batch, steps), dtype=torch.float32, device=self.device)
            done = torch.zeros(batch, dtype=torch.bool, device=self.device)
            taken = 0
            for step in range(steps):
                next_tok, next_lp = self._sample(logits, params, gen)
                next_tok = torch.where(done, torch.full_like(next_tok, self.pad), next_tok)
                next_lp = torch.where(done, torch.zeros_like(next_lp), next_lp)
                tokens[:, step] = next_tok
                logprobs[:, step] = next_lp
                done = done | (next_tok == self.eos)
                taken = step + 1
                if taken == steps or (taken % self.check_every == 0 and bool(done.all())):
                    break
                s.tok.copy_(next_tok[:, None])
                if step > 0:
                    s.pos.add_(1)
                    s.step.add_(1)
                if s.graph is not None:
                    s.graph.replay()
                    logits = s.logits
                else:
                    logits = self._step_fn(s)
        tokens, logprobs = tokens[:, :taken].cpu(), logprobs[:, :taken].cpu()
        out = RolloutOutput([], [], [])
        for i in range(batch):
            row = tokens[i].tolist()
            length_i = row.index(self.eos) + 1 if self.eos in row else len(row)
            out.response_ids.append(row[:length_i])
            out.response_logprobs.append(logprobs[i, :length_i].tolist())
            out.finished.append(self.eos in row[:length_i])
        return out
