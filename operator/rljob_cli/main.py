"""`rljob` command line.

    rljob validate FILE...      check RLJob manifests; one line per job, every error with its field path;
                                exit 1 on an invalid or not runnable one (--local: also what `rljob run`
                                needs on this machine)
    rljob crd                   print the generated CustomResourceDefinition
    rljob explain [FIELD.PATH]  describe spec fields (like `kubectl explain rlj.spec...`)
    rljob render FILE           print the children the operator would create
    rljob run FILE [--local]    run an RLJob on this machine without Kubernetes
    rljob --version             print the installed rljob version

Other resources in a file (a Secret beside the RLJob) are skipped by validate, render and run alike
(`other_kind`); render and run take one RLJob per file.

Heavy imports (operator builders, the worker) happen inside the subcommands so that
`validate`, `crd` and `explain` need only pydantic and PyYAML.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from rljob_api.advice import spec_notes, spec_warnings
from rljob_api.local_checks import local_problems
from rljob_api.models import API_VERSION, GROUP, KIND
from rljob_api.validation import (
    FieldError,
    RLJobValidationError,
    critic_takes_turns,
    name_errors,
    parse_rljob,
)

from rljob_cli.yaml_load import load_all

DISTRIBUTION = "rljob"  # pyproject.toml's [project] name


def load_documents(path: str) -> list[Any]:
    """YAML documents of a file ('-' for stdin), empty documents dropped. Raises ValueError with a readable message."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"cannot read {path}: not UTF-8 text (byte {exc.start}); save it as UTF-8 YAML") from None
    try:
        return [doc for doc in load_all(text) if doc is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ValueError(f"{path}: malformed YAML{where}: {problem}") from None


def other_kind(doc: Any) -> str | None:
    """The kind of a document that is another resource (a Secret beside the RLJob), which validate, render and
    run skip; None for a document to validate as an RLJob: apiVersion rljob.dev/*, kind rljob in any case (so
    that `kind: rljob` is reported by field), no kind at all, or no mapping."""
    if not isinstance(doc, dict):
        return None
    api, kind = doc.get("apiVersion"), doc.get("kind")
    if (isinstance(api, str) and api.startswith(f"{GROUP}/")) or kind is None or str(kind).lower() == KIND.lower():
        return None
    return str(kind)


def rljob_documents(path: str, docs: list[Any], skipped: Callable[[str], None]) -> list[tuple[str, Any]]:
    """(label, document) of each document to validate as an RLJob; each other resource goes to `skipped` as
    'skipped FILE#i: Secret (not an RLJob)'. The label is FILE, or FILE#i in a file of several documents."""
    out = []
    for index, doc in enumerate(docs):
        label = path if len(docs) == 1 else f"{path}#{index}"
        kind = other_kind(doc)
        if kind is None:
            out.append((label, doc))
        else:
            skipped(f"skipped {label}: {kind} (not an RLJob)")
    return out


def parse_manifest(doc: Any):
    """parse_rljob plus what a manifest needs beyond the API server's object: a metadata.name (the model's default
    is for objects the operator reads, which always have one) that pods and services can take. Raises
    RLJobValidationError with every problem."""
    meta = doc.get("metadata", {}) if isinstance(doc, dict) else None  # a non-mapping: parse_rljob reports it
    missing = ([FieldError("metadata.name", "required; add metadata: {name: my-job}")]
               if isinstance(meta, dict) and "name" not in meta else [])
    try:
        job = parse_rljob(doc)
    except RLJobValidationError as exc:
        raise RLJobValidationError(missing + exc.errors) from None
    errors = missing or name_errors(job.metadata.name, job.spec)
    if errors:
        raise RLJobValidationError(errors)
    return job


def load_rljob(path: str):
    """The single RLJob in a file, validated (other resources are skipped, said on stderr). Raises ValueError /
    RLJobValidationError."""
    docs = rljob_documents(path, load_documents(path), lambda line: print(line, file=sys.stderr))
    if not docs:
        raise ValueError(f"{path}: no RLJob document (apiVersion {API_VERSION}, kind {KIND})")
    if len(docs) > 1:
        raise ValueError(f"{path}: expected exactly one RLJob document, found {len(docs)}; render (and run) one "
                         "RLJob per file: put each in a file of its own")
    return parse_manifest(docs[0][1])


def _critic_summary(s) -> str:
    """', critic shared TP2 PP1' or ', critic split 4/node TP4 PP1' (PPO with a value model)."""
    c = s.critic
    if c is None:
        return ""
    where = (f"split {c.gpus}/node" if c.placement.value == "split" else
             "shared, own processes taking turns" if critic_takes_turns(s) else "shared")
    return (f", critic {where} TP{c.megatron.tensor_model_parallel_size} PP{c.megatron.pipeline_model_parallel_size}"
            + (f" layer {c.output_layer_index}" if c.output_layer_index else ""))


def _rollout_summary(s) -> str:
    """', rollout pool 2/node async <= 2 versions' (rollout.placement separate)."""
    r = s.rollout
    if r.placement.value != "separate":
        return ""
    mode = {"sync": "sync", "one-step": "one-step", "async": f"async <= {r.max_staleness} versions"}[r.mode.value]
    return f", rollout pool {r.gpus}/node {mode}"


def _algorithm_summary(s) -> str:
    """'grpo', 'grpo (rloo)', 'ppo (gae)' or 'sft': the algorithm with the advantage estimator it runs."""
    name, estimator = s.algorithm.name.value, s.algorithm.advantage_estimator.value
    if s.critic:
        return "ppo (gae)"
    return name if name == "sft" or estimator == "grpo" else f"{name} ({estimator})"


def summarize(job) -> str:
    s = job.spec
    m = s.megatron
    data = f"synthetic:{s.data.synthetic.task}" if s.data.synthetic else f"{len(s.data.train_files)} train file(s)"
    return (
        f"{job.metadata.name}: {_algorithm_summary(s)} on {s.model.path}, {s.nnodes}x{s.gpus_per_node} {s.device}, "
        f"TP{m.tensor_model_parallel_size} PP{m.pipeline_model_parallel_size} CP{m.context_parallel_size} "
        + (f"EP{m.expert_model_parallel_size}, {data}" if s.algorithm.name.value == "sft" else
           f"EP{m.expert_model_parallel_size}, samplesPerPrompt={s.rollout.samples_per_prompt}, {data}"
           + _critic_summary(s) + _rollout_summary(s))
    )


def cmd_validate(args: argparse.Namespace) -> int:
    failed = parsed = 0
    for path in args.files:
        try:
            docs = load_documents(path)
        except ValueError as exc:
            print(f"ERROR {exc}")
            failed += 1
            continue
        if not docs:
            print(f"ERROR {path}: no YAML documents")
            failed += 1
        jobs = rljob_documents(path, docs, print)
        if docs and not jobs:
            print(f"ERROR {path}: no RLJob document (apiVersion {API_VERSION}, kind {KIND})")
            failed += 1
        for label, doc in jobs:
            try:
                job = parse_manifest(doc)
            except RLJobValidationError as exc:
                failed += 1
                print(f"INVALID {label}")
                for err in exc.errors:
                    print(f"  {err.path}: {err.message}")
                continue
            problems, unchecked = local_problems(job.spec) if args.local else ([], [])
            print(f"{'OK' if not problems else 'NOT RUNNABLE'} {label}: {summarize(job)}")
            for problem in problems:
                print(f"  NOT RUNNABLE here: {problem}")
            for item in unchecked:
                print(f"  not checked: {item}")
            for warning in spec_warnings(job.spec):
                print(f"  warning: {warning}")
            for note in spec_notes(job.spec):
                print(f"  note: {note}")
            failed += bool(problems)
            parsed += 1
    if parsed and not args.local:
        print("note: local paths not checked (they are the pods'; `rljob validate --local` checks them for "
              "`rljob run`)")
    return 1 if failed else 0


def cmd_crd(args: argparse.Namespace) -> int:
    from rljob_api.crd import crd_yaml

    sys.stdout.write(crd_yaml())
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from rljob_api.explain import explain

    if args.markdown:
        if args.field:  # the Markdown is the whole reference (docs/reference.md), not one field's
            print(f"rljob explain: --markdown prints the whole spec reference and takes no FIELD.PATH; run "
                  f"`rljob explain {args.field}` for that field, or `rljob explain --markdown` alone", file=sys.stderr)
            return 2
        from rljob_api.reference import reference_markdown

        sys.stdout.write(reference_markdown())
        return 0
    try:
        print(explain(args.field or "spec"))
    except KeyError as exc:
        print(f"ERROR {exc.args[0]}")
        return 1
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    from rljob_operator.builders import build_children
    from rljob_operator.settings import OperatorSettings

    try:
        job = load_rljob(args.file)
    except (ValueError, RLJobValidationError) as exc:
        return _report_invalid(args.file, exc)
    try:
        settings = OperatorSettings.from_env()  # the RLJOB_* variables the chart sets on the operator
    except ValueError as exc:  # the message names the variable and its value
        print(f"rljob render: {exc} (render reads the operator's RLJOB_* settings from the environment; fix or "
              "unset it)", file=sys.stderr)
        return 1
    children = build_children(job, settings)
    sys.stdout.write(yaml.safe_dump_all(children, sort_keys=False, width=120))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    try:
        job = load_rljob(args.file)
    except (ValueError, RLJobValidationError) as exc:
        _report_invalid(args.file, exc)
        return 2  # a configuration error, as the worker's own start-up errors
    problems, _ = local_problems(job.spec, args.checkpoint_uri)
    if problems:  # at once, not 13-33 s into the run
        for problem in problems:
            print(f"rljob: {problem}", file=sys.stderr)
        return 2
    from rljob_worker.runtime.launcher import run_local

    return run_local(job, workdir=args.workdir, checkpoint_uri=args.checkpoint_uri, steps=args.steps,
                     fresh=args.fresh)


def _report_invalid(path: str, exc: Exception) -> int:
    print(f"INVALID {path}", file=sys.stderr)
    if isinstance(exc, RLJobValidationError):
        for err in exc.errors:
            print(f"  {err.path}: {err.message}", file=sys.stderr)
    else:
        print(f"  {exc}", file=sys.stderr)
    return 1


def _positive_steps(text: str) -> int:
    try:
        steps = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; give the steps to train, e.g. --steps 10") from None
    if steps < 1:
        raise argparse.ArgumentTypeError(f"{steps} is not >= 1; give the steps to train, e.g. --steps 10 "
                                         "(to only check a job, use `rljob validate`)")
    return steps


def package_version() -> str:
    """The installed distribution's version (pyproject.toml's [project] version), or 'unknown' when rljob runs from
    a source tree that was never installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return "unknown (not installed; pip install -e .)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rljob", description="RL post-training of LLMs as Kubernetes jobs.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("validate", help="validate RLJob manifests (exit 1 on an invalid or not runnable one)")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("--local", action="store_true",
                   help="also check what `rljob run` needs on this machine: local data and model paths, a "
                        "writable checkpoint folder (s3:// objects are not checked)")
    p.set_defaults(func=cmd_validate)
    p = sub.add_parser("crd", help="print the RLJob CustomResourceDefinition")
    p.set_defaults(func=cmd_crd)
    p = sub.add_parser("explain", help="describe RLJob fields, e.g. `rljob explain spec.algorithm`")
    p.add_argument("field", nargs="?", metavar="FIELD.PATH")
    p.add_argument("--markdown", action="store_true",
                   help="print the whole spec reference as Markdown (docs/reference.md; no FIELD.PATH)")
    p.set_defaults(func=cmd_explain)
    p = sub.add_parser("render", help="print the children (ConfigMap, PyTorchJob, ...) the operator would create")
    p.add_argument("file", metavar="FILE")
    p.set_defaults(func=cmd_render)
    p = sub.add_parser("run", help="run an RLJob on this machine (no Kubernetes)")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--local", action="store_true", default=True, help="run locally (the only mode for now)")
    p.add_argument("--workdir", default=None, help="where run outputs go (default ./runs/<name>)")
    p.add_argument("--checkpoint-uri", default=None, help="override spec.checkpoint.uri")
    p.add_argument("--steps", type=_positive_steps, default=None,
                   help="override spec.training.totalTrainingSteps (a whole number >= 1)")
    p.add_argument("--fresh", action="store_true", help="delete this job's checkpoints and outputs first")
    p.set_defaults(func=cmd_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
        sys.stdout.flush()  # here, so that a closed pipe is caught below and not at interpreter exit
    except BrokenPipeError:  # the reader went away (`rljob validate ... | head -1`): stop quietly, as shell tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit-time flush writes nowhere
        return 141  # 128 + SIGPIPE, what a shell reports for a writer killed by it
    return code


if __name__ == "__main__":
    sys.exit(main())
