"""Synthetic tasks written in the builtin character vocabulary, with their rewards.

target-token: the prompt is a random digit string ending in '=', the answer is the
    target character repeated; reward = fraction of the first maxResponseLength
    generated tokens equal to the target (EOS ends a response early and scores the
    rest as misses, so stopping early never pays).
digit-sum:   the prompt is 'a+b=', reward 1 when the first generated token is
    (a + b) mod 10.
tool-secret: the prompt is a random digit string ending in '=', the answer a per-prompt secret (one of
    SECRET_CHARS) drawn
    independently of it, which only the `secret` tool knows (`secret_tool`, spec.tools); reward 1 when the
    final turn starts with the secret after a successful call (an answer without one is a guess and scores 0,
    so a model that never calls cannot do better than 0); the built-in
    tiny-qwen2-tools model calls it with a turn ending in </tool_call> (toolCallFormat bare) and reads the
    answer from <tool_response>D.
Rows follow verl's parquet layout so the same data path serves both.
"""
from __future__ import annotations

import random

TARGET_CHAR = "7"
SECRET_CHARS = "0123"  # tool-secret's secrets: few, so each answer-from-output mapping is seen often


def generate_rows(task: str, num_prompts: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(num_prompts):
        if task == "target-token":
            prompt = "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 8))) + "="
            truth = TARGET_CHAR
        elif task == "tool-secret":
            prompt = "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 6))) + "="
            truth = rng.choice(SECRET_CHARS)
        elif task == "digit-sum":
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            prompt, truth = f"{a}+{b}=", str((a + b) % 10)
        else:
            raise ValueError(f"data.synthetic.task {task!r} is unknown; use target-token, digit-sum or tool-secret")
        rows.append({
            "prompt": prompt,
            "data_source": f"synthetic/{task}",
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"index": i},
        })
    return rows


def target_token_reward(prompt: str, completion: str, ground_truth: str, extra: dict | None = None) -> float:
    """Fraction of response positions holding the target. `extra['max_response_length']` sets the denominator."""
    max_len = int((extra or {}).get("max_response_length") or max(len(completion), 1))
    return sum(ch == ground_truth for ch in completion[:max_len]) / max_len


def digit_sum_reward(prompt: str, completion: str, ground_truth: str, extra: dict | None = None) -> float:
    return 1.0 if completion[:1] == ground_truth else 0.0


def tool_secret_reward(prompt: str, completion: str, ground_truth: str, extra: dict | None = None) -> float:
    """1 when the final turn (``completion``) starts with the secret digit and, in a multi-turn rollout
    (``extra["trajectory"]``), the answer came after a successful tool call: an answer without one is a guess."""
    trajectory = (extra or {}).get("trajectory")
    if trajectory is not None and not any(c["outcome"] == "ok" for c in trajectory["tool_calls"]):
        return 0.0
    return 1.0 if completion[:1] == ground_truth else 0.0


def secret_tool(arguments: dict, context: dict) -> str:
    """The tool of the tool-secret task (spec.tools function rljob_worker.data.synthetic:secret_tool): the
    trajectory's secret, whatever the arguments."""
    return str(context["ground_truth"])
