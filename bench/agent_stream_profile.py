"""Where the agent loop's rollout time goes on the static engine: single turn vs turns batched vs turns streamed.

    python3 bench/agent_stream_profile.py --model /tmp/tools1.5b [--reps 12] [--keep-cache]

The tool-secret prompts of bench/gpu_secret_tool_15b.yaml (8 x 16 trajectories, <= 16 tokens, temperature 1),
the same engine for all three; each rollout timed with a device sync, median over reps after 2 warm-ups. The
engine's cache is released between rollouts as GRPO does (--keep-cache keeps it). Streamed rollouts also report
the time inside RowStream's polls and its placing of resumes (each closed by a sync: a profile, not a rate).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/tools1.5b")
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--keep-cache", action="store_true")
    args = ap.parse_args()
    from rljob_worker.data.synthetic import generate_rows
    from rljob_worker.rollout import static_stream
    from rljob_worker.rollout.agent_loop import AgentConfig, ToolResponseRenderer, run_agent_loop
    from rljob_worker.rollout.base import SamplingParams
    from rljob_worker.rollout.hf_static_engine import HFStaticEngine
    from rljob_worker.rollout.tool_parser import make_parser
    from rljob_worker.rollout.tools import ToolBox, ToolConfig
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    engine = HFStaticEngine(args.model, dtype=torch.bfloat16, device=dev, eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.pad_token_id, compile_decode=False)
    rows = generate_rows("tool-secret", 8, seed=3)
    prompts = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    contexts = [{"ground_truth": r["reward_model"]["ground_truth"]} for r in rows]
    params = SamplingParams(n=16, temperature=1.0, max_new_tokens=16)
    tools = ToolBox([ToolConfig(name="secret", function="rljob_worker.data.synthetic:secret_tool", max_output_tokens=4)])
    call_end = tok.convert_tokens_to_ids("</tool_call>")
    renderer = ToolResponseRenderer(tok)
    spent = {"poll": 0.0, "place": 0.0, "polls": 0, "places": 0}

    def timed(name, fn):
        def wrapper(self, *a, **k):
            sync()
            t0 = time.perf_counter()
            out = fn(self, *a, **k)
            sync()
            spent[name] += time.perf_counter() - t0
            spent[name + "s"] += 1
            return out
        return wrapper

    static_stream.RowStream.poll = timed("poll", static_stream.RowStream.poll)
    static_stream.RowStream._place = timed("place", static_stream.RowStream._place)
    tokens = {}

    def rollout(mode: str) -> float:
        sync()
        t0 = time.perf_counter()
        if mode == "single":
            out = engine.generate(prompts, params)
            tokens[mode] = sum(len(r) for r in out.response_ids)
        else:
            trajs, _ = run_agent_loop(
                engine.generate, prompts, params, parser=make_parser("bare", ["secret"]), tools=tools,
                renderer=renderer, decode=lambda ids, skip: tok.decode(ids, skip_special_tokens=skip),
                call_end_id=call_end, eos_id=tok.eos_token_id, config=AgentConfig(2, 1, 16), contexts=contexts,
                open_stream=static_stream.RowStreams(engine) if mode == "streamed" else None)
            tokens[mode] = sum(len(t.response_ids) for t in trajs)
            tokens[mode + "_turns"] = sum(len(t.turns) for t in trajs) / len(trajs)
        sync()
        if not args.keep_cache:
            engine.release_cache()
        return time.perf_counter() - t0

    times = {m: [] for m in ("single", "batched", "streamed")}
    for rep in range(args.reps + 2):
        for mode, kept in times.items():
            if mode == "streamed":
                before = dict(spent)
            seconds = rollout(mode)
            if rep >= 2:
                kept.append(seconds)
                if mode == "streamed":
                    for k in list(before):
                        if not k.startswith("d_"):
                            spent["d_" + k] = spent.get("d_" + k, 0.0) + spent[k] - before[k]
    med = {m: statistics.median(v) for m, v in times.items()}
    per = {m: med[m] / tokens[m] for m in med}
    for m, seconds in med.items():
        print(f"RESULT {m}: rollout {seconds * 1e3:.1f} ms median, {tokens[m]} tokens, "
              f"{per[m] * 1e6:.1f} us/token" + (f", {tokens[m + '_turns']:.2f} turns" if m != "single" else ""))
    reps = args.reps
    print(f"RESULT streamed profile per rollout: polls {spent['d_polls'] / reps:.1f} taking "
          f"{spent['d_poll'] / reps * 1e3:.1f} ms (placing resumes included: {spent['d_places'] / reps:.1f} "
          f"placements taking {spent['d_place'] / reps * 1e3:.1f} ms)")
    shape = (f"tool-secret 8 x 16, <= 16 tokens, 1.5B shape bf16 over the tool vocabulary, hf static engine "
             f"(CUDA graphs, compile off){', cache kept' if args.keep_cache else ', cache released each rollout'}")
    for m in ("batched", "streamed"):
        results.record(f"agent loop rollout ({m} turns) vs single-turn, same engine and prompts", shape,
                       "rollout_us_per_token", per[m] * 1e6, "us", baseline="single-turn rollout",
                       baseline_value=per["single"] * 1e6, same_run=True)
    tools.close()


if __name__ == "__main__":
    main()
