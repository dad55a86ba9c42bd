"""Multi-turn rollouts with tools over any token-in/token-out engine (spec.rollout.agent, spec.tools).

Turn-batched: every live trajectory of the step generates its next turn in one engine call; the finished ones
drop out. A turn ends at EOS (the trajectory is done), at the tool-call end marker (a stop token: the engine
stops there inside its decode step), or at the token budget. After a call the tools run (concurrently), and
each observation is rendered by the tokenizer's chat template as a tool message and appended.

Token in, token out: a trajectory is the concatenation of the engine's sampled tokens, kept with the engine's
own log-probs, and the tokens of the rendered tool responses. The sampled text is decoded only to find tool
calls; nothing sampled is ever re-tokenized, so the trainer sees exactly the tokens that were sampled. Only the
rendering of the tool response is tokenized: the chat-template text that follows an assistant turn and holds
the tool messages (e.g. ChatML's ``<|im_end|>\\n<|im_start|>user\\n<tool_response>...``), tokens the model did not
sample; their ``loss_mask`` is 0, so they carry no loss, advantage, KL or entropy (data.batching.pad_batch).

Budget: spec.data.maxResponseLength bounds all turns and observations together. A trajectory that reaches it
is cut there (``finished`` False; a cut observation keeps its first tokens) and scored like any other; its
reward function sees ``trajectory["cut"]``. A trajectory whose turn makes a call at maxTurns ends there, the call
not run.

Prefix reuse: a later turn's request is the prompt plus every token so far, so vLLM (prefix caching on by default
in 0.26) reuses the KV of the earlier turns; the hf engines prefill the whole context again each turn.
"""
from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Protocol

from rljob_worker.rollout.base import RolloutOutput, SamplingParams
from rljob_worker.rollout.tool_parser import ToolCall, ToolCallParser
from rljob_worker.rollout.tools import ToolBox, ToolResult

_MARK = "RLJOBASSISTANTTURNEND"  # the assistant content the rendering is cut after


@dataclass(frozen=True)
class AgentConfig:
    max_turns: int = 4
    max_tool_calls_per_turn: int = 1
    max_response_length: int = 256


@dataclass
class Trajectory:
    """One sample. response_ids, logprobs and loss_mask have one entry per token after the prompt."""

    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # the engine's for sampled tokens, 0.0 for rendered ones
    loss_mask: list[int] = field(default_factory=list)  # 1: sampled by the model, 0: tool response / template
    turns: list[dict] = field(default_factory=list)  # {"text", "tool_calls": [{name, arguments, output, outcome}]}
    finished: bool = False  # ended at EOS (or a turn without a call)
    cut: bool = False  # reached spec.data.maxResponseLength
    done: bool = False

    @property
    def final_text(self) -> str:
        """The text of the last model turn (what a reward scores as the answer)."""
        return self.turns[-1]["text"] if self.turns else ""

    def as_dict(self) -> dict:
        """Plain data for the reward function (extra["trajectory"])."""
        return {"turns": self.turns, "num_turns": len(self.turns), "cut": self.cut, "finished": self.finished,
                "tool_calls": [c for t in self.turns for c in t["tool_calls"]]}

    def _append(self, ids: list[int], logprobs: list[float] | None) -> None:
        self.response_ids += ids
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.loss_mask += [1 if logprobs is not None else 0] * len(ids)


