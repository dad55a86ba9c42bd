"""Rollout alone on long-tailed response lengths: batch at a time against continuous refilling (issue 32).

    python bench/long_tail_rollout.py [--model 1.5b --batches 4 --prompts 16 --n 8 --median 300 --sigma 1.0 --cap 4096]

A random-init model never ends a response on its own (EOS is outside its vocabulary here), so each response gets
its length from a log-normal law (median ``--median``, log-std ``--sigma``, capped at ``--cap``: heavy-tailed,
the shape of reasoning lengths) and is ended there, as if by EOS. The same responses (same prompts, same drawn
lengths) are generated two ways on one static engine (CUDA graphs, compile off, bf16, rows = prompts x n):

- **batch at a time** (colocated sync, or a pool answering one request after another): each batch is one engine
  call that decodes until its longest response's length. A static-cache step costs the same whatever number of
  its rows are still live, so this is the cost of ending each response at its own length inside the call;
- **refilling** (rollout/static_refill.py, what a separate pool with ``rollout.partial`` runs): the responses of
  up to ``--in-flight`` batches queued on a session of the same rows, each row refilled with the next response as
  soon as its own ends, the next batch queued when one has fully ended (a rollout-bound trainer with maxStaleness
  = in-flight), in runs of ``--chunk`` steps (the pool's weight-loading rounds).

Reports useful tokens (the drawn lengths) per second for each, the ratio, the mean row occupancy and the decode
steps, and writes results.jsonl lines with the batch-at-a-time run of the same process as the baseline.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))


def draw_lengths(count: int, median: float, sigma: float, cap: int, seed: int) -> list[int]:
    """``count`` lengths from LogNormal(ln median, sigma), rounded, within [1, cap]."""
    import torch

    g = torch.Generator().manual_seed(seed)
    z = torch.randn(count, generator=g, dtype=torch.float64)
    return [max(1, min(cap, round(median * math.exp(sigma * float(x))))) for x in z]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="1.5b")
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--median", type=float, default=300)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--cap", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=64)  # the pool's rounds (rollout/refill_serve.py: RUN_STEPS)
    ap.add_argument("--sync-batches", type=int, default=0, help="batches run one at a time (default: all)")
    ap.add_argument("--in-flight", default="2,4", help="batches queued at once, one refilling run each")
    ap.add_argument("--workdir", default="/tmp/long_tail_rollout")
    a = ap.parse_args()

    import torch
    import transformers
    from results import record
    from rljob_worker.rollout.base import SamplingParams
    from rljob_worker.rollout.hf_static_engine import HFStaticEngine
    from rljob_worker.rollout.static_refill import RefillingRows
    from rollout_scale import SHAPES, _random_weights_from_config, write_config

    transformers.AutoModelForCausalLM.from_pretrained = _random_weights_from_config
    on_cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if on_cuda else "cpu")
    vocab = SHAPES[a.model]["vocab_size"]
    rows = a.prompts * a.n
    engine = HFStaticEngine(str(write_config(Path(a.workdir), a.model)), dtype=torch.bfloat16 if on_cuda else torch.float32,
                            device=dev, eos_token_id=vocab, pad_token_id=0, compile_decode=False, max_batch=rows)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(1, vocab, (a.prompts, a.prompt_len), generator=g).tolist() for _ in range(a.batches)]
    lengths = [draw_lengths(rows, a.median, a.sigma, a.cap, seed=b) for b in range(a.batches)]
    useful = sum(map(sum, lengths))
    params = SamplingParams(temperature=1.0, seed=0)

    def sync() -> float:
        torch.cuda.synchronize() if on_cuda else None
        start = time.perf_counter()
        for prompts, lens in list(zip(batches, lengths))[:a.sync_batches]:
            out = engine.generate(prompts, SamplingParams(n=a.n, temperature=1.0, max_new_tokens=max(lens), seed=0))
            assert len(out.response_ids[0]) == max(lens), "a row stopped early"
        torch.cuda.synchronize() if on_cuda else None
        return time.perf_counter() - start

    def refill(in_flight: int) -> tuple[float, int]:
        """The batches through one refilling session, at most ``in_flight`` of them queued or decoding at once (the
        pool holds maxStaleness requests while a rollout-bound trainer waits for the oldest: the next is asked for
        only when one is answered)."""
        torch.cuda.synchronize() if on_cuda else None
        start = time.perf_counter()
        session = RefillingRows(engine, params, prompt_budget=a.prompt_len, response_budget=a.cap)
        left = [rows] * a.batches  # responses of each batch not yet ended
        submitted = 0

        def submit() -> None:
            nonlocal submitted
            b = submitted
            for i, prompt in enumerate(batches[b]):
                for j in range(a.n):
                    session.add((b, i, j), prompt, lengths[b][i * a.n + j])
            submitted += 1

        while submitted < min(in_flight, a.batches):
            submit()
        version, answers = 0, []  # (seconds, batch) of every batch whose last response ended
        while session.busy:
            for f in session.run(a.chunk, version):
                assert len(f.ids) == lengths[f.key[0]][f.key[1] * a.n + f.key[2]]
                left[f.key[0]] -= 1
                if left[f.key[0]] == 0:
                    answers.append((time.perf_counter() - start, f.key[0]))
                    if submitted < a.batches:
                        submit()
            version += 1
        assert not any(left)
        torch.cuda.synchronize() if on_cuda else None
        return time.perf_counter() - start, session.count, answers

    def steady(answers: list[tuple[float, int]], in_flight: int) -> float | None:
        """Useful tok/s between the first answer and the last one before the final drain (until then in_flight
        batches were always queued or decoding): the tokens of the batches answered in that window over its time."""
        last = len(answers) - in_flight
        if last < 2:
            return None
        window = answers[1:last]
        return sum(sum(lengths[b]) for _, b in window) / (answers[last - 1][0] - answers[0][0])

    # warm-up: the refilling session is the longest either way needs, so the batch-at-a-time calls reuse it and its
    # CUDA graphs (the engine keeps a longer session); every key bucket is captured here, outside the timings
    w = RefillingRows(engine, params, prompt_budget=a.prompt_len, response_budget=a.cap)
    w.add(0, batches[0][0], 8)
    w.run(64, 0)
    engine.generate(batches[0], SamplingParams(n=a.n, temperature=1.0, max_new_tokens=8, seed=0))
    assert engine._session is w.session, "the batch-at-a-time calls would not reuse the warmed-up session"

    a.sync_batches = a.sync_batches or a.batches
    sync_s = sync()
    sync_useful = sum(map(sum, lengths[:a.sync_batches]))
    sync_steps = sum(max(lens) for lens in lengths[:a.sync_batches])
    sync_rate = sync_useful / sync_s
    print(f"batch at a time, the first {a.sync_batches} batches: {sync_s:.2f} s ({sync_rate:,.0f} useful tok/s, "
          f"{sync_steps} steps, occupancy {sync_useful / (sync_steps * rows):.1%})", flush=True)
    shape = (f"{a.model} shape random init, {engine.dtype}, {a.batches} batches x {a.prompts} prompts x {a.n}, prompt "
             f"{a.prompt_len}, lengths LogNormal(median {a.median:g}, sigma {a.sigma:g}) capped {a.cap} "
             f"(mean {useful / rows / a.batches:.0f}, batch maxima {[max(x) for x in lengths]}), static engine, "
             f"CUDA graphs {engine.use_cuda_graph}, compile off, {rows} rows")
    for in_flight in [int(x) for x in a.in_flight.split(",")]:
        refill_s, steps, answers = refill(in_flight)
        rate, held = useful / refill_s, steady(answers, in_flight)
        print(f"refilling, {in_flight} batch(es) in flight, all {a.batches} batches: {refill_s:.2f} s ({rate:,.0f} "
              f"tok/s, {steps} steps, occupancy {useful / (steps * rows):.1%}); {rate / sync_rate:.2f}x batch at a time; "
              f"before the final drain: " + (f"{held:,.0f} tok/s, {held / sync_rate:.2f}x" if held else "too few batches"),
              flush=True)
        base = {"baseline": f"batch at a time (colocated sync's rollout), the first {a.sync_batches} batches",
                "baseline_value": sync_rate, "same_run": True}
        record("long_tail_rollout", shape, f"useful tokens/s, refilling rows, {in_flight} batch(es) in flight, whole "
               f"run with its final drain (rollout.partial on a separate pool, maxStaleness {in_flight})", rate, "tok/s",
               **base)
        if held:
            record("long_tail_rollout", shape, f"useful tokens/s, refilling rows, {in_flight} batch(es) in flight, "
                   "between the first answer and the final drain", held, "tok/s", **base)
        record("long_tail_rollout", shape, f"row occupancy, refilling rows, {in_flight} batch(es) in flight",
               useful / (steps * rows), "fraction", baseline="batch at a time",
               baseline_value=sync_useful / (sync_steps * rows), same_run=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
