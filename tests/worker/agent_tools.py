"""A tool for multi-process agent tests: the tool-secret task's tool, logging which rank ran each call."""
from __future__ import annotations

import json
import os


def logged_secret(arguments: dict, context: dict) -> str:
    """secret_tool's answer; appends {rank, prompt} to $RLJOB_TEST_TOOL_LOG."""
    with open(os.environ["RLJOB_TEST_TOOL_LOG"], "a") as f:
        f.write(json.dumps({"rank": int(os.environ.get("RANK", "0")), "prompt": context["prompt"]}) + "\n")
    return str(context["ground_truth"])
