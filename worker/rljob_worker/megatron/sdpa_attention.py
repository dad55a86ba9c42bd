"""Core attention for megatron's local layer spec on ``torch.nn.functional.scaled_dot_product_attention``.

megatron-core's local ``DotProductAttention`` materialises the full ``[b, heads, s, s]`` score matrix
(measured 2.8x slower and 13 GiB more memory than SDPA at 0.5B, seq 2048 on an H100; see
BASELINES.md). This module is a drop-in ``core_attention`` for ``SelfAttention``: same constructor
and call signature, no parameters, so checkpoints are unaffected. SDPA picks a flash / memory-
efficient kernel on GPU and is exact math on CPU.

Masks follow megatron's convention: ``attention_mask`` is boolean with ``True`` = masked out,
broadcastable to ``[b, heads, sq, sk]``; ``None`` with a causal mask type means plain causal (the
actor always runs this way: it packs each row's real tokens to the front, so no padding mask is
needed).

Kernel choice on a GPU: flash first (``RLJOB_ATTENTION_BACKEND=flash``, the default), torch's order
otherwise (``auto``). torch's own order puts cuDNN first on Hopper, and cuDNN builds an execution plan
for every new sequence length: 115-270 ms for each new length at the 1.5B shape (bench/sdpa_shapes.py,
H200), where the forward and backward take ~1 ms. A GRPO micro-batch is cut to its longest row, so its
length is new most of the time; flash has no per-length cost and ran 4% slower at lengths it had seen
(bench/NOTES.md, session 12). A GPU without flash for the dtype (fp32) falls through to the next kernel.

Concatenated sequences (megatron's ``thd`` format, ``packed_seq_params`` from
:meth:`.packing.Segments.seq_params`): query ``[t, heads, d]`` holds several rows one after another and
each attends causally within its own segment. On a GPU in half precision that is flash attention's
variable-length kernel (one launch for every segment); elsewhere each
segment runs SDPA on its own, the same call the rows layout makes for that row.

Context parallelism (``context_parallel_size = cp > 1``): each CP rank holds chunks ``r`` and
``2 cp - 1 - r`` of the sequence (see :mod:`.context_parallel`). Keys and values are all-gathered
over the CP group (the backward sums their gradients back to the owning rank) and each local query
chunk ``i`` attends to the key prefix ``[0, (i + 1) c)`` with a lower-right causal mask, i.e. the
causal mask on global positions: the result equals ``cp = 1``. RoPE has already been applied with
the global positions by megatron (``get_pos_emb_on_this_cp_rank``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide
from torch.nn.attention.bias import causal_lower_right

from .context_parallel import chunk_indices, gather_from_cp

ATTENTION_BACKEND_VAR = "RLJOB_ATTENTION_BACKEND"


@functools.cache
def flash_first() -> bool:
    """Whether GPU attention asks for the flash kernel first (the module docstring says why)."""
    choice = os.environ.get(ATTENTION_BACKEND_VAR, "flash")
    if choice not in ("flash", "auto"):
        raise ValueError(f"{ATTENTION_BACKEND_VAR}={choice!r}: use flash (the default: no per-length plan "
                         "to build) or auto (torch's own order, cuDNN first on Hopper)")
    return choice == "flash"


def _kernel_order(on_gpu: bool):
    """A context choosing SDPA's kernel: flash, then cuDNN, memory-efficient, math (a GPU with flash_first);
    torch's choice elsewhere (CPU kernels are left as they are)."""
    if not (on_gpu and flash_first()):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                        SDPBackend.MATH], set_priority=True)


def varlen_causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                  max_len: int, scale: float) -> torch.Tensor:
    """Flash attention's variable-length kernel, causal in each segment: ``query [t, h, d]``, ``key/value
    [t, g, d]`` (g divides h: query head i reads kv head i // (h / g), as megatron), ``cu_seqlens (n + 1,)
    int32`` -> ``[t, h, d]``. The aten op itself (differentiable in C++): ``torch.nn.attention.varlen.varlen_attn``
    wraps the same kernel in a Python custom op whose dispatch costs more host time per call than a small
    model's layer takes on the GPU (measured at 0.5B, bench/NOTES.md)."""
    cu = cu_seqlens.to(device=query.device, dtype=torch.int32)
    return torch.ops.aten._flash_attention_forward(query, key, value, cu, cu, max_len, max_len, 0.0, True, False,
                                                   scale=scale)[0]


