"""Rollout with a transformers model: the CPU engine of tests and the quickstart, and a GPU fallback.

A plain KV-cached sampling loop (not `generate()`), so the sampled tokens' log-probs
come out exactly as sampled and the engine stays independent of generation-config
defaults. Weights arrive as HF-named tensors from the megatron actor.
"""
from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Iterable

import torch

from rljob_worker.rollout.base import RolloutOutput, SamplingParams, first_stop
from rljob_worker.rollout.sampling import sample_next
from rljob_worker.rollout.synthetic_lengths import cut_to_budgets, law_from_env

# a Qwen-MoE checkpoint's per-expert weights; transformers 5 holds each layer's experts as fused tensors
_EXPERT_WEIGHT = re.compile(r"(?P<prefix>.*\.experts\.)(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight")


class HFEngine:
    def __init__(self, model_dir: str, *, dtype: torch.dtype, device: torch.device, eos_token_id: int,
                 pad_token_id: int, max_batch: int = 256, record_routing: bool = False):
        """``record_routing``: return each response's routed experts (MoE models; routing replay)."""
        from transformers import AutoModelForCausalLM

        self.device, self.eos, self.pad, self.max_batch = device, eos_token_id, pad_token_id, max_batch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        self._params = dict(self.model.named_parameters())
        self._tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        # transformers renamed `past_key_values` to `cache`; use whichever this version takes.
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.recorder = None
        if record_routing:
            from rljob_worker.rollout.routed_experts import RoutingRecorder

            self.recorder = RoutingRecorder(self.model)

    # -- weights
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], partial: bool = False) -> None:
        seen = set()
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name == "lm_head.weight" and self._tied:
                    continue
                param = self._params.get(name)
                if param is None:
                    param, name = self._fused_expert_slice(name)
                if param.shape != tensor.shape:
                    raise ValueError(f"weight sync: {name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
                param.copy_(tensor.to(param.device, param.dtype))
                seen.add(name)
        missing = set(self._params) - seen - ({"lm_head.weight"} if self._tied else set())
        if missing and not partial:
            raise KeyError(f"weight sync: no tensor for {sorted(missing)[:5]}")

    def _fused_expert_slice(self, name: str) -> tuple[torch.Tensor, str]:
        """A checkpoint's per-expert weight (``...experts.{e}.gate_proj.weight``, up_proj, down_proj) -> its slice
        of the transformers model's fused expert tensor (``experts.gate_up_proj (E, 2I, H)``: gate rows then up
        rows; ``experts.down_proj (E, H, I)``), and the fused tensor's name."""
        match = _EXPERT_WEIGHT.fullmatch(name)
        fused_name = match and match["prefix"] + ("down_proj" if match["proj"] == "down" else "gate_up_proj")
        fused = self._params.get(fused_name) if match else None
        if fused is None:
            raise KeyError(f"weight sync: the HF model has no parameter {name!r}")
        e = int(match["expert"])
        if match["proj"] == "down":
            return fused[e], fused_name
        half = fused.shape[1] // 2
        return (fused[e, :half] if match["proj"] == "gate" else fused[e, half:]), fused_name

    def release_cache(self) -> None:
        """Free the KV cache between rollouts (here it lives only inside generate(): nothing to do)."""

    def sleep(self) -> None:
        if self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def wake_up(self, tags: list[str] | None = None) -> None:
        if self.device.type == "cuda":
            self.model.to(self.device)

    # -- generation
    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> RolloutOutput:
        expanded = [ids for ids in prompt_ids for _ in range(params.n)]
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
        law = law_from_env()  # benchmarks only: long-tailed lengths for a model that never ends a response
        budgets = None if law is None else [law.budget(ids, j, params.seed, params.max_new_tokens)
                                            for ids in prompt_ids for j in range(params.n)]
        out = RolloutOutput([], [], [])
        for start in range(0, len(expanded), self.max_batch):
            chunk_params = params
            if budgets is not None:
                chunk_params = dataclasses.replace(params, max_new_tokens=max(budgets[start : start + self.max_batch]))
            chunk = self._generate_chunk(expanded[start : start + self.max_batch], chunk_params, gen)
            if budgets is not None:
                chunk = cut_to_budgets(chunk, budgets[start : start + self.max_batch], params.max_new_tokens)
            out.extend(chunk)
        return out

    def _left_padded(self, prompts: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Prompts left-padded to ``width`` (every row's next token at the end) -> ids, position ids, real-token
        mask, each (B, width) on the device."""
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        valid = torch.zeros((len(prompts), width), dtype=torch.bool)
        for i, prompt in enumerate(prompts):
            ids[i, width - len(prompt):] = torch.tensor(prompt)
            valid[i, width - len(prompt):] = True
        ids, valid = ids.to(self.device), valid.to(self.device)
        return ids, (valid.long().cumsum(-1) - 1).clamp(min=0), valid

    def _generate_chunk(self, prompts: list[list[int]], params: SamplingParams, gen) -> RolloutOutput:
        batch, width = len(prompts), max(len(p) for p in prompts)
        input_ids, position_ids, valid = self._left_padded(prompts, width)
        attention = valid.long()
        if self.recorder is not None:
            self.recorder.reset()
        tokens = torch.empty((batch, 0), dtype=torch.long, device=self.device)
        logprobs = torch.empty((batch, 0), dtype=torch.float32, device=self.device)
        done = torch.zeros(batch, dtype=torch.bool, device=self.device)
        past, step_input, step_pos = None, input_ids, position_ids
        stops = torch.tensor(sorted({self.eos, *params.stop_token_ids}), dtype=torch.long, device=self.device)
        for _ in range(params.max_new_tokens):
            result = self.model(input_ids=step_input, attention_mask=attention, position_ids=step_pos,
                                use_cache=True, **{self._cache_kw: past})
            past = getattr(result, "cache", None) or result.past_key_values
            next_tok, next_lp = sample_next(result.logits[:, -1, :], params.temperature, params.top_k, params.top_p, gen)
            next_tok = torch.where(done, torch.full_like(next_tok, self.pad), next_tok)
            next_lp = torch.where(done, torch.zeros_like(next_lp), next_lp)
            tokens = torch.cat([tokens, next_tok[:, None]], dim=1)
            logprobs = torch.cat([logprobs, next_lp[:, None]], dim=1)
            done = done | torch.isin(next_tok, stops)
            if bool(done.all()):
                break
            attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
            step_input, step_pos = next_tok[:, None], step_pos[:, -1:] + 1
        out = rows_to_output(tokens.cpu(), logprobs.cpu(), {self.eos, *params.stop_token_ids})
        if self.recorder is not None:
            out.routed_experts = self.recorder.rows(batch, width, [len(p) for p in prompts],
                                                    [len(r) for r in out.response_ids])
        return out


def rows_to_output(tokens: torch.Tensor, logprobs: torch.Tensor, stops: set[int]) -> RolloutOutput:
    """tokens, logprobs (B, steps) -> each row up to and including its first EOS / stop token."""
    out = RolloutOutput([], [], [])
    for i in range(tokens.shape[0]):
        row = tokens[i].tolist()
        length = first_stop(row, stops)
        out.response_ids.append(row[:length])
        out.response_logprobs.append(logprobs[i, :length].tolist())
        out.finished.append(length > 0 and row[length - 1] in stops)
    return out
