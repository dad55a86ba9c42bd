"""Docs generated from the API models must match them; the README's commands must exist."""
from __future__ import annotations

import re
from pathlib import Path

from rljob_api.reference import reference_markdown

REPO = Path(__file__).resolve().parents[1]


def test_reference_is_generated_from_models():
    committed = (REPO / "docs" / "reference.md").read_text()
    assert committed == reference_markdown(), "docs/reference.md is stale: run `rljob explain --markdown > docs/reference.md`"


def test_reference_covers_every_seed_knob():
    text = reference_markdown()
    for knob in ["tensor_model_parallel_size", "use_distributed_optimizer", "param_offload", "rollout.n)",
                 "save_freq", "max_actor_ckpt_to_keep", "resume_mode", "val_before_train", "test_freq",
                 "pipeline_model_parallel_size", "sequence_parallel", "kl_loss_type", "loss_agg_mode",
                 "gpu_memory_utilization", "ppo_micro_batch_size_per_gpu", "override_transformer_config"]:
        assert knob in text, f"seed knob {knob} has no documented home in RLJob.spec"


def test_readme_setup_commands_point_at_real_files():
    readme = (REPO / "README.md").read_text()
    assert "rljob run examples/quickstart.yaml" in readme
    assert "scripts/test" in readme
    for path in re.findall(r"\((docs/[\w./-]+|examples/[\w./-]+|charts/[\w./-]+|e2e/[\w./-]+)\)", readme):
        assert (REPO / path).exists(), f"README links {path}, which does not exist"
