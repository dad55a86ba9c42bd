"""Split placement's process groups: the rank mapping of the two pools (one and two nodes, against the API's
pool_ranks), and, on three real gloo processes without torchrun (global rank 0 hosts the store), each pool's
own default group and the cross-pool group's broadcasts."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from rljob_api.validation import parse_spec, pool_ranks
from rljob_worker.runtime.distributed import DistEnv
from rljob_worker.runtime.pools import ACTOR, CRITIC, PoolLayout

sys.path.insert(0, str(Path(__file__).parent))
import megatron_helpers as H


def split_spec(nnodes: int, gpus: int, critic_gpus: int):
    return parse_spec({"nnodes": nnodes, "gpusPerNode": gpus, "model": {"path": "builtin://tiny-qwen2"},
                       "data": {"synthetic": {"task": "target-token"}},
                       "algorithm": {"advantageEstimator": "gae"},
                       "training": {"trainBatchSizePerNode": 6, "ppoMiniBatchSizePerNode": 6},
                       "critic": {"placement": "split", "gpus": critic_gpus}})


def test_one_node_first_local_ranks_are_the_actor_pool():
    layout = PoolLayout.from_spec(split_spec(1, 4, 1))
    assert (layout.actor_per_node, layout.critic_per_node, layout.world_size) == (3, 1, 4)
    assert [layout.role(g) for g in range(4)] == [ACTOR, ACTOR, ACTOR, CRITIC]
    envs = [layout.pool_env(DistEnv(nnodes=1, node_rank=0, nproc_per_node=4, local_rank=g)) for g in range(4)]
    assert [(e.rank, e.world_size, e.local_rank) for e in envs] == [(0, 3, 0), (1, 3, 1), (2, 3, 2), (0, 1, 0)]
    assert layout.critic_leader == 3


def test_two_nodes_each_pool_spans_both_nodes():
    spec = split_spec(2, 4, 2)
    layout = PoolLayout.from_spec(spec)
    actor, critic = pool_ranks(spec)  # the API's statement of the same contract
    assert layout.global_ranks(ACTOR) == actor == [0, 1, 4, 5]
    assert layout.global_ranks(CRITIC) == critic == [2, 3, 6, 7]
    pool = {}
    for g in range(8):
        e = layout.pool_env(DistEnv(nnodes=2, node_rank=g // 4, nproc_per_node=4, local_rank=g % 4))
        pool[g] = (layout.role(g), e.rank, e.world_size, e.node_rank, e.local_rank)
    assert pool == {0: (ACTOR, 0, 4, 0, 0), 1: (ACTOR, 1, 4, 0, 1), 4: (ACTOR, 2, 4, 1, 0), 5: (ACTOR, 3, 4, 1, 1),
                    2: (CRITIC, 0, 4, 0, 0), 3: (CRITIC, 1, 4, 0, 1), 6: (CRITIC, 2, 4, 1, 0),
                    7: (CRITIC, 3, 4, 1, 1)}
    assert layout.critic_leader == 2


def test_a_torchrun_world_of_another_shape_is_refused():
    with pytest.raises(ValueError, match="needs torchrun to run 1 x 3 processes, this process is one of 1 x 4"):
        PoolLayout(1, 2, 1).pool_env(DistEnv(nnodes=1, node_rank=0, nproc_per_node=4, local_rank=0))


def _member(local_rank: int, port: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from rljob_worker.runtime.pools import init_pools

    env = DistEnv(nnodes=1, node_rank=0, nproc_per_node=3, local_rank=local_rank, master_port=port)
    pools = init_pools(env, PoolLayout(1, 2, 1), backend="gloo", timeout_s=60)
    ones = torch.ones(1)
    dist.all_reduce(ones)  # over this process's pool only
    from_actor = pools.cross.broadcast_object({"op": "values", "x": torch.arange(3)} if env.rank == 0 else None, src=0)
    from_critic = pools.cross.broadcast_object(f"from rank {env.rank}", src=pools.layout.critic_leader)
    Path(out_dir, f"{env.rank}.json").write_text(json.dumps({
        "role": pools.role, "pool_rank": dist.get_rank(), "pool_size": dist.get_world_size(), "sum": ones.item(),
        "from_actor": [from_actor["op"], from_actor["x"].tolist()], "from_critic": from_critic}))
    dist.destroy_process_group()


def test_pools_without_torchrun_have_their_own_default_groups_and_one_cross_group(tmp_path):
    mp.start_processes(_member, args=(H.free_port(), str(tmp_path)), nprocs=3, start_method="spawn")
    got = {g: json.loads((tmp_path / f"{g}.json").read_text()) for g in range(3)}
    assert [(got[g]["role"], got[g]["pool_rank"], got[g]["pool_size"], got[g]["sum"]) for g in range(3)] == [
        (ACTOR, 0, 2, 2.0), (ACTOR, 1, 2, 2.0), (CRITIC, 0, 1, 1.0)]
    assert all(got[g]["from_actor"] == ["values", [0, 1, 2]] and got[g]["from_critic"] == "from rank 2"
               for g in range(3))
