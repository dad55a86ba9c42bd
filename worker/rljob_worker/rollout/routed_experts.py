"""The experts an MoE rollout engine routed each token to, for routing replay (``algorithm.routingReplay``).

Per response the engines return a ``(fed tokens, layers, top-k)`` integer tensor: every token the engine ran
through the model, prompt then response (the last sampled token is never fed), each MoE layer's top-k expert
indices in the router's order. ``layers`` counts all of the HF model's decoder layers; a dense layer's rows hold
:func:`filler`. vLLM returns the same (``enable_return_routed_experts``); :class:`RoutingRecorder` records it
for the transformers engine. :func:`routing_batch` lays the responses out like ``input_ids`` for the trainer.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def expert_dtype(num_experts: int) -> torch.dtype:
    """The narrowest integer type that holds an expert index (the batch carries one per token, layer and k)."""
    return torch.uint8 if num_experts <= 256 else torch.int16


def filler(top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """``(top_k,)`` distinct experts for positions no engine routed (padding, dense layers, the last token):
    their outputs feed no loss position, and distinct indices keep the dispatcher's k-per-token shape."""
    return torch.arange(top_k, dtype=dtype)


def moe_layer_indices(hf_config) -> list[int]:
    """The decoder layers of an HF Qwen2/3-MoE config that route to experts ([] for a dense model)."""
    from rljob_worker.megatron.moe import is_moe, moe_layer_pattern  # no megatron-core import

    return [i for i, has_experts in enumerate(moe_layer_pattern(hf_config)) if has_experts] if is_moe(hf_config) else []


class RoutingRecorder:
    """Records a transformers MoE model's top-k choices while :class:`~.hf_engine.HFEngine` samples.

    A forward hook on each layer's router (``model.layers.{i}.mlp.gate``, which returns ``(logits, weights,
    indices)``) keeps the indices of every forward call; :meth:`rows` turns the prefill and decode calls of one
    batch into per-response tensors."""

    def __init__(self, model):
        config = model.config
        self.num_layers, self.top_k = config.num_hidden_layers, config.num_experts_per_tok
        self.dtype = expert_dtype(config.num_experts)
        self.layers = moe_layer_indices(config)
        if not self.layers:
            raise ValueError(f"routing replay: {type(model).__name__} has no mixture-of-experts layer to record")
        self._calls: dict[int, list[torch.Tensor]] = {i: [] for i in self.layers}
        self._handles = []
        modules = dict(model.named_modules())
        for i in self.layers:
            gate = modules.get(f"model.layers.{i}.mlp.gate")
            if gate is None:
                raise ValueError(f"routing replay: layer {i} of {type(model).__name__} has no mlp.gate router")
            self._handles.append(gate.register_forward_hook(self._hook(i)))

    def _hook(self, layer: int):
        def keep(_module, _inputs, output):
            self._calls[layer].append(output[2].detach().to(self.dtype))  # stays on the device: no sync per step
        return keep

    def reset(self) -> None:
        for calls in self._calls.values():
            calls.clear()

    def rows(self, batch: int, prompt_width: int, prompt_lengths: Sequence[int],
             response_lengths: Sequence[int]) -> list[torch.Tensor]:
        """Per response ``(P_i + R_i - 1, layers, k)`` after a generation whose first call was the prefill of
        ``batch`` left-padded prompts ``prompt_width`` wide, then one call per decode step (token j of a
        response is fed at decode step j + 1)."""
        steps = [torch.stack([self._calls[i][s] for i in self.layers], dim=1).cpu()  # (batch * cols, moe layers, k)
                 for s in range(len(self._calls[self.layers[0]]))]
        prefill = steps[0].view(batch, prompt_width, len(self.layers), self.top_k)
        decode = [s.view(batch, len(self.layers), self.top_k) for s in steps[1:]]
        out = []
        for row, (p, r) in enumerate(zip(prompt_lengths, response_lengths)):
            fed = [prefill[row, prompt_width - p:]] + [d[row][None] for d in decode[:max(r - 1, 0)]]
            moe = torch.cat(fed, dim=0)
            full = filler(self.top_k, self.dtype).repeat(moe.shape[0], self.num_layers, 1)
            full[:, self.layers] = moe
            out.append(full)
        return out

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def from_vllm(routed, num_layers: int, moe_layers: list[int], top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """vLLM's ``CompletionOutput.routed_experts`` (``(tokens, L', k)`` numpy, L' = every layer or only the MoE
    ones) -> ``(tokens, num_layers, k)``."""
    t = torch.as_tensor(routed).to(dtype)
    if t.dim() != 3 or t.shape[2] != top_k:
        raise RuntimeError(f"vLLM returned routed experts of shape {tuple(t.shape)}, expected (tokens, layers, {top_k})")
    if t.shape[1] == num_layers:
        return t
    if t.shape[1] != len(moe_layers):
        raise RuntimeError(f"vLLM returned routed experts for {t.shape[1]} layers; the model has {num_layers} "
                           f"({len(moe_layers)} with experts)")
    full = filler(top_k, dtype).repeat(t.shape[0], num_layers, 1)
    full[:, moe_layers] = t
    return full


def routing_batch(routed: Sequence[torch.Tensor], prompt_lengths: Sequence[int], prompt_width: int,
                  columns: int) -> torch.Tensor:
    """Per-response routed experts -> ``(N, columns, layers, k)`` aligned with ``data.batching.pad_batch``'s
    ``input_ids`` (prompts right-aligned at ``prompt_width``, responses after); unrouted positions hold
    :func:`filler`."""
    if not routed:
        raise ValueError("routing_batch needs at least one response")
    _, layers, k = routed[0].shape
    out = filler(k, routed[0].dtype).repeat(len(routed), columns, layers, 1)
    for i, (r, p) in enumerate(zip(routed, prompt_lengths)):
        start = prompt_width - p
        n = min(r.shape[0], columns - start)
        out[i, start:start + n] = r[:n]
    return out
