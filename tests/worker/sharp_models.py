"""Tiny built-in models with sharp weights, for engine tests that compare tokens: the random-init builtin models'
outputs barely depend on the prompt, so greedy rows would all look alike and hide a wrong key or position."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rljob_worker.data.builtin_models import build_char_tokenizer, materialize_builtin


def sharp_builtin(name: str, tmp_path_factory, seed: int = 0, std: float = 0.5) -> Path:
    """builtin://``name`` materialised, its 2-D weights redrawn from N(0, std) (seeded), saved with its tokenizer."""
    from transformers import AutoModelForCausalLM

    base = materialize_builtin(name, tmp_path_factory.mktemp("tiny") / name)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in model.named_parameters():
            if param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    out = tmp_path_factory.mktemp("sharp")
    model.save_pretrained(out)
    build_char_tokenizer(tools=name == "tiny-qwen2-tools").save_pretrained(out)
    return out


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Decoding a tiny model is many tiny ops: intra-op threads only contend (10x slower on a busy CI box). A test
    module imports this fixture to use it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
