"""Evaluation metrics over n samples per prompt: pass@k (unbiased, Chen et al. 2021) and mean@n."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k samples drawn without replacement from n is correct), c of the n correct:
    1 - C(n-c, k) / C(n, k), computed as 1 - prod_{i=n-c+1..n} (1 - k / i) (no big binomials)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def k_values(n: int) -> list[int]:
    """The k reported for n samples per prompt: 1, 2, 4, ... below n, and n."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def sample_metrics(scores: Sequence[float], n: int, sources: Sequence[str], *,
                   correct_at: float = 1.0) -> dict[str, float]:
    """Validation metrics of P prompts x n samples.

    scores: (P*n,) rewards, prompt-major (the n samples of prompt 0 first); sources: (P,) data source of
    each prompt. A sample is correct when its reward >= correct_at. Returns val/reward_mean,
    val/accuracy, val/pass@k and val/mean@n over all prompts, and val/<source>/{pass@k, mean@n, prompts}
    for each source."""
    s = np.asarray(scores, dtype=np.float64).reshape(-1, n)  # (P, n)
    if s.shape[0] != len(sources):
        raise ValueError(f"{s.shape[0]} prompts of scores but {len(sources)} sources")
    correct = (s >= correct_at).sum(-1)  # (P,)
    src = np.asarray(sources, dtype=object)

    def block(rows: np.ndarray, prefix: str) -> dict[str, float]:
        out = {f"{prefix}pass@{k}": float(np.mean([pass_at_k(n, int(c), k) for c in correct[rows]]))
               for k in k_values(n)}
        out[f"{prefix}mean@{n}"] = float(s[rows].mean())
        return out

    every = np.ones(len(sources), dtype=bool)
    metrics = {"val/reward_mean": float(s.mean()), "val/accuracy": float((s >= correct_at).mean()),
               **block(every, "val/")}
    for source in sorted(set(sources)):
        rows = src == source
        metrics.update(block(rows, f"val/{source}/"))
        metrics[f"val/{source}/prompts"] = float(rows.sum())
    return metrics