class ToolResponseRenderer:
    """Tool observations -> the token ids the chat template puts after an assistant turn that made calls, up to
    and including the next assistant header (the generation prompt). Only this text is tokenized."""

    def __init__(self, tokenizer):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("spec.tools needs a tokenizer with a chat template that renders role 'tool' messages; "
                             "set model.tokenizerPath to one that has it")
        self.tokenizer = tokenizer
        self._cache: dict[tuple, tuple[int, ...]] = {}
        self.render_text([("tool", "probe")])  # a template without tool messages fails at start-up, not mid-run

    def render_text(self, observations: list[tuple[str, str]]) -> str:
        messages = [{"role": "user", "content": "question"}, {"role": "assistant", "content": _MARK},
                    *({"role": "tool", "name": name, "content": text} for name, text in observations)]
        try:
            rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # a template error is a configuration error
            raise ValueError(f"the tokenizer's chat template cannot render tool messages: {exc}") from exc
        if rendered.count(_MARK) != 1 or observations and observations[-1][1] not in rendered:
            raise ValueError("the tokenizer's chat template does not render role 'tool' messages after an "
                             "assistant turn; spec.tools needs one that does")
        return rendered[rendered.index(_MARK) + len(_MARK):]

    def render(self, observations: list[tuple[str, str]]) -> list[int]:
        key = tuple(observations)
        ids = self._cache.get(key)
        if ids is None:  # outputs repeat (errors, short answers): render each distinct one once
            ids = tuple(self.tokenizer(self.render_text(observations), add_special_tokens=False)["input_ids"])
            if len(self._cache) >= 4096:
                self._cache.clear()
            self._cache[key] = ids
        return list(ids)


def run_agent_loop(generate: Callable[[list[list[int]], SamplingParams], RolloutOutput],
                   prompt_ids: list[list[int]], params: SamplingParams, *, parser: ToolCallParser, tools: ToolBox,
                   renderer: ToolResponseRenderer, decode: Callable[[list[int], bool], str], call_end_id: int,
                   eos_id: int, config: AgentConfig, contexts: list[dict],
                   open_stream: StreamFactory | None = None) -> tuple[list[Trajectory], dict]:
    """Roll out len(prompt_ids) x params.n trajectories (sample j of prompt i at i*n + j, as the engines).

    generate: the engine's generate; decode(ids, skip_special_tokens) -> text; contexts: one per prompt, passed
    to function tools; open_stream: the engine's continuous rows (`static_stream.RowStream`), when it has them:
    a trajectory's next turn then starts as soon as its tool answers, while the others decode on. Returns the
    trajectories and the step's ``tool/...`` metrics, with the per-(tool, outcome) call counts under the key
    "outcomes" (a Counter, not a metric).
    """
    loop = _Loop(prompt_ids, params, parser=parser, tools=tools, renderer=renderer, decode=decode,
                 call_end_id=call_end_id, eos_id=eos_id, config=config, contexts=contexts)
    if open_stream is not None:
        for lo in range(0, len(loop.trajs), open_stream.max_rows):
            loop.continuous(open_stream, range(lo, min(lo + open_stream.max_rows, len(loop.trajs))))
    loop.turn_batched(generate)  # every trajectory (or those a stream could not hold to the end)
    return loop.trajs, loop.metrics()


class StreamFactory(Protocol):
    """An engine's continuous rows: ``open_stream(prompts, params, budgets, length_budget)`` -> a RowStream."""

    max_rows: int

    def __call__(self, prompts: list[list[int]], params: SamplingParams, budgets: list[int],
                 length_budget: int): ...


