"""Math answer rewards: gsm8k's '#### answer' and LaTeX \\boxed{answer}, with normalisation."""
from __future__ import annotations

import re

_NUMBER = re.compile(r"-?[\d,]*\.?\d+")


def normalize_answer(text: str) -> str:
    """Canonical form for comparing final answers: no spaces, $, commas, trailing '.0', units of \\text{}."""
    s = text.strip()
    s = re.sub(r"\\text\{[^}]*\}", "", s)
    s = s.replace("\\!", "").replace("\\,", "").replace("$", "").replace(" ", "")
    s = s.replace("\\left", "").replace("\\right", "").replace("dfrac", "frac").replace("tfrac", "frac")
    s = s.rstrip(".")
    if re.fullmatch(r"-?[\d,]+(\.\d+)?", s):
        s = s.replace(",", "")
        if "." in s:
            s = s.rstrip("0").rstrip(".")
    return s


def extract_gsm8k_answer(completion: str) -> str | None:
    """The number after the last '####' (gsm8k's format), else None."""
    match = re.findall(r"####\s*(-?[\d,]*\.?\d+)", completion)
    return match[-1] if match else None


def extract_boxed(completion: str) -> str | None:
    """Contents of the last \\boxed{...}, braces balanced."""
    start = completion.rfind("\\boxed")
    if start < 0:
        return None
    i = completion.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(completion)):
        if completion[j] == "{":
            depth += 1
        elif completion[j] == "}":
            depth -= 1
            if depth == 0:
                return completion[i + 1 : j]
    return None


def gsm8k_reward(prompt: str, completion: str, ground_truth: str, extra: dict | None = None) -> float:
    """1.0 when the '#### N' answer equals the ground truth, 0.1 for the right format only, else 0."""
    answer = extract_gsm8k_answer(completion)
    if answer is None:
        return 0.0
    truth = extract_gsm8k_answer(ground_truth) or ground_truth
    return 1.0 if normalize_answer(answer) == normalize_answer(truth) else 0.1


def boxed_math_reward(prompt: str, completion: str, ground_truth: str, extra: dict | None = None) -> float:
    """1.0 when the last \\boxed{} answer equals the ground truth after normalisation."""
    answer = extract_boxed(completion)
    if answer is None:
        return 0.0
    truth = extract_boxed(ground_truth) or ground_truth
    return 1.0 if normalize_answer(answer) == normalize_answer(truth) else 0.0


def format_reward(prompt: str, completion: str, ground_truth: str, extra: dict | None = None) -> float:
    """1.0 when the completion states a final answer in either supported format."""
    return 1.0 if extract_boxed(completion) is not None or extract_gsm8k_answer(completion) is not None else 0.0
