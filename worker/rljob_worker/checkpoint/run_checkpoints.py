"""The run loop's one face to checkpoints: save, wait, poll, resume and export of a run's models.

A step is saved as megatron distributed-checkpoint files (model, optimizer, RNG; any TP/PP
layout can load them) plus `trainer_state.json` (step, sampler position, metric history),
written to a node-local folder and then committed to storage by `commit.CheckpointManager`
(upload in the background on one node; per-node uploads and a rank-0 commit on several).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rljob_worker.checkpoint.commit import (
    CheckpointError,
    CheckpointManager,
    is_own_step,
    restore_for_resume,
    spec_hash,
    step_dirname,
)
from rljob_worker.checkpoint.lease import CheckpointLease
from rljob_worker.checkpoint.store import LocalStore, StorageError, open_store, remove_temp_files
from rljob_worker.runtime.distributed import barrier, broadcast_object

log = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.json"


class CheckpointContentError(ValueError):
    """A committed checkpoint lacks what this job needs (a configuration error, not a bug)."""


def _utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# Settings a resume must not change: what the weights were trained from and on (the policy's and the
# critic's), their dtype and architecture overrides, the algorithm (SFT's objective included), and what
# decides the data order the sampler position refers to. Learning rates and schedules, steps, saveFreq,
# validation (data.valFiles, data.synthetic.numValPrompts), rollout engine settings, rewards, metrics,
# resources and the parallel layout (megatron checkpoints reshard) may change. A top-level name stands
# for its whole section; tests/checkpoint/test_resume_fields.py classifies every spec field.
RESUME_FIXED_FIELDS = (
    "model.path", "model.tokenizerPath", "model.dtype",
    "data.trainFiles", "data.synthetic.task", "data.synthetic.numPrompts", "data.promptKey",
    "data.maxPromptLength", "data.promptOverflow", "data.applyChatTemplate", "data.shuffle",
    "algorithm",
    "sft.format", "sft.responseKey", "sft.messagesKey", "sft.maxLength", "sft.overflow", "sft.lossOnPromptTokens",
    "sft.packing",
    "rollout.samplesPerPrompt",
    "training.trainBatchSizePerNode", "training.seed",
    "megatron.overrideTransformerConfig",
    "critic.model.path", "critic.outputLayerIndex", "critic.cliprangeValue", "critic.megatron.overrideTransformerConfig",
    # LoRA: what the saved adapters are (their shapes, their scale); whether there are adapters at all
    "lora.rank", "lora.alpha", "lora.targetModules", "critic.lora.rank", "critic.lora.alpha", "critic.lora.targetModules",
)


def resume_fixed_fields(spec_json: dict[str, Any]) -> dict[str, Any]:
    """The values of RESUME_FIXED_FIELDS in a spec dumped by alias; a section becomes one entry per field."""
    out: dict[str, Any] = {}
    for path in RESUME_FIXED_FIELDS:
        value: Any = spec_json
        for part in path.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if isinstance(value, dict) and "." not in path:
            out.update({f"{path}.{k}": v for k, v in value.items()})
        else:
            out[path] = value
    return out




_writer_managers: list = []  # keeps the shielded multiprocessing Manager of megatron's writer alive


def shield_checkpoint_writer() -> None:
    """Start megatron's checkpoint-writer results queue in a Manager process that ignores SIGTERM.

    megatron-core's async filesystem writer keeps a spawned multiprocessing Manager for its results
    queue, created at the first save. torchrun sends SIGTERM to each worker's whole process group,
    so after one periodic save the preemption signal killed that Manager too and the preemption save
    died with BrokenPipeError (exit 1, up to saveFreq steps lost). Created here first, the Manager
    ignores the signal and goes away with the worker."""
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        return
    if getattr(filesystem_async, "_results_queue", None) is not None or not hasattr(filesystem_async, "_results_queue"):
        return
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from rljob_worker.runtime.process_guard import ignore_stop_signals

    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    manager.start(initializer=ignore_stop_signals)
    filesystem_async._results_queue = manager.Queue()
    _writer_managers.append(manager)


class RunCheckpoints:
    def __init__(self, spec, ctx, env):
        self.spec, self.env = spec, env
        self.uri = ctx.checkpoint_uri or spec.checkpoint.uri
        self.store = open_store(self.uri, endpoint_url=spec.s3.endpoint, region=spec.s3.region)
        # The owner of the steps this run saves: the RLJob's uid (its restarted pods continue its run
        # even with resumeMode disable), or for `rljob run` the launcher's run id.
        owner = os.environ.get("RLJOB_UID") or os.environ.get("RLJOB_RUN_ID") or None
        self.manager = CheckpointManager(self.store, base_prefix=f"{ctx.namespace}/{ctx.job_name}",
                                         max_to_keep=spec.checkpoint.max_to_keep or None, owner=owner)
        self.local_root = Path(ctx.workdir) / "checkpoints"
        spec_json = spec.model_dump(mode="json", by_alias=True)
        self.spec_hash = spec_hash(spec_json)
        self.spec_fields = resume_fixed_fields(spec_json)
        self.multi_node = spec.nnodes > 1
        self.last_ref = None
        self.seed_uri: str | None = None  # the step resume() loaded when it is resumeFrom's, not the job's own
        self.last_committed: dict[str, Any] | None = None  # {"step", "uri", "time"} of the newest commit (rank 0)
        self._pending = None  # SaveHandle of the upload in flight (rank 0, one node)
        self._fresh = False  # a commit nobody has polled yet
        self.lease = None  # rank 0: the CheckpointLease on the job prefix

    @property
    def quarantined(self) -> list[dict[str, Any]]:
        """Steps set aside as corrupt during resume (rank 0), newest last."""
        return self.manager.quarantined

    def check_access(self) -> None:
        """Fail at start-up, not at the first save, when storage is unreachable or credentials are wrong."""
        if self.env.rank == 0:
            self.store.check_access("spec.checkpoint.uri", write=True)

    def save(self, step: int, actor, trainer_state: dict[str, Any], metrics: dict[str, float],
             others: dict[str, Any] | None = None):
        """Save the actor (and ``others``, e.g. ``{"critic": critic}``, each in its own sub-folder) and the
        trainer state into one step folder; its one COMMIT covers them all."""
        if self.lease is not None:
            self.lease.check()
        local = self.local_root / step_dirname(step)
        if self.env.local_rank == 0 and local.exists():
            shutil.rmtree(local)
        barrier()
        shield_checkpoint_writer()
        for name, model in (others or {}).items():  # a model saved by other ranks (a split critic) writes meanwhile
            if hasattr(model, "start_checkpoint_save"):
                model.start_checkpoint_save(local / name)
        actor.save_checkpoint(local)  # collective; rank 0 writes the common metadata
        for name, model in (others or {}).items():  # (a split critic: waits until its part is written)
            model.save_checkpoint(local / name)
        if self.env.rank == 0:
            (local / TRAINER_STATE).write_text(json.dumps(trainer_state))
        if not self.multi_node:
            if self.env.rank == 0:
                handle = self.manager.commit_folder(local, step, metrics, self.spec_hash, remove_local=True,
                                           spec_fields=self.spec_fields)
                self._pending = handle
                log.info("checkpoint step %d: uploading to %s in the background", step, handle.uri)
                return handle
            return None
        # Several nodes: each node uploads what its ranks wrote, then rank 0 commits.
        if self.env.rank == 0:
            self.manager.prepare_step(step)
        barrier()
        if self.env.local_rank == 0:
            self.manager.upload_rank_files(local, step, self.env.node_rank)
        barrier()
        ref = None
        if self.env.rank == 0:
            ref = self.manager.commit(step, metrics, self.spec_hash, expected_ranks=list(range(self.spec.nnodes)),
                                      spec_fields=self.spec_fields)
            self.manager.apply_retention()
            self._committed(ref)
        barrier()
        return ref

    def _committed(self, ref) -> None:
        self.last_ref = ref
        self.last_committed = {"step": ref.step, "uri": ref.uri, "time": _utc_now()}
        self._fresh = True

    def _collect(self) -> None:
        if self._pending is not None and self._pending.done():
            handle, self._pending = self._pending, None
            self._committed(handle.wait())  # re-raises an upload error

    def poll(self) -> dict[str, Any] | None:
        """Rank 0: the newest checkpoint if it committed since the last poll (else None). Raises upload errors."""
        self._collect()
        if self._fresh:
            self._fresh = False
            return self.last_committed
        return None

    def wait(self):
        if self.env.rank == 0 and self._pending is not None:
            self.manager.wait_for_commit()
            self._collect()  # leaves the commit for the trainer's next poll()
        barrier()
        return self.last_ref

    def _remove_stale_temp_files(self) -> None:
        """Half-written files of killed runs, in the local checkpoint folders and (file:// URIs) the job prefix."""
        folders = [self.local_root]
        if isinstance(self.store, LocalStore):
            folders.append(self.store.root / self.manager.base_prefix)
        removed = [p for folder in folders if folder.exists() for p in remove_temp_files(folder)]
        if removed:
            log.info("removed %d partial files left by an earlier, killed run (e.g. %s)", len(removed), removed[0])

    def resume(self, actor, others: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """Load the checkpoint the spec asks for (auto / uri / disable); returns the trainer state or None.
        ``others`` (e.g. ``{"critic": critic}``) load from their sub-folders, which must be there: a step
        saved without them (a GRPO checkpoint for a PPO job) is refused, never half-loaded."""
        ck = self.spec.checkpoint
        local = self.local_root / "restore"
        choice: dict[str, Any] = {"uri": None}
        if self.env.rank == 0:  # chooses, verifies (falling back past corrupt steps) and downloads
            shutil.rmtree(local, ignore_errors=True)
            try:
                # One writer per prefix, taken after the configuration checks and before resume
                # moves or quarantines anything.
                self.lease = CheckpointLease(self.store, self.manager.base_prefix)
                self.lease.acquire()
                self._remove_stale_temp_files()
                ref = restore_for_resume(self.manager, ck.resume_mode.value, ck.resume_from, local, self.spec_fields)
                choice = {"uri": ref.uri if ref is not None else None,
                          "seed": ref is not None and not is_own_step(self.manager, ref)}
            except (StorageError, ValueError) as e:  # the other ranks stop too instead of waiting forever
                broadcast_object({"error": str(e)})
                raise
        choice = broadcast_object(choice)
        if "error" in choice:
            raise CheckpointError(choice["error"])
        uri = choice["uri"]
        if uri is None:
            return None
        self.seed_uri = uri if choice["seed"] else None  # resumeFrom's step, not one of the job's own
        if self.env.local_rank == 0 and self.env.rank != 0:  # the other nodes download the chosen step
            shutil.rmtree(local, ignore_errors=True)
            self.manager.restore(uri, local)
        barrier()
        for name in others or {}:
            if not (local / name).is_dir():
                raise CheckpointContentError(
                    f"checkpoint {uri} has no {name} (it was saved by a job without one); resume from a step saved "
                    f"with the {name} (spec.checkpoint.resumeFrom), or start fresh (resumeMode: disable)")
        actor.load_checkpoint(local)
        for name, model in (others or {}).items():
            model.load_checkpoint(local / name)
        state = json.loads((local / TRAINER_STATE).read_text())
        barrier()
        if self.env.rank == 0:
            log.info("resumed from %s", uri)
        return state

    def export_hf(self, actor, tokenizer, model_dir: Path) -> str | None:
        """Write the final policy as an HF folder and upload it to <job prefix>/hf/. With LoRA that folder is
        the PEFT adapter (and with spec.lora.exportMerged the merged model goes to <job prefix>/hf-merged/).
        Collective."""
        lora = self.spec.lora if getattr(actor, "lora", None) is not None else None
        if lora is None:
            return self._export("hf", lambda local: actor.save_hf_checkpoint(local, tokenizer=tokenizer),
                                "the final policy in Hugging Face format")

        def adapter(local: Path) -> None:
            actor.save_peft_adapter(local)
            if self.env.rank == 0 and tokenizer is not None:
                tokenizer.save_pretrained(local)

        uri = self._export("hf", adapter, "the final LoRA adapter in PEFT format")
        if lora.export_merged:
            self._export("hf-merged", lambda local: actor.save_hf_checkpoint(local, tokenizer=tokenizer),
                         "the final policy with its adapters merged, in Hugging Face format")
        return uri

    def export_critic(self, critic, tokenizer) -> str | None:
        """Write the final critic as an HF token-classification model and upload it to <job prefix>/hf-critic/.
        ``critic``: the megatron critic, or a critic pool's handle (its ranks write the folder). Collective."""
        def write(local: Path) -> None:
            critic.save_hf_value_model(local)
            if self.env.rank == 0 and tokenizer is not None:
                tokenizer.save_pretrained(local)

        return self._export("hf-critic", write, "the final critic as a Hugging Face token-classification model")

    def _export(self, name: str, write, what: str) -> str | None:
        local = self.local_root / name
        if self.env.rank == 0:
            shutil.rmtree(local, ignore_errors=True)
        barrier()
        write(local)
        key = f"{self.manager.base_prefix}/{name}"
        uri = None
        if self.env.rank == 0:
            self.store.delete_prefix(key + "/")
            self.store.upload_dir(local, key)
            uri = self.store.uri_for(key)
            log.info("exported %s to %s", what, uri)
        barrier()
        return uri
