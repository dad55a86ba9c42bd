"""Tool-call parsers: the text of one model turn -> the tool calls it makes (spec.rollout.agent.toolCallFormat).

A parser reads text only to find calls; it never produces tokens (the trajectory keeps the sampled ids). Each
format names its end marker, which must be one token of the tokenizer: the engines stop a turn on it
(SamplingParams.stop_token_ids), inside their decode step.

hermes: Hermes / Qwen2.5 / Qwen3 style, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one JSON
    object per tag, any number of tags in a turn.
bare:   ``[<tool_call>]TEXT</tool_call>`` for a job with exactly one tool: TEXT (stripped; from the opening tag,
    which may be left out, else from the start of the turn) is passed as ``{"input": TEXT}``. For models too
    small to write JSON (the built-in tool task): every turn that ends at the end tag is a call.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Protocol

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_TAGGED = re.compile(re.escape(CALL_START) + r"(.*?)" + re.escape(CALL_END), re.DOTALL)


@dataclass
class ToolCall:
    name: str | None  # None when the call could not be parsed (error says why)
    arguments: dict = field(default_factory=dict)
    error: str | None = None  # a parse error the model sees as the call's observation


class ToolCallParser(Protocol):
    end_marker: str  # the text of the token that ends a turn making a call

    def parse(self, text: str) -> list[ToolCall]: ...


class HermesParser:
    end_marker = CALL_END

    def parse(self, text: str) -> list[ToolCall]:
        calls = []
        for body in _TAGGED.findall(text):
            try:
                obj = json.loads(body)
            except ValueError as exc:
                calls.append(ToolCall(None, error=f"the tool call is not valid JSON ({exc.msg} at char {exc.pos}); "
                                                  'write <tool_call>{"name": ..., "arguments": {...}}</tool_call>'))
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                calls.append(ToolCall(None, error='the tool call needs a string "name"'))
                continue
            args = obj.get("arguments", {})
            if isinstance(args, str):  # some models write the arguments as a JSON string
                try:
                    args = json.loads(args)
                except ValueError:
                    calls.append(ToolCall(obj["name"], error="the tool call's arguments are not valid JSON"))
                    continue
            if not isinstance(args, dict):
                calls.append(ToolCall(obj["name"], error="the tool call's arguments must be a JSON object"))
                continue
            calls.append(ToolCall(obj["name"], args))
        return calls


class BareParser:
    end_marker = CALL_END

    def __init__(self, tool_name: str):
        self.tool_name = tool_name

    def parse(self, text: str) -> list[ToolCall]:
        calls = []
        for chunk in text.split(CALL_END)[:-1]:  # the text after the last end tag is no call
            body = chunk.rsplit(CALL_START, 1)[-1]
            calls.append(ToolCall(self.tool_name, {"input": body.strip()}))
        return calls


def make_parser(fmt: str, tool_names: list[str]) -> ToolCallParser:
    """The parser of spec.rollout.agent.toolCallFormat."""
    if fmt == "hermes":
        return HermesParser()
    if fmt == "bare":
        if len(tool_names) != 1:
            raise ValueError(f"spec.rollout.agent.toolCallFormat bare needs exactly one tool in spec.tools, "
                             f"got {len(tool_names)}; use hermes")
        return BareParser(tool_names[0])
    raise ValueError(f"spec.rollout.agent.toolCallFormat {fmt!r} is unknown; use hermes or bare")
