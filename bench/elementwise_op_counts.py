"""CPU op census of one actor update (tiny 2-layer qwen2, one micro-batch, fp32) with the compiled
RMSNorm / RoPE / SwiGLU off (0) and on (1): how many aten ops the profiler sees, most frequent first.
Counts, not times (a CPU profile says which ops remain, not what they cost on a GPU).

    PYTHONPATH=operator:worker python bench/elementwise_op_counts.py 0   # then 1
"""
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "worker"))
import megatron_helpers as H
from rljob_worker.megatron.actor import MegatronActor, OptimConfig, ParallelConfig

fused = sys.argv[1] == "1"
hf = H.make_tiny_hf_model("qwen2", Path("/tmp/elementwise_op_counts_qwen2"), seed=3)
actor = MegatronActor.from_hf(hf, ParallelConfig(), OptimConfig(lr=1e-3), seed=1, fused_elementwise=fused)
ids, mask = H.varied_batch()
batch = {"input_ids": ids, "attention_mask": mask}
for _ in range(2):
    actor.update(batch, H.seq_nll_loss, micro_batch_size=8)
from torch.profiler import ProfilerActivity, profile

with profile(activities=[ProfilerActivity.CPU]) as prof:
    actor.update(batch, H.seq_nll_loss, micro_batch_size=8)
top = collections.Counter()
for e in prof.key_averages():
    if e.key.startswith("aten::") or "Compiled" in e.key or "CompiledFunction" in e.key:
        top[e.key] = e.count
print("fused" if fused else "eager", sum(top.values()))
for k, v in top.most_common(45):
    print(f"{v:5d} {k}")
