"""The agent loop, token in / token out: what the trainer gets is exactly what the engine sampled plus the
tool responses as the chat template renders them, for two model families (fixtures/chat_templates, built
locally by its build.py), with trajectories of 1 to 5 turns.

The engine here is scripted (token ids in, token ids out, as every engine): each turn's tokens are encoded
piece by piece, so they differ from what re-tokenizing the turn's text would give, and any re-tokenization
would show."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rljob_worker.data.batching import pad_batch, scatter_response_values
from rljob_worker.rollout.agent_loop import AgentConfig, ToolResponseRenderer, run_agent_loop
from rljob_worker.rollout.base import RolloutOutput, SamplingParams
from rljob_worker.rollout.tool_parser import make_parser
from rljob_worker.rollout.tools import ToolBox, ToolConfig

FIXTURES = Path(__file__).with_name("fixtures") / "chat_templates"
SECRET_TOOL = "rljob_worker.data.synthetic:secret_tool"  # returns the context's ground_truth

# the text after an assistant turn that made calls, through the next assistant header, per family
AFTER_CALL = {
    "chatml": "<|im_end|>\n<|im_start|>user\n<tool_response>\n{out}\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    "llama3": "<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n{out}<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n",
}


def tokenizer(family):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(FIXTURES / family)


def pieces(tok, *texts) -> list[int]:
    """Token ids as a sampler may produce them: each piece encoded on its own."""
    return [i for t in texts for i in tok(t, add_special_tokens=False)["input_ids"]]


class ScriptedEngine:
    """Turn k of trajectory i returns script[i][k]; checks every request is the prompt plus everything so far."""

    def __init__(self, prompts, script, expected_so_far):
        self.prompts, self.script, self.expected = prompts, script, expected_so_far
        self.turn_of = [0] * len(prompts)
        self.calls = []

    def generate(self, prompt_ids, params: SamplingParams) -> RolloutOutput:
        assert params.n == 1
        self.calls.append(len(prompt_ids))
        out = RolloutOutput([], [], [])
        for ids in prompt_ids:
            i = next(k for k, p in enumerate(self.prompts) if ids[:len(p)] == p)
            k = self.turn_of[i]
            assert ids == self.prompts[i] + self.expected[i][k], f"trajectory {i} turn {k}: the context was re-made"
            self.turn_of[i] += 1
            toks = self.script[i][k]
            out.response_ids.append(toks)
            out.response_logprobs.append([-0.01 * (100 * i + 10 * k + j + 1) for j in range(len(toks))])
            out.finished.append(True)
        return out


@pytest.mark.parametrize("family", ["chatml", "llama3"])
def test_trainer_input_is_sampled_tokens_plus_rendered_tool_outputs(family):
    tok = tokenizer(family)
    eos = tok.eos_token_id
    call_end = tok.convert_tokens_to_ids("</tool_call>")
    prompts = [pieces(tok, f"question {i}") for i in range(5)]  # distinct prompts: trajectory i has i + 1 turns
    secrets = [f"ab{i} and 4{i}" for i in range(5)]
    script, expected_so_far, want_ids, want_mask = [], [], [], []
    for i in range(5):
        turns, so_far, ids, mask = [], [], [], []
        for k in range(i + 1):
            so_far.append(list(ids))
            if k < i:  # a turn that calls the tool, then the rendered response
                turn = pieces(tok, "ab", "ab", " I call ", "<tool_call>",
                              '{"name": "lookup", "arguments": {"q": "ab"}}', "</tool_call>")
                rendered = tok(AFTER_CALL[family].format(out=secrets[i]), add_special_tokens=False)["input_ids"]
                ids, mask = ids + turn + rendered, mask + [1] * len(turn) + [0] * len(rendered)
            else:  # the answer
                turn = pieces(tok, "the ", "answer", " is ", "4", "2") + [eos]
                ids, mask = ids + turn, mask + [1] * len(turn)
            turns.append(turn)
        script.append(turns)
        expected_so_far.append(so_far)
        want_ids.append(ids)
        want_mask.append(mask)
    # the scripted turns are not what re-tokenizing their text gives: a re-tokenizing loop would fail here
    assert tok(tok.decode(script[1][0]), add_special_tokens=False)["input_ids"] != script[1][0]

    engine = ScriptedEngine(prompts, script, expected_so_far)
    box = ToolBox([ToolConfig("lookup", function=SECRET_TOOL)])
    trajs, metrics = run_agent_loop(
        engine.generate, prompts, SamplingParams(n=1, max_new_tokens=512), parser=make_parser("hermes", ["lookup"]),
        tools=box, renderer=ToolResponseRenderer(tok), decode=lambda ids, skip: tok.decode(ids, skip_special_tokens=skip),
        call_end_id=call_end, eos_id=eos, config=AgentConfig(max_turns=5, max_response_length=512),
        contexts=[{"ground_truth": s} for s in secrets])
    assert engine.calls == [5, 4, 3, 2, 1]  # turn-batched: the live trajectories of each turn in one call
    for i, t in enumerate(trajs):
        assert t.response_ids == want_ids[i]
        assert t.loss_mask == want_mask[i]
        assert len(t.turns) == i + 1 and t.finished and not t.cut
        assert [c["output"] for turn in t.turns for c in turn["tool_calls"]] == [secrets[i]] * i
        assert all(c["arguments"] == {"q": "ab"} and c["outcome"] == "ok" for turn in t.turns for c in turn["tool_calls"])
        assert t.final_text == "the answer is 42"
        # the engine's own log-probs on the sampled tokens, in order
        sampled = [lp for lp, m in zip(t.logprobs, t.loss_mask) if m]
        assert sampled == [-0.01 * (100 * i + 10 * k + j + 1) for k in range(i + 1) for j in range(len(script[i][k]))]
    assert metrics["tool/calls_per_trajectory"] == pytest.approx(2.0) and metrics["tool/turns_mean"] == pytest.approx(3.0)
    assert metrics["outcomes"] == {("lookup", "ok"): 10}

    # the trainer's batch: prompt + trajectory token for token; the loss sees the sampled tokens only
    batch = pad_batch(prompts, [t.response_ids for t in trajs], tok.pad_token_id, loss_masks=[t.loss_mask for t in trajs])
    width = max(len(p) for p in prompts)
    for i, t in enumerate(trajs):
        row = batch["input_ids"][i, width - len(prompts[i]):width + len(t.response_ids)].tolist()
        assert row == prompts[i] + want_ids[i]
        assert batch["response_mask"][i, width:width + len(t.response_ids)].tolist() == want_mask[i]
        assert batch["attention_mask"][i, width:width + len(t.response_ids)].sum() == len(t.response_ids)
    lps = scatter_response_values([[lp for lp, m in zip(t.logprobs, t.loss_mask) if m] for t in trajs],
                                  batch["response_mask"])
    assert (lps[batch["response_mask"] == 0] == 0).all()
    box.close()


def run_tiny(family, script, *, max_turns=5, budget=512, tools=None, per_turn=1):
    tok = tokenizer(family)
    prompts = [pieces(tok, "question 0")]
    so_far, ids = [], []
    engine_turns = []

    class Engine:
        def generate(self, prompt_ids, params):
            k = len(engine_turns)
            engine_turns.append(prompt_ids[0])
            toks = script[k][:params.max_new_tokens]
            return RolloutOutput([toks], [[-0.5] * len(toks)], [True])

    box = ToolBox(tools or [ToolConfig("lookup", function=SECRET_TOOL)])
    trajs, metrics = run_agent_loop(
        Engine().generate, prompts, SamplingParams(n=1, max_new_tokens=budget), parser=make_parser("hermes", ["lookup"]),
        tools=box, renderer=ToolResponseRenderer(tok), decode=lambda i, s: tok.decode(i, skip_special_tokens=s),
        call_end_id=tok.convert_tokens_to_ids("</tool_call>"), eos_id=tok.eos_token_id,
        config=AgentConfig(max_turns=max_turns, max_response_length=budget, max_tool_calls_per_turn=per_turn),
        contexts=[{"ground_truth": "x" * 50}])
    box.close()
    del so_far, ids
    return tok, trajs[0], metrics


def test_a_trajectory_reaching_the_budget_is_cut_there():
    tok = tokenizer("chatml")
    call = pieces(tok, '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>')
    _, t, metrics = run_tiny("chatml", [call, call], budget=len(call) + 10)
    assert t.cut and not t.finished and len(t.response_ids) == len(call) + 10  # the observation's first 10 tokens
    assert t.loss_mask == [1] * len(call) + [0] * 10
    assert metrics["tool/cut_share"] == 1.0


def test_a_call_at_max_turns_ends_the_trajectory_without_running_it():
    tok = tokenizer("chatml")
    call = pieces(tok, '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>')
    _, t, metrics = run_tiny("chatml", [call, call], max_turns=2)
    assert len(t.turns) == 2 and t.turns[1]["tool_calls"] == [] and metrics["tool/calls"] == 1.0
    assert t.loss_mask[-len(call):] == [1] * len(call)


def test_bad_calls_become_observations_and_the_loop_goes_on():
    tok = tokenizer("chatml")
    eos = [tok.eos_token_id]
    bad_json = pieces(tok, "<tool_call>{not json</tool_call>")
    unknown = pieces(tok, '<tool_call>{"name": "nope", "arguments": {}}</tool_call>')
    two = pieces(tok, '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'
                      '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>')
    answer = pieces(tok, "done") + eos
    _, t, metrics = run_tiny("chatml", [bad_json, unknown, two, answer], per_turn=1)
    outcomes = [c["outcome"] for turn in t.turns for c in turn["tool_calls"]]
    assert outcomes == ["invalid_call", "unknown_tool", "ok", "too_many_calls"]
    observations = [c["output"] for turn in t.turns for c in turn["tool_calls"]]
    assert "not valid JSON" in observations[0] and "no tool 'nope'" in observations[1]
    assert "at most 1 tool calls per turn" in observations[3]
    assert t.finished and t.final_text == "done" and metrics["tool/errors"] == 3.0


def test_renderer_refuses_a_template_without_tool_messages():
    tok = tokenizer("chatml")
    tok.chat_template = "{% for m in messages %}{% if m.role != 'tool' %}{{ m.content }}{% endif %}{% endfor %}"
    with pytest.raises(ValueError, match="does not render role 'tool'"):
        ToolResponseRenderer(tok)


def test_hermes_and_bare_parsers():
    hermes = make_parser("hermes", ["a", "b"])
    calls = hermes.parse('x<tool_call>{"name": "a", "arguments": {"k": 1}}</tool_call>'
                         '<tool_call>{"name": "b", "arguments": "{\\"j\\": 2}"}</tool_call>')
    assert [(c.name, c.arguments, c.error) for c in calls] == [("a", {"k": 1}, None), ("b", {"j": 2}, None)]
    assert hermes.parse("<tool_call>[1]</tool_call>")[0].error == 'the tool call needs a string "name"'
    bare = make_parser("bare", ["secret"])
    assert [c.arguments for c in bare.parse("12<tool_call> 3 </tool_call>")] == [{"input": "3"}]
    assert [c.arguments for c in bare.parse("45</tool_call>")] == [{"input": "45"}]  # the opening tag is optional
    with pytest.raises(ValueError, match="exactly one tool"):
        make_parser("bare", ["a", "b"])


def test_tool_tokens_are_padding_to_the_loss_mask():
    """pad_batch: a loss mask shorter than its response is refused (it would shift every mask after it)."""
    with pytest.raises(ValueError, match="as long as its response"):
        pad_batch([[1]], [[2, 3]], 0, loss_masks=[[1]])
    batch = pad_batch([[1]], [[2, 3, 4]], 0, loss_masks=[[1, 0, 1]])
    assert batch["response_mask"].tolist() == [[0, 1, 0, 1]] and batch["attention_mask"].tolist() == [[1, 1, 1, 1]]
    assert torch.equal(batch["input_ids"], torch.tensor([[1, 2, 3, 4]]))


def test_loops_of_several_ranks_merge_into_one_batch():
    """Every-rank loops (each over its share) merge in prompt order; means weigh each share by its trajectories,
    counts add up, and a rank with no share adds nothing."""
    from collections import Counter

    from rljob_worker.rollout.agent_loop import Trajectory, merge_loop_results

    a = [Trajectory(response_ids=[1]), Trajectory(response_ids=[2]), Trajectory(response_ids=[3])]
    b = [Trajectory(response_ids=[4])]
    parts = [(a, {"tool/turns_mean": 2.0, "tool/calls": 3.0, "outcomes": Counter({("t", "ok"): 3})}),
             ([], {"outcomes": Counter()}),
             (b, {"tool/turns_mean": 1.0, "tool/calls": 1.0, "outcomes": Counter({("t", "timeout"): 1})})]
    trajs, metrics = merge_loop_results(parts)
    assert [t.response_ids for t in trajs] == [[1], [2], [3], [4]]
    assert metrics["tool/turns_mean"] == pytest.approx((3 * 2.0 + 1.0) / 4)
    assert metrics["tool/calls"] == 4.0
    assert metrics["outcomes"] == Counter({("t", "ok"): 3, ("t", "timeout"): 1})
