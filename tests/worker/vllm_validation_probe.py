"""A real GRPO trainer whose rollout engine is the real VLLMEngine over the stand-in vLLM of test_vllm_engine.py,
sleeping at level 2 (its weights dropped while the actor trains): validate, step, validate, step, in a process of
its own (vLLM serves one sleep-mode engine per process).

    python tests/worker/vllm_validation_probe.py SPEC.json WORKDIR OUT.json

Writes the stand-in's call log and the steps' metrics to OUT.json. A rollout that found the engine's weights
dropped with no weight sync since fails in VLLMEngine.generate, and this process exits non-zero.
"""
from __future__ import annotations

import importlib.machinery
import json
import os
import sys
import types
from pathlib import Path


def install_stand_in_vllm():
    """The stand-in as the test's fixture installs it, sampling tokens of the trainer's vocabulary."""
    sys.path.insert(0, str(Path(__file__).parent))
    import test_vllm_engine as stand_in
    from rljob_worker.data.builtin_models import EOS, VOCAB

    eos = VOCAB.index(EOS)

    class InVocabLLM(stand_in.FakeLLM):
        def generate(self, prompts, sampling_params, use_tqdm=True):
            out = []
            for prompt, sp in zip(prompts, sampling_params):
                ids = prompt["prompt_token_ids"]
                samples = []
                for j in range(sp.n):
                    first = 2 + (ids[-1] + j) % (len(VOCAB) - 2)  # a character, never pad or EOS
                    tokens = [first, eos][:sp.max_tokens]
                    lps = [{t: stand_in.FakeLogprob(-0.5 - 0.1 * k)} for k, t in enumerate(tokens)]
                    samples.append(stand_in.FakeCompletion(j, tokens, lps, "stop" if tokens[-1] == eos else "length"))
                out.append(stand_in.FakeRequestOutput(ids, samples))
            self.log.append("generate")
            return out

    module = types.ModuleType("vllm")
    module.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    module.LLM, module.SamplingParams, module.__version__ = (InVocabLLM, stand_in.FakeSamplingParams,
                                                             stand_in.FAKE_VLLM_VERSION)
    sys.modules["vllm"] = module
    return InVocabLLM


def main() -> int:
    spec_path, workdir, out_path = sys.argv[1:4]
    os.environ.setdefault("RLJOB_METRICS_PORT", "0")
    os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    llm_class = install_stand_in_vllm()
    from rljob_api.validation import parse_spec
    from rljob_worker import run_loop
    from rljob_worker.rollout.vllm_engine import VLLMEngine
    from rljob_worker.trainers import grpo as trainer

    spec = parse_spec(json.loads(Path(spec_path).read_text()))
    ctx = run_loop.RunContext(job_name="vllmprobe", namespace="test", workdir=Path(workdir),
                              checkpoint_uri=f"file://{workdir}/ckpt")
    t = trainer.GRPOTrainer(spec, ctx)
    t.setup()
    # the colocated vLLM engine as a GPU pod builds it, with the stand-in under it (the parameter names of the
    # stand-in's model are not the tiny model's, so the completeness check is off)
    t.engine = VLLMEngine(str(t.model_dir), dtype="float32", gpu_memory_utilization=0.5, eos_token_id=t.eos_id,
                          sleep_level=2, check_complete_sync=False)
    t.engine_is_vllm = True
    metrics = []
    for _ in range(2):
        t.validate()
        t.step += 1
        metrics.append(t.train_step())
    Path(out_path).write_text(json.dumps({"log": llm_class.instances[-1].log, "metrics": metrics}))
    t.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
