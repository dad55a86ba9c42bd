"""Critic scenarios run under torchrun (``python -m torch.distributed.run --nproc-per-node 2
tests/worker/critic_scenarios.py SCENARIO HF_DIR OUT_DIR``), and what they compare, callable in one
process too (the TP=1 reference)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import megatron_helpers as H


def value_loss(values, mb):
    """Clipped value loss of the PPO trainer against fixed returns (old values 0, clip 0.5)."""
    from rljob_api.enums import LossAggregation
    from rljob_worker.algorithms.gae import value_loss as ppo_value_loss

    return ppo_value_loss(values, torch.zeros_like(values), mb["returns"], mb["response_mask"], 0.5,
                          LossAggregation.TOKEN_MEAN)


def critic_steps(hf_dir, parallel, steps: int = 2, export_dir=None) -> dict:
    """Values, ``steps`` updates at micro-batch 2, values again, of :func:`megatron_helpers.varied_batch`;
    then the critic exported as an HF token-classification model into ``export_dir`` when given."""
    from rljob_worker.megatron.critic import MegatronCritic
    from rljob_worker.megatron.engine_config import OptimConfig

    ids, mask = H.varied_batch()
    response = mask.clone()
    response[:, :4] = 0
    returns = torch.linspace(-1, 1, ids.shape[1]).expand(ids.shape).contiguous() * response
    batch = {"input_ids": ids, "attention_mask": mask, "response_mask": response, "returns": returns}
    critic = MegatronCritic.from_hf(hf_dir, parallel=parallel, optim=OptimConfig(lr=1e-2), seed=1,
                                    output_layer_index=2)
    values = critic.compute_values(batch, micro_batch_size=2)
    history = [critic.update(batch, value_loss, micro_batch_size=2) for _ in range(steps)]
    if export_dir is not None:
        critic.save_hf_value_model(export_dir)
    return {"values": values, "history": history, "values_after": critic.compute_values(batch, micro_batch_size=4)}


def _scenario_tp2(hf_dir: str, out_dir: str) -> None:
    import torch.distributed as dist
    from rljob_worker.megatron.engine_config import ParallelConfig

    result = critic_steps(hf_dir, ParallelConfig(tp=2), export_dir=Path(out_dir) / "hf-critic-tp2")
    if dist.get_rank() == 0:
        torch.save(result, Path(out_dir) / "tp2.pt")


SCENARIOS = {"tp2": _scenario_tp2}


def run_torchrun(scenario: str, hf_dir, out_dir, nproc: int = 2, timeout: float = 300) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           f"--master-port={H.free_port()}", __file__, scenario, str(hf_dir), str(out_dir)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun {scenario} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")


if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](sys.argv[2], sys.argv[3])
