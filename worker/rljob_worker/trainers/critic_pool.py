"""The critic's own process pool (split placement, or a shared critic with its own megatron layout taking
turns), the critic's side: a serve loop on the critic pool's ranks, driven by commands from the actor
leader over the cross-pool group (:mod:`rljob_worker.runtime.pools`), and the actor side's handle on it.

The protocol (every rank of the job takes part in each cross-pool broadcast, in this order)::

    actor leader -> all   {"op": "build", "critic_dir"}      critic leader -> all  {"error": str | None}
    per step:
    actor leader -> all   {"op": "values", "batch"}           input_ids, attention_mask, response_mask (N, T)
    critic leader -> all  {"values" (N, T), "seconds"}        each critic DP rank its rows, gathered
                          (the actor meanwhile computes old / reference log-probs)
    actor leader -> all   {"op": "update", "returns" (N, T), "mini_batches"}
    critic leader -> all  {"metrics"}                          the critic update overlaps the actor update
    actor leader -> all   {"op": "save" | "load" | "export", "path"}  critic leader -> all  {"error": str | None}
    actor leader -> all   {"op": "stop"}

GAE, the token rewards and the advantage whitening stay on the actor side (as in shared placement); the
critic pool only computes values and trains on the returns. Checkpoints: the critic pool writes its part
into the step folder the actor leader names before the actor side uploads and writes COMMIT, so a step
without the critic's part is never committed. SIGTERM on a critic rank is noted, not obeyed: the actor
side decides when to stop, and may still ask for the preemption save.

Colocated pools (the layout's ``colocated``: two processes per GPU) take turns instead of overlapping:
the actor side makes room (offloads what its flags say) before each command and waits for the reply
before its own next GPU work; the critic side onloads for each command and offloads after it (its
critic.megatron offload flags), so one pool's training state at a time holds the GPU.
"""
from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from rljob_worker.data.batching import slice_batch, split_batch, trim_padding
from rljob_worker.runtime.distributed import all_gather_rows
from rljob_worker.runtime.pools import Pools
from rljob_worker.trainers.critic_step import build_critic, update_critic

log = logging.getLogger("rljob.critic_pool")

BATCH_KEYS = ("input_ids", "attention_mask", "response_mask")


class CriticPoolError(RuntimeError):
    """The critic pool could not do what the actor leader asked (its message says what)."""


class CriticPoolClient:
    """The actor pool's handle on the critic pool: every actor rank calls the same methods in the same
    order (the actor leader's arguments are the ones sent). Also stands in for the critic in the
    checkpoint's ``others`` (``save_checkpoint`` / ``load_checkpoint``)."""

    def __init__(self, pools: Pools, make_room: Callable[[], None] | None = None):
        self.cross, self.leader = pools.cross, pools.layout.critic_leader
        self.takes_turns = pools.layout.colocated
        self._make_room = make_room  # colocated pools: the actor side offloads before the critic's turn
        self.is_offloaded = False  # never in the actor pool's offload plan
        self._stopped = False
        self._saving: str | None = None  # the path of a save started by start_checkpoint_save
        self.sent_at = 0.0  # perf_counter() when the last command was handed over (after making room)

    def _send(self, command: dict[str, Any]) -> None:
        if self.takes_turns and self._make_room is not None and command["op"] not in ("build", "stop"):
            self._make_room()
        self.sent_at = time.perf_counter()
        self.cross.broadcast_object(command, src=0)

    def _receive(self) -> Any:
        return self.cross.broadcast_object(None, src=self.leader)

    def _ask(self, command: dict[str, Any]) -> None:
        self._send(command)
        self._check(self._receive())

    @staticmethod
    def _check(reply: dict[str, Any]) -> None:
        if reply["error"] and reply.get("configuration"):
            from rljob_worker.startup_errors import StartupError

            raise StartupError(reply["error"])  # a configuration error of the critic: one line, exit 2
        if reply["error"]:
            raise CriticPoolError(f"critic pool: {reply['error']}")

    def request_build(self, critic_dir: Path) -> None:
        self._send({"op": "build", "critic_dir": str(critic_dir)})

    def wait_built(self) -> None:
        self._check(self._receive())

    def request_values(self, batch: dict[str, torch.Tensor]) -> None:
        self._send({"op": "values", "batch": {k: batch[k] for k in BATCH_KEYS}})

    def values(self) -> tuple[torch.Tensor, float]:
        """The (N, T) old values of the batch sent with :meth:`request_values`, and the critic's seconds."""
        reply = self._receive()
        return reply["values"], reply["seconds"]

    def request_update(self, returns: torch.Tensor, mini_batches: int) -> None:
        self._send({"op": "update", "returns": returns, "mini_batches": mini_batches})

    def update_metrics(self) -> dict[str, float]:
        return self._receive()["metrics"]

    def start_checkpoint_save(self, path: Path) -> None:
        """The critic pool starts writing its part into ``path`` (the actor side writes its own meanwhile);
        colocated pools take turns: the critic's part is written by :meth:`save_checkpoint`, after the actor's."""
        if self.takes_turns:
            return
        self._send({"op": "save", "path": str(path)})
        self._saving = str(path)

    def save_checkpoint(self, path: Path) -> None:
        """Returns once the critic pool's part is written into ``path`` (started here unless already started)."""
        if self._saving != str(path):
            self._send({"op": "save", "path": str(path)})
        self._saving = None
        self._check(self._receive())

    def load_checkpoint(self, path: Path) -> None:
        self._ask({"op": "load", "path": str(path)})

    def save_hf_value_model(self, path: Path) -> None:
        """The critic pool writes the critic as an HF token-classification model into ``path`` (same pod)."""
        self._ask({"op": "export", "path": str(path)})

    def stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            self._send({"op": "stop"})


