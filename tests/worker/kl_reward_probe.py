"""One real GRPO step with KL in the reward, at the numbers of issue #18's example, in its own process.

    python tests/worker/kl_reward_probe.py SPEC.json WORKDIR OUT.json

The trainer runs unchanged (rollout, reward, reference log-probs, advantages, update) except for two
inputs fixed so the example can be computed by hand: every reward is 1, and the reference model's
log-probs are the real ones shifted so that the k1 KL of response 0 sums to 2 and of response 1 to 0.
The advantages the actor update receives are written to OUT.json.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main() -> int:
    spec_path, workdir, out_path = sys.argv[1:4]
    os.environ.setdefault("RLJOB_METRICS_PORT", "0")
    from rljob_api.validation import parse_spec
    from rljob_worker import run_loop
    from rljob_worker.trainers import grpo as trainer

    spec = parse_spec(json.loads(Path(spec_path).read_text()))
    ctx = run_loop.RunContext(job_name="klprobe", namespace="test", workdir=Path(workdir),
                             checkpoint_uri=f"file://{workdir}/ckpt")
    t = trainer.GRPOTrainer(spec, ctx)
    t.setup()
    t.rewards.default.fn = lambda *args, **kwargs: 1.0  # rewards [1, 1]

    real_ref = t.ref.compute_logprobs
    kl_sums = [2.0, 0.0]

    def shifted_ref(batch, **kw):
        out = real_ref(batch, **kw)
        mask = batch["response_mask"].float()
        shift = mask * (batch["response_mask"].new_tensor(kl_sums).float()[:, None] / mask.sum(-1, keepdim=True))
        out["logprobs"] = out["logprobs"] - shift  # k1 = old - ref = shift, summing to kl_sums per row
        return out

    t.ref.compute_logprobs = shifted_ref
    seen = []
    real_update = t.actor.update

    def recording_update(mini, loss_fn, **kw):
        mask = mini["response_mask"].bool()
        seen.append([mini["advantages"][i][mask[i]].tolist() for i in range(mask.shape[0])])
        return real_update(mini, loss_fn, **kw)

    t.actor.update = recording_update
    metrics = t.train_step()
    Path(out_path).write_text(json.dumps({"advantages": seen, "metrics": metrics}))
    t.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