class SDPAttention(MegatronModule):
    """Causal/GQA attention. Inputs ``[s, b, heads, head_dim]``; output ``[sq, b, heads*head_dim]``."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ) -> None:
        super().__init__(config=config)
        if config.window_size is not None:
            raise ValueError("SDPAttention does not support sliding-window attention")
        if pg_collection is not None and hasattr(pg_collection, "tp"):
            tp_size = pg_collection.tp.size()
        else:
            from megatron.core import parallel_state

            tp_size = parallel_state.get_tensor_model_parallel_world_size()
        if pg_collection is not None and hasattr(pg_collection, "cp"):
            self.cp_group = pg_collection.cp
        else:
            from megatron.core import parallel_state

            self.cp_group = parallel_state.get_context_parallel_group(check_initialized=False)
        self.cp_size = 1 if self.cp_group is None else self.cp_group.size()
        if self.cp_size != config.context_parallel_size:
            raise ValueError(
                f"SDPAttention: the CP group has {self.cp_size} ranks, the config says "
                f"context_parallel_size={config.context_parallel_size}"
            )
        self.attn_mask_type = attn_mask_type
        self.num_heads = divide(config.num_attention_heads, tp_size)
        self.num_groups = divide(config.num_query_groups, tp_size)
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        if config.apply_query_key_layer_scaling:
            raise ValueError("SDPAttention does not support apply_query_key_layer_scaling")
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise NotImplementedError("SDPAttention does not support attention bias")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if packed_seq_params is not None:
            segments = getattr(packed_seq_params, "segments", None)
            if (segments is None or packed_seq_params.qkv_format != "thd" or attention_mask is not None
                    or mask_type != AttnMaskType.causal or self.cp_size > 1):
                raise NotImplementedError("SDPAttention runs packed sequences as causal segments (thd, "
                                          "packing.Segments, no context parallelism) only")
            return self._forward_segments(query, key, value, segments)
        sq, b = query.shape[0], query.shape[1]
        if self.cp_size > 1:
            if attention_mask is not None or mask_type != AttnMaskType.causal:
                raise NotImplementedError(
                    "SDPAttention with context parallelism runs plain causal attention only"
                )
            return self._forward_cp(query, key, value)
        # [s, b, h, d] -> [b, h, s, d]
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        if attention_mask is None:
            attn_mask, is_causal = None, mask_type == AttnMaskType.causal and sq > 1
        else:
            attn_mask, is_causal = ~attention_mask.bool(), False
        dropout_p = self.dropout_p if self.training else 0.0
        kwargs = {
            "attn_mask": attn_mask,
            "dropout_p": dropout_p,
            "is_causal": is_causal,
            "scale": self.softmax_scale,
        }
        if self.num_heads != self.num_groups:
            kwargs["enable_gqa"] = True  # query head h reads kv group h // (heads / groups), as megatron
        with _kernel_order(q.is_cuda):
            if dropout_p > 0.0:
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    out = F.scaled_dot_product_attention(q, k, v, **kwargs)
            else:
                out = F.scaled_dot_product_attention(q, k, v, **kwargs)
        # [b, h, sq, d] -> [sq, b, h*d]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    def _forward_segments(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments) -> torch.Tensor:
        """Causal attention within each segment of a concatenated sequence.

        ``query [t, h, d]``, ``key/value [t, g, d]`` (megatron's thd format), segments: :class:`.packing.Segments`
        -> ``[t, h*d]``."""
        t = query.shape[0]
        dropout_p = self.dropout_p if self.training else 0.0
        if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and dropout_p == 0.0:
            cu = segments.cu_seqlens.to(query.device)
            out = varlen_causal(query, key, value, cu, segments.max_len, self.softmax_scale)
            return out.reshape(t, -1)
        kwargs = {"dropout_p": dropout_p, "is_causal": True, "scale": self.softmax_scale}
        if self.num_heads != self.num_groups:
            kwargs["enable_gqa"] = True
        outs, start = [], 0
        for n in segments.lengths:  # [n, h, d] -> [1, h, n, d], as the rows layout runs a row
            q, k, v = (x[start:start + n].permute(1, 0, 2)[None] for x in (query, key, value))
            with _kernel_order(q.is_cuda):
                if dropout_p > 0.0:
                    with tensor_parallel.get_cuda_rng_tracker().fork():
                        outs.append(F.scaled_dot_product_attention(q, k, v, **kwargs))
                else:
                    outs.append(F.scaled_dot_product_attention(q, k, v, **kwargs))
            start += n
        return torch.cat([o[0].permute(1, 0, 2) for o in outs]).reshape(t, -1)

    def _forward_cp(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Causal attention of this CP rank's two query chunks against the all-gathered keys.

        ``query [2c, b, h, d]``, ``key/value [2c, b, g, d]`` (this rank's chunks) -> ``[2c, b, h*d]``.
        """
        sq, b = query.shape[0], query.shape[1]
        c = sq // 2
        # [T, b, g, d] in global order -> [b, g, T, d]
        k = gather_from_cp(key, self.cp_group, dim=0).permute(1, 2, 0, 3)
        v = gather_from_cp(value, self.cp_group, dim=0).permute(1, 2, 0, 3)
        if self.num_heads != self.num_groups:
            # torch's lower-right causal kernels take no enable_gqa: give each query head its kv head
            # (head h reads group h // (heads / groups), as megatron)
            k = k.repeat_interleave(self.num_heads // self.num_groups, dim=1)
            v = v.repeat_interleave(self.num_heads // self.num_groups, dim=1)
        q = query.permute(1, 2, 0, 3)  # [b, h, 2c, d]
        dropout_p = self.dropout_p if self.training else 0.0
        outs = []
        for local, i in enumerate(chunk_indices(self.cp_size, self.cp_group.rank())):
            kv_len = (i + 1) * c  # chunk i's queries (global positions [i c, (i+1) c)) see keys [0, (i+1) c)
            args = (q[:, :, local * c : (local + 1) * c], k[:, :, :kv_len], v[:, :, :kv_len])
            kwargs = {
                "attn_mask": causal_lower_right(c, kv_len),
                "dropout_p": dropout_p,
                "scale": self.softmax_scale,
            }
            with _kernel_order(q.is_cuda):
                if dropout_p > 0.0:
                    with tensor_parallel.get_cuda_rng_tracker().fork():
                        outs.append(F.scaled_dot_product_attention(*args, **kwargs))
                else:
                    outs.append(F.scaled_dot_product_attention(*args, **kwargs))
        out = torch.cat(outs, dim=2)
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        return {}