class _Loop:
    """The trajectories of one rollout and the rules every turn follows, whichever way the turns are scheduled."""

    def __init__(self, prompt_ids, params, *, parser, tools, renderer, decode, call_end_id, eos_id, config,
                 contexts):
        self.n, self.params, self.parser, self.tools, self.renderer = params.n, params, parser, tools, renderer
        self.decode, self.call_end_id, self.eos_id, self.config, self.contexts = (
            decode, call_end_id, eos_id, config, contexts)
        self.prompt_ids = prompt_ids
        self.trajs = [Trajectory() for _ in range(len(prompt_ids) * params.n)]
        self.prompts = [p for p in prompt_ids for _ in range(params.n)]
        self.stops = tuple(dict.fromkeys((*params.stop_token_ids, call_end_id)))
        self.start, self.generated = time.perf_counter(), 0
        self.tool_spans: list[tuple[float, float]] = []
        self.outcomes: Counter = Counter()

    def budget(self, i: int) -> int:
        return self.config.max_response_length - len(self.trajs[i].response_ids)

    # -- the rules of a turn
    def end_turn(self, i: int, ids: list[int], lps: list[float]) -> list[ToolCall] | None:
        """Record trajectory i's turn (sampled ids and log-probs, within its budget). Returns the tool calls to
        run when the trajectory goes on, None when it is done."""
        t = self.trajs[i]
        self.generated += len(ids)
        t._append(ids, lps)
        t.turns.append({"text": self.decode(ids, True), "tool_calls": []})
        last = ids[-1] if ids else None
        if last == self.call_end_id:
            calls = self.parser.parse(self.decode(ids, False)) or [ToolCall(None, error=(
                f"no tool call was opened before {self.parser.end_marker}"))]
            if len(t.turns) >= self.config.max_turns:
                t.done = True  # no turn is left to read the answer
            elif len(t.response_ids) >= self.config.max_response_length:
                t.done = t.cut = True
            else:
                return calls
        elif last == self.eos_id or (last is not None and last in self.stops):
            t.done = t.finished = True
        else:  # cut at the budget
            t.done = t.cut = True
        return None

    def run_tools(self, pending: list[tuple[int, list[ToolCall]]]) -> list[tuple[int, list[ToolResult]]]:
        """Run the calls of the trajectories in ``pending`` (concurrently, at most max_tool_calls_per_turn each)."""
        started = time.perf_counter()
        per_turn = self.config.max_tool_calls_per_turn
        jobs, owners = [], []
        for i, calls in pending:
            for c, call in enumerate(calls):
                if c < per_turn:
                    jobs.append((call, self.contexts[i // self.n]))
                owners.append((i, c))
        results = iter(self.tools.call_all(jobs))
        per_traj: dict[int, list[ToolResult]] = {}
        for i, c in owners:
            result = next(results) if c < per_turn else ToolResult(
                "<over limit>", {}, "too_many_calls",
                f"Error: at most {per_turn} tool calls per turn; this one was not run", 0.0)
            per_traj.setdefault(i, []).append(result)
        self.tool_spans.append((started, time.perf_counter()))
        return list(per_traj.items())

    def observe(self, i: int, results: list[ToolResult]) -> list[int] | None:
        """Append the rendered tool responses to trajectory i; returns them when it goes on, None when the budget
        left no room for an answer (the trajectory is cut)."""
        t = self.trajs[i]
        for r in results:
            self.outcomes[(r.name, r.outcome)] += 1
        t.turns[-1]["tool_calls"] = [{"name": r.name, "arguments": r.arguments, "output": r.output,
                                      "outcome": r.outcome, "seconds": r.seconds} for r in results]
        rendered = self.renderer.render([(r.name, r.output) for r in results])
        room = self.config.max_response_length - len(t.response_ids)
        t._append(rendered[:room], None)
        if len(rendered) >= room:  # no room left for an answer
            t.done = t.cut = True
            return None
        return rendered

    # -- two schedules
    def turn_batched(self, generate) -> None:
        """Every live trajectory's next turn in one engine call, until none is live."""
        for call in range(self.config.max_turns):
            live = [i for i, t in enumerate(self.trajs) if not t.done]
            if not live:
                break
            budget = {i: self.budget(i) for i in live}
            seed = None if self.params.seed is None else self.params.seed + 7919 * call
            if all(not self.trajs[i].turns for i in live) and len(live) == len(self.trajs):
                # the first turn: n samples of each prompt in one request (vLLM fans them out from one prefill)
                out = generate(self.prompt_ids, dataclasses.replace(
                    self.params, max_new_tokens=self.config.max_response_length, stop_token_ids=self.stops, seed=seed))
            else:  # one request per live trajectory: its prompt and every token so far
                out = generate([self.prompts[i] + self.trajs[i].response_ids for i in live],
                               dataclasses.replace(self.params, n=1, max_new_tokens=max(budget.values()),
                                                   stop_token_ids=self.stops, seed=seed))
            pending = []
            for k, i in enumerate(live):  # the longest live budget was asked for
                calls = self.end_turn(i, out.response_ids[k][:budget[i]], out.response_logprobs[k][:budget[i]])
                if calls is not None:
                    pending.append((i, calls))
            if pending:
                for i, results in self.run_tools(pending):
                    self.observe(i, results)
        for t in self.trajs:
            t.done = True

    def continuous(self, open_stream: StreamFactory, rows: range) -> None:
        """Trajectories ``rows`` in one engine stream: a turn that ends at a call hands its calls to a tool thread
        and the engine decodes the others on; the trajectory resumes at the first poll after its tools answer.
        The session holds maxResponseLength tokens plus a quarter (>= 64) for the steps rows spend waiting for
        tools, so its KV cache is ~1.25x a single turn's; a trajectory whose waits outgrow that is left live for
        `turn_batched`."""
        budget = self.config.max_response_length
        stream = open_stream([self.prompts[i] for i in rows], dataclasses.replace(
            self.params, n=1, max_new_tokens=budget, stop_token_ids=self.stops,
            seed=None if self.params.seed is None else self.params.seed + rows.start),
            [budget] * len(rows), budget + max(64, budget // 4))  # waits beyond the slack: finished turn-batched
        futures: dict[Future, None] = {}
        with ThreadPoolExecutor(max_workers=4, thread_name_prefix="rljob-agent") as tool_threads:
            while stream.busy or futures:
                pending = []
                for end in stream.poll():
                    calls = self.end_turn(rows[end.row], end.ids, end.logprobs)
                    if calls is not None:
                        pending.append((rows[end.row], calls))
                if pending:
                    futures[tool_threads.submit(self.run_tools, pending)] = None
                if not stream.busy and futures:  # nothing to decode: wait for a tool
                    wait(futures, return_when=FIRST_COMPLETED)
                resumes = []
                for f in [f for f in futures if f.done()]:
                    del futures[f]
                    for i, results in f.result():
                        rendered = self.observe(i, results)
                        if rendered is not None:
                            resumes.append((i - rows.start, rendered, self.budget(i)))
                stream.resume(resumes)  # a row the stream refuses stays live for turn_batched

    def metrics(self) -> dict:
        total = time.perf_counter() - self.start
        tool_seconds, until = 0.0, float("-inf")  # wall time with a tool running (batches may overlap)
        for lo, hi in sorted(self.tool_spans):
            tool_seconds += max(0.0, hi - max(lo, until))
            until = max(until, hi)
        trajs = self.trajs
        calls = [sum(len(turn["tool_calls"]) for turn in t.turns) for t in trajs]
        return {
            "tool/calls_per_trajectory": sum(calls) / max(len(trajs), 1),
            "tool/trajectories_with_call": sum(c > 0 for c in calls) / max(len(trajs), 1),
            "tool/turns_mean": sum(len(t.turns) for t in trajs) / max(len(trajs), 1),
            "tool/errors": float(sum(v for (_, o), v in self.outcomes.items() if o != "ok")),
            "tool/calls": float(sum(self.outcomes.values())),
            "tool/time_share": tool_seconds / max(total, 1e-9),
            "tool/cut_share": sum(t.cut for t in trajs) / max(len(trajs), 1),
            "tool/model_tokens": float(self.generated),
            "outcomes": self.outcomes,
        }


_MEANS = ("tool/calls_per_trajectory", "tool/trajectories_with_call", "tool/turns_mean", "tool/time_share",
          "tool/cut_share")


def merge_loop_results(parts: list[tuple[list[Trajectory], dict]]) -> tuple[list[Trajectory], dict]:
    """The agent loops of several ranks (each over its share of the prompts, in prompt order) as one: the
    trajectories concatenated, the means weighted by trajectories, the counts summed."""
    trajs = [t for part, _ in parts for t in part]
    total = max(len(trajs), 1)
    metrics: dict = {"outcomes": Counter()}
    for part, m in parts:
        for key, value in m.items():
            if key == "outcomes":
                metrics[key].update(value)
            elif key in _MEANS:
                metrics[key] = metrics.get(key, 0.0) + value * len(part) / total
            else:
                metrics[key] = metrics.get(key, 0.0) + value
    return trajs, metrics


def agent_output(trajs: list[Trajectory]) -> RolloutOutput:
    """The trajectories as a RolloutOutput (logprobs of rendered tokens are 0; pair with the loss masks)."""
    return RolloutOutput([t.response_ids for t in trajs], [t.logprobs for t in trajs], [t.finished for t in trajs])
