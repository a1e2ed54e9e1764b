"""gpt-oss (harmony) rollouts and demonstrations with tool_format=native: the model calls
the task's function as a message of its own, the worker answers it in a tool message that
names the function, and every prompt the model sees is what gpt-oss's chat template
renders for the conversation so far; the calls score as the domain's protocol calls."""

import pytest

from posttrain.rollout import worker as worker_lib
from posttrain.tasks import registry
from posttrain.tasks.families.tools import NATIVE_TOOLS
from tests.data.test_harmony_tools import _model_tokens, _template
from tests.data.test_reasoning import _own, _text
from tests.rollout.test_reasoning_rollout import TOOL_PAIRS, _rollout, _Scripted, _task

pytest.importorskip("transformers")

TOOLS = [NATIVE_TOOLS["calculator"]]


def _conversation(task, call_thought="need a tool", final_thought="got it"):
  """The rollout's conversation as messages: the question, the call (its reasoning), the
  tool's answer, the final answer (its reasoning)."""
  question = registry.get(task.domain).native_tools(task)[0]
  call = {"name": "calculator", "arguments": {"expression": task.metadata["call"]}}
  return [{"role": "user", "content": question},
          {"role": "assistant", "content": "", "thinking": call_thought,
           "tool_calls": [{"type": "function", "function": call}]},
          {"role": "tool", "content": task.answer},
          {"role": "assistant", "thinking": final_thought,
           "content": f"<answer>{task.answer}</answer>"}]


@pytest.mark.parametrize("continuous,segment", [(True, 0), (False, 0), (False, 3)])
def test_native_calls_are_the_templates_and_score_as_the_protocols(harmony, continuous,
                                                                   segment):
  """Analysis, then a call to functions.calculator (stopping at <|call|>); the worker's
  answer; analysis, then the final answer. The transcript is the template's rendering of
  the conversation up to the tool's answer with its generation prompt (the call's
  analysis kept, as the template keeps it while no final answer follows), then the final
  turn as the template renders a training conversation's last message. The scored text is
  the domain's protocol; the reasoning of both turns is kept apart. In segments of 3
  tokens the call's header and its <|call|> arrive in different segments."""
  tasks = {_task(p).metadata["call"]: _task(p) for p in TOOL_PAIRS}

  def reply(text):
    task = next(t for call, t in tasks.items() if f"What is {call}?" in text)
    assert "<tool>" not in text and "type calculator = (_: {" in text
    if "<|start|>functions.calculator to=assistant" not in text:
      return harmony.encode(
          "<|channel|>analysis<|message|>need a tool<|end|><|start|>assistant "
          "to=functions.calculator<|channel|>commentary json<|message|>"
          f'{{"expression": "{task.metadata["call"]}"}}<|call|>')
    return harmony.encode("<|channel|>analysis<|message|>got it<|end|><|start|>assistant"
                          f"<|channel|>final<|message|><answer>{task.answer}</answer>"
                          "<|return|>")

  samples, _ = _rollout(_Scripted(harmony, reply), harmony, pairs=TOOL_PAIRS, max_turns=3,
                        continuous=continuous, segment_tokens=segment, tool_format="native",
                        new=256)
  for s in samples:
    task = next(t for call, t in tasks.items()
                if f"What is {call}?" in _text(harmony, s.prompt_tokens))
    convo = _conversation(task)
    full = _template(harmony, convo, tools=TOOLS)
    last = full[full.rindex("<|start|>assistant<|channel|>analysis") + len("<|start|>assistant"):]
    want = _template(harmony, convo[:3], tools=TOOLS, add_generation_prompt=True) + last
    transcript = s.prompt_tokens + s.response_tokens
    assert _text(harmony, transcript) == want
    assert (f'<|start|>functions.calculator to=assistant<|channel|>commentary<|message|>'
            f'"{task.answer}"<|end|>') in want
    # The model's own tokens: its two turns, not the prompt nor the tool's answer.
    assert _own(harmony, transcript, [0] * len(s.prompt_tokens) + s.response_mask) == (
        _model_tokens(want))
    assert s.text == (f"<tool>calculator: {task.metadata['call']}</tool>\n"
                      f"<observation>{task.answer}</observation>\n"
                      f"<answer>{task.answer}</answer>")
    assert (s.turns, s.tool_calls, s.finish_reason) == (2, 1, "stop")
    assert s.reasoning == "need a tool\n\ngot it" and s.reasoning_closed
    assert s.reward.value == 1.0 and s.reward.components["tool_valid"] == 1.0


def test_a_call_to_an_unknown_function_is_answered_as_the_protocol_answers(harmony):
  """A call the domain cannot run still gets its answer, under the function the model
  named, and scores as an invalid call."""
  tasks = {_task(p).metadata["call"]: _task(p) for p in TOOL_PAIRS}

  def reply(text):
    task = next(t for call, t in tasks.items() if f"What is {call}?" in text)
    if "to=assistant" not in text:
      return harmony.encode("<|channel|>commentary to=functions.abacus json<|message|>"
                            f'{{"expression": "{task.metadata["call"]}"}}<|call|>')
    return harmony.encode(f"<|channel|>final<|message|><answer>{task.answer}</answer>"
                          "<|return|>")

  samples, _ = _rollout(_Scripted(harmony, reply), harmony, pairs=TOOL_PAIRS[:1],
                        max_turns=3, tool_format="native", new=256)
  for s in samples:
    text = _text(harmony, s.prompt_tokens + s.response_tokens)
    assert ("<|call|><|start|>functions.abacus to=assistant<|channel|>commentary<|message|>"
            '"error: unknown tool; use one of calculator, python"<|end|>') in text
    assert s.text.startswith("<tool>abacus: ") and s.reasoning == ""
    assert s.reward.components["tool_valid"] == 0.0 and s.reward.value == 0.5


@pytest.mark.parametrize("thinking", [None, "high"])
def test_native_demonstrations_are_the_templates_tool_calls(harmony, thinking):
  """The SFT demonstration of a tool domain for gpt-oss: the rollouts' prompt, token for
  token, then the call, the tool's answer and the final answer as the template renders
  them; only the model's turns are trained."""
  from posttrain import trainer
  w = worker_lib.RolloutWorker(_Scripted(harmony, lambda t: []), harmony, group_size=1,
                               max_new_tokens=4, process=(0, 1), tool_format="native",
                               thinking=thinking)
  try:
    ex = trainer._sft_example(["tools/calc_l1"], harmony, 1, thinking=thinking,
                              tool_format="native")
    task = registry.get("tools/calc_l1").sample(2)
    assert ex["prompt_tokens"].tolist() == w.prompt_tokens(task)
  finally:
    w.close()
  convo = [dict(m, thinking=None) if m["role"] == "assistant" else m
           for m in _conversation(task)]
  convo = [{k: v for k, v in m.items() if v is not None} for m in convo]
  kw = {} if thinking is None else {"reasoning_effort": thinking}
  want = _template(harmony, convo, tools=TOOLS, **kw)
  whole = ex["prompt_tokens"].tolist() + ex["response_tokens"].tolist()
  assert _text(harmony, whole) == want
  trained = ex["response_tokens"][ex["response_mask"] != 0].tolist()
  assert _text(harmony, trained) == _model_tokens(want)
  assert _text(harmony, trained).endswith(f"<answer>{task.answer}</answer><|return|>")
