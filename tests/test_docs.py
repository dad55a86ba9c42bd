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


def _readme_commands(tool: str) -> list[list[str]]:
    """Every `tool ...` command in the README's shell blocks and inline code, split into words (comments,
    `&&` chains and `$(...)` dropped)."""
    import shlex

    readme = (REPO / "README.md").read_text()
    pieces = []
    for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", readme, re.DOTALL):
        pieces += [line.split(" #", 1)[0] for line in block.splitlines() if not line.lstrip().startswith("#")]
    pieces += re.findall(r"`([^`\n]+)`", readme)
    out = []
    for piece in pieces:
        for part in re.split(r"&&|\|\||;|\|", piece):
            try:
                words = shlex.split(part)
            except ValueError:
                continue
            if words and words[0] == tool:
                out.append(words)
    return out


def test_readme_rljob_commands_exist_with_their_flags_and_files():
    """Each `rljob SUB ...` in the README names a subcommand and flags the CLI has, and the files it names exist."""
    import glob

    from rljob_cli.main import build_parser

    parser = build_parser()
    subs = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices
    commands = [words for words in _readme_commands("rljob") if len(words) > 1]
    assert len(commands) >= 5, commands
    for words in commands:
        assert words[1] in subs, f"README: `{' '.join(words)}`: rljob has no subcommand {words[1]!r}"
        flags = {s for a in subs[words[1]]._actions for s in a.option_strings}
        for word in words[2:]:
            if word.startswith("--"):
                assert word.split("=", 1)[0] in flags, f"README: `{' '.join(words)}`: {word} is no flag of rljob {words[1]}"
            elif word.startswith(("examples/", "e2e/", "charts/")):
                assert glob.glob(str(REPO / word)), f"README: `{' '.join(words)}`: {word} does not exist"


def test_readme_label_selectors_name_labels_the_operator_sets():
    """`kubectl ... -l KEY=VALUE` in the README selects pods by a label the operator really puts on them."""
    from rljob_api.models import RLJob
    from rljob_operator.builders import build_pytorchjob
    from rljob_operator.settings import OperatorSettings

    job = RLJob.model_validate({"apiVersion": "rljob.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "x"},
                                "spec": {"model": {"path": "/m"}, "data": {"trainFiles": ["/t.parquet"]}}})
    pytorchjob = build_pytorchjob(job, OperatorSettings())
    pod_labels = set()
    for replica in pytorchjob["spec"]["pytorchReplicaSpecs"].values():
        pod_labels |= set(replica["template"]["metadata"]["labels"])
    selectors = [w.split("=", 1)[0] for words in _readme_commands("kubectl")
                 for i, w in enumerate(words) if i and words[i - 1] == "-l"]
    assert selectors, "the README shows no label selector"
    for key in selectors:
        assert key in pod_labels, f"README selects pods by {key!r}; the operator's pod labels are {sorted(pod_labels)}"