class CriticPool:
    """The serve loop of one critic-pool rank (see the module docstring)."""

    def __init__(self, spec, pools: Pools):
        self.spec, self.pools = spec, pools
        self.cross, self.leader = pools.cross, pools.layout.critic_leader
        self.is_leader = pools.world_env.rank == self.leader
        self.critic = None
        self._batch: dict[str, torch.Tensor] | None = None
        cm = spec.critic.megatron
        # colocated pools: the critic's state leaves the shared GPU between its turns (as its flags say)
        self._idle_offload = ({"params": cm.param_offload, "grads": cm.grad_offload, "optimizer": cm.optimizer_offload}
                              if pools.layout.colocated else {})

    def run(self) -> int:
        """Serve commands until ``stop``; the process exit code."""
        from rljob_worker.run_loop import torch_dtype

        signal.signal(signal.SIGTERM, self._note_stop_signal)
        self.device = torch.device("cuda", self.pools.cuda_index) if torch.cuda.is_available() else torch.device("cpu")
        self.dtype = torch_dtype(self.spec.model.dtype.value, self.device)
        torch.manual_seed(self.spec.training.seed)
        if self.device.type == "cpu":
            from rljob_worker.megatron.cpu_compat import apply_cpu_patches

            apply_cpu_patches()
        handlers = {"build": self._build, "values": self._values, "update": self._update, "save": self._save,
                    "load": self._load, "export": self._export}
        while True:
            try:
                command = self.cross.broadcast_object(None, src=0)
            except RuntimeError as exc:  # gloo: a peer is gone; the rank that failed reports why, not this one
                log.warning("critic pool: the job stopped without a stop command (%s); exiting",
                            str(exc).split("] ", 1)[-1][:60])
                return 0
            if command["op"] == "stop":
                return 0
            handlers[command["op"]](command)

    def _note_stop_signal(self, signum, _frame) -> None:
        log.warning("critic pool: signal %d noted; the actor side decides when to save and stop", signum)

    def _reply(self, obj: Any) -> None:
        self.cross.broadcast_object(obj if self.is_leader else None, src=self.leader)

    def _answer(self, work) -> None:
        """Run ``work`` and tell the actor side it is done. On failure the critic leader sends the error
        (the actor side raises it) and every failing rank raises: the process exits and torchrun stops
        the job."""
        try:
            work()
        except Exception as exc:
            if self.is_leader:
                from rljob_worker.startup_errors import is_configuration_error

                self._reply({"error": str(exc), "configuration": is_configuration_error(exc)})
            raise
        self._reply({"error": None})

    @contextmanager
    def _turn(self):
        """The critic's state on its GPU for one command; offloaded again after it when the pools share GPUs."""
        if self.critic.is_offloaded:
            self.critic.onload()
        yield
        if any(self._idle_offload.values()):
            self.critic.offload(**self._idle_offload)

    # ------------------------------------------------------------------ commands
    def _build(self, command: dict[str, Any]) -> None:
        def build():
            self.critic = build_critic(self.spec, Path(command["critic_dir"]), self.dtype)
            log.info("critic pool: critic built (TP %d, PP %d, DP %d)", self.critic.tp_size, self.critic.pp_size,
                     self.critic.dp_size)
            if any(self._idle_offload.values()):
                self.critic.offload(**self._idle_offload)

        self._answer(build)

    def _rows(self, n: int) -> slice:
        per_rank = n // self.critic.dp_size
        return slice(self.critic.dp_rank * per_rank, (self.critic.dp_rank + 1) * per_rank)

    def _values(self, command: dict[str, Any]) -> None:
        start = time.perf_counter()
        batch = command["batch"]
        rows = self._rows(batch["input_ids"].shape[0])
        local = slice_batch(batch, rows.start, rows.stop)
        with self._turn():
            local["old_values"] = self.critic.compute_values(local, micro_batch_size=self.spec.critic.micro_batch_size_per_gpu)
        self._batch = local
        values = all_gather_rows(local["old_values"], self.critic.dp_group, self.device)  # (N, T)
        self._reply({"values": values, "seconds": time.perf_counter() - start})

    def _update(self, command: dict[str, Any]) -> None:
        local = self._batch
        rows = self._rows(command["returns"].shape[0])
        local["returns"] = command["returns"][rows]
        minis = [trim_padding(mini) for mini in split_batch(local, command["mini_batches"])]
        with self._turn():
            metrics = update_critic(self.critic, minis, self.spec)
        self._batch = None
        self._reply({"metrics": metrics})

    def _save(self, command: dict[str, Any]) -> None:
        from rljob_worker.checkpoint.run_checkpoints import shield_checkpoint_writer

        def save():
            shield_checkpoint_writer()
            with self._turn():
                self.critic.save_checkpoint(Path(command["path"]))

        self._answer(save)

    def _export(self, command: dict[str, Any]) -> None:
        def export():
            with self._turn():
                self.critic.save_hf_value_model(Path(command["path"]))

        self._answer(export)

    def _load(self, command: dict[str, Any]) -> None:
        def load():
            with self._turn():
                self.critic.load_checkpoint(Path(command["path"]))

        self._answer(load)
