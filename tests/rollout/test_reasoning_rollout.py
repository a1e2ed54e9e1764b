"""Rollouts of reasoning models: verifiers read the content, not the reasoning; a
multi-turn transcript is token for token what the model's chat template renders; the
reasoning's length and whether it ended reach the samples."""

import numpy as np
import pytest

from posttrain.data import ByteTokenizer
from posttrain.rollout import worker as worker_lib
from posttrain.tasks import registry
from posttrain.tasks.reward_model import verifier_value
from tests.data.test_reasoning import QWEN3_TEMPLATE, _hf, _text

transformers = pytest.importorskip("transformers")


class _Out:

  def __init__(self, rows):
    width = max([len(t) for t, _ in rows] + [1])
    self.tokens = np.zeros((len(rows), width), np.int32)
    for k, (t, _) in enumerate(rows):
      self.tokens[k, :len(t)] = t
    self.lengths = np.asarray([len(t) for t, _ in rows])
    self.logprobs = np.zeros((len(rows), width), np.float32)
    self.finish_reasons = [r for _, r in rows]
    self.resume_state, self.stats = None, {}


class _Scripted:
  """Stands in for the Sampler: a turn writes what `script(transcript text)` says (token
  ids), from where the transcript already is in it, up to its first stop token or
  max_new_tokens; continuously batched (on_finish / between_rounds) or in one batch."""

  params_version = 0

  def __init__(self, tok, script, max_len=2048):
    self.tok, self.script, self.max_len = tok, script, max_len

  def slot_rows(self, n):
    return n

  def _turn(self, prompt, max_new_tokens, stops):
    turn = self.script(_text(self.tok, prompt) if hasattr(self.tok, "_tok")
                       else self.tok.decode(prompt))
    done = next(k for k in range(len(turn), -1, -1)  # what of the turn is written already
                if k <= len(prompt) and list(prompt[len(prompt) - k:]) == turn[:k])
    rest = turn[done:]
    cut = next((k + 1 for k, t in enumerate(rest) if t in stops), len(rest))
    n = min(cut, max_new_tokens)
    return rest[:n], "stop" if n and rest[n - 1] in stops else "length"

  def generate(self, prompts, *, max_new_tokens, stop_token_ids, on_finish=None,
               between_rounds=None, **_):
    stops = set(stop_token_ids)
    if on_finish is None:
      return _Out([self._turn(p, max_new_tokens, stops) for p in prompts])
    pending = list(enumerate(prompts))
    count = len(pending)
    while pending:
      for j, p in pending:
        toks, reason = self._turn(p, max_new_tokens, stops)
        on_finish(j, np.asarray(toks, np.int32), np.zeros(len(toks), np.float32), reason)
      pending = []
      if between_rounds is not None:
        for p in between_rounds(np.zeros(0, np.int32)) or []:
          pending.append((count, p))
          count += 1
    return _Out([])


def _task(pair):
  return registry.get(pair[0]).sample(pair[1])


def _answer_of(text):
  """The task (arithmetic/add_d1 seeds below) whose prompt the transcript holds."""
  for pair in PAIRS:
    task = _task(pair)
    if task.prompt in text:
      return task.answer
  raise AssertionError(text)


PAIRS = [("arithmetic/add_d1", 3), ("arithmetic/add_d1", 5)]


def _rollout(sampler, tok, pairs=PAIRS, **kw):
  w = worker_lib.RolloutWorker(sampler, tok, group_size=2, max_new_tokens=kw.pop("new", 64),
                               chunk_rows=kw.pop("chunk_rows", 4), scoring_threads=1,
                               process=(0, 1), **kw)
  try:
    return [s for g in w.rollout(pairs, seed=0) for s in g.samples], w
  finally:
    w.close()


@pytest.mark.parametrize("continuous", [True, False])
def test_the_verifier_reads_the_answer_after_the_thinking(qwen3, continuous):
  """Qwen3: the content after </think> is scored; a completion cut off while thinking
  has no content and scores 0 even when its thinking holds the right answer, unless the
  rollout is told to read everything (reasoning="none")."""
  def closed(text):
    return qwen3.encode(f"<think>\nmaybe <answer>99</answer>\n</think>\n\n"
                        f"<answer>{_answer_of(text)}</answer>") + [qwen3.eos_id]

  samples, w = _rollout(_Scripted(qwen3, closed), qwen3, continuous=continuous)
  assert w.reads_reasoning
  for s in samples:
    assert s.text == f"<answer>{_answer_of(_text(qwen3, s.prompt_tokens))}</answer>"
    assert s.reasoning == "maybe <answer>99</answer>" and s.reasoning_closed
    close = qwen3._tok.token_to_id("</think>")
    assert s.reasoning_tokens == s.response_tokens.index(close) + 1
    assert verifier_value(s.reward) == 1.0

  def unclosed(text):
    return qwen3.encode(f"<think>\nit is <answer>{_answer_of(text)}</answer> but let me "
                        "check it again, and again, and again, and again")

  samples, _ = _rollout(_Scripted(qwen3, unclosed), qwen3, continuous=continuous, new=24)
  for s in samples:
    assert s.finish_reason == "length" and not s.reasoning_closed and s.text == ""
    assert s.reasoning_tokens == 24 and verifier_value(s.reward) == 0.0
  samples, w = _rollout(_Scripted(qwen3, unclosed), qwen3, continuous=continuous, new=24,
                        reasoning="none")
  assert not w.reads_reasoning
  assert all(verifier_value(s.reward) == 1.0 and s.reasoning_tokens == 0 for s in samples)


def test_thinking_switch_reaches_the_prompts(qwen3, harmony):
  def answer(text):
    return qwen3.encode(f"<answer>{_answer_of(text)}</answer>") + [qwen3.eos_id]

  samples, _ = _rollout(_Scripted(qwen3, answer), qwen3, thinking=False)
  assert all(_text(qwen3, s.prompt_tokens).endswith("assistant\n<think>\n\n</think>\n\n")
             for s in samples)
  # Answered without thinking: all content, nothing counted as reasoning.
  assert all(verifier_value(s.reward) == 1.0 and s.reasoning_tokens == 0 for s in samples)
  samples, _ = _rollout(_Scripted(harmony, lambda t: []), harmony, thinking="high", new=1)
  assert all("Reasoning: high" in _text(harmony, s.prompt_tokens) for s in samples)
  with pytest.raises(ValueError, match="gpt-oss always reasons"):
    _rollout(_Scripted(harmony, lambda t: []), harmony, thinking=False)
  with pytest.raises(ValueError, match="reasoning='maybe'"):
    _rollout(_Scripted(harmony, lambda t: []), harmony, reasoning="maybe")


def test_harmony_scores_the_final_channel(harmony):
  def reply(text):
    return harmony.encode("<|channel|>analysis<|message|>add them<|end|>"
                          "<|start|>assistant<|channel|>final<|message|>"
                          f"<answer>{_answer_of(text)}</answer><|return|>")

  samples, _ = _rollout(_Scripted(harmony, reply), harmony)
  for s in samples:
    assert s.text == f"<answer>{_answer_of(_text(harmony, s.prompt_tokens))}</answer>"
    assert s.reasoning == "add them" and s.reasoning_closed
    assert verifier_value(s.reward) == 1.0
  # Read as plain text the channel names run into the answer.
  samples, _ = _rollout(_Scripted(harmony, reply), harmony, reasoning="none")
  assert all(s.text.startswith("analysisadd themassistantfinal<answer>") for s in samples)


TOOL_PAIRS = [("tools/calc_l1", 3), ("tools/calc_l1", 5)]


@pytest.mark.parametrize("continuous,segment", [(True, 0), (False, 0), (False, 3)])
def test_multi_turn_transcript_is_what_the_template_renders(qwen3, continuous, segment):
  """A tool-using Qwen3 rollout (think, call, read the answer, think, answer): the whole
  transcript equals the Qwen3 template's rendering of the conversation, the reasoning of
  both turns is kept apart from the scored text, and the tool call scores in full. In
  segments of 3 tokens, </think> arrives in a later segment than <think>."""
  tasks = {_task(p).prompt: _task(p) for p in TOOL_PAIRS}

  def reply(text):
    task = next(t for p, t in tasks.items() if p in text)
    if "<tool_response>" not in text:
      return qwen3.encode(f"<think>\nneed a tool\n</think>\n\n<tool>calculator: "
                          f"{task.metadata['call']}</tool>") + [qwen3.eos_id]
    return qwen3.encode(f"<think>\ngot it\n</think>\n\n<answer>{task.answer}</answer>"
                        ) + [qwen3.eos_id]

  samples, _ = _rollout(_Scripted(qwen3, reply), qwen3, pairs=TOOL_PAIRS, max_turns=3,
                        continuous=continuous, segment_tokens=segment)
  for s in samples:
    task = next(t for p, t in tasks.items() if p in _text(qwen3, s.prompt_tokens))
    convo = [{"role": "user", "content": task.prompt},
             {"role": "assistant", "reasoning_content": "need a tool",
              "content": f"<tool>calculator: {task.metadata['call']}</tool>"},
             {"role": "tool", "content": f"<observation>{task.answer}</observation>"},
             {"role": "assistant", "reasoning_content": "got it",
              "content": f"<answer>{task.answer}</answer>"}]
    want = _hf(qwen3).apply_chat_template(convo, chat_template=QWEN3_TEMPLATE, tokenize=False)
    assert _text(qwen3, s.prompt_tokens + s.response_tokens) + "\n" == want
    assert s.turns == 2 and s.tool_calls == 1
    assert s.text == (f"<tool>calculator: {task.metadata['call']}</tool>\n"
                      f"<observation>{task.answer}</observation>\n<answer>{task.answer}</answer>")
    assert s.reasoning == "need a tool\n\ngot it" and s.reasoning_closed
    close = qwen3._tok.token_to_id("</think>")
    firsts = [k for k, t in enumerate(s.response_tokens) if t == close]
    second_turn = s.response_mask.index(1, s.response_mask.index(0))
    assert s.reasoning_tokens == firsts[0] + 1 + firsts[1] + 1 - second_turn
    assert s.reward.value == 1.0


def test_deepseek_r1_tool_turns_read_reasoning_only_where_the_prompt_opened_it(deepseek):
  """DeepSeek-R1: the first turn follows "<｜Assistant｜><think>\n", so what precedes its
  </think> is reasoning; the turn after a tool's answer follows the tool outputs' end and
  is all content (it scored 0 when read as unfinished reasoning)."""
  tasks = {_task(p).prompt: _task(p) for p in TOOL_PAIRS}

  def reply(text):
    task = next(t for p, t in tasks.items() if p in text)
    if "tool▁outputs▁end" not in text:
      return deepseek.encode(f"need a tool\n</think>\n\n<tool>calculator: "
                             f"{task.metadata['call']}</tool>") + [deepseek.eos_id]
    return deepseek.encode(f"<answer>{task.answer}</answer>") + [deepseek.eos_id]

  for continuous in (True, False):
    samples, _ = _rollout(_Scripted(deepseek, reply), deepseek, pairs=TOOL_PAIRS,
                          max_turns=3, continuous=continuous)
    for s in samples:
      assert s.turns == 2 and s.reward.value == 1.0, s.text
      assert s.reasoning == "need a tool" and s.reasoning_closed
      assert s.text.endswith("</observation>\n<answer>" + s.text.split("<answer>")[-1])
      text = _text(deepseek, s.prompt_tokens + s.response_tokens)
      assert "<｜end▁of▁sentence｜><｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>" in text


@pytest.mark.parametrize("continuous", [True, False])
def test_native_tool_calls_are_the_templates_and_score_as_the_protocols(qwen3, continuous):
  """tool_format=native with Qwen3: the prompt carries the task's tool schema (not the
  domain's text protocol), the model calls it in Qwen's <tool_call> JSON and reads the
  bare result in a <tool_response>; the whole transcript is the Qwen3 template's rendering
  of that conversation with tools, and the call scores as a valid protocol call."""
  from posttrain.tasks.families.tools import NATIVE_TOOLS
  from tests.data.test_reasoning import QWEN3_TOOLS_TEMPLATE
  tasks = {_task(p).metadata["call"]: _task(p) for p in TOOL_PAIRS}

  def reply(text):
    task = next(t for call, t in tasks.items() if f"What is {call}?" in text)
    assert "<tool>" not in text and '"name": "calculator"' in text
    if "<tool_response>" not in text:
      return qwen3.encode(
          '<think>\nneed a tool\n</think>\n\n<tool_call>\n{"name": "calculator", '
          f'"arguments": {{"expression": "{task.metadata["call"]}"}}}}\n</tool_call>'
      ) + [qwen3.eos_id]
    return qwen3.encode(f"<think>\ngot it\n</think>\n\n<answer>{task.answer}</answer>"
                        ) + [qwen3.eos_id]

  samples, _ = _rollout(_Scripted(qwen3, reply), qwen3, pairs=TOOL_PAIRS, max_turns=3,
                        continuous=continuous, tool_format="native", new=256)
  assert len(samples) == 2 * len(TOOL_PAIRS)  # a group of 2 a task
  for s in samples:
    task = next(t for call, t in tasks.items()
                if f"What is {call}?" in _text(qwen3, s.prompt_tokens))
    question = registry.get(task.domain).native_tools(task)[0]
    call = {"name": "calculator", "arguments": {"expression": task.metadata["call"]}}
    convo = [{"role": "user", "content": question},
             {"role": "assistant", "reasoning_content": "need a tool", "content": "",
              "tool_calls": [{"type": "function", "function": call}]},
             {"role": "tool", "content": task.answer},
             {"role": "assistant", "reasoning_content": "got it",
              "content": f"<answer>{task.answer}</answer>"}]
    want = _hf(qwen3).apply_chat_template(convo, tools=[NATIVE_TOOLS["calculator"]],
                                          chat_template=QWEN3_TOOLS_TEMPLATE, tokenize=False)
    assert _text(qwen3, s.prompt_tokens + s.response_tokens) + "\n" == want
    assert s.text.startswith(f"<tool>calculator: {task.metadata['call']}</tool>")
    assert s.reward.value == 1.0 and s.reward.components["tool_valid"] == 1.0
  with pytest.raises(ValueError, match="tool_format='json'"):
    _rollout(_Scripted(qwen3, reply), qwen3, tool_format="json")
  with pytest.raises(ValueError, match="does not render tool schemas"):
    _rollout(_Scripted(ByteTokenizer(), reply), ByteTokenizer(), tool_format="native")


def test_native_tool_demonstrations_are_the_templates_tool_calls(qwen3):
  """With tool_format=native, a tool domain's SFT demonstration is the model's own call,
  the tool's answer and the answer, rendered as the Qwen3 template renders those turns
  with tools, after exactly the rollouts' prompt; only the model's turns are trained."""
  from posttrain import trainer
  from posttrain.tasks.families.tools import NATIVE_TOOLS
  from tests.data.test_reasoning import QWEN3_TOOLS_TEMPLATE
  w = worker_lib.RolloutWorker(_Scripted(qwen3, lambda t: []), qwen3, group_size=1,
                               max_new_tokens=4, process=(0, 1), tool_format="native")
  try:
    ex = trainer._sft_example(["tools/calc_l1"], qwen3, 1, tool_format="native")
    task = registry.get("tools/calc_l1").sample(2)
    assert ex["prompt_tokens"].tolist() == w.prompt_tokens(task)
  finally:
    w.close()
  question = registry.get("tools/calc_l1").native_tools(task)[0]
  call = {"name": "calculator", "arguments": {"expression": task.metadata["call"]}}
  want = _hf(qwen3).apply_chat_template(
      [{"role": "user", "content": question},
       {"role": "assistant", "content": "", "tool_calls": [{"function": call}]},
       {"role": "tool", "content": task.answer},
       {"role": "assistant", "content": f"<answer>{task.answer}</answer>"}],
      tools=[NATIVE_TOOLS["calculator"]], chat_template=QWEN3_TOOLS_TEMPLATE, tokenize=False)
  whole = ex["prompt_tokens"].tolist() + ex["response_tokens"].tolist()
  assert _text(qwen3, whole) == want
  trained = ex["response_tokens"][ex["response_mask"] != 0].tolist()
  assert "<tool_response>" not in _text(qwen3, trained)
  assert _text(qwen3, trained).endswith(f"<answer>{task.answer}</answer><|im_end|>")


def test_llama31_native_tool_calls_are_its_templates(tmp_path):
  """tool_format=native with Llama 3.1: the schemas in the first user message, the call a
  JSON answer, the result a JSON string in an ipython turn; the transcript is the template's
  rendering of that conversation with tools; the SFT demonstration opens as the prompt."""
  from posttrain import trainer
  from posttrain.tasks.families.tools import NATIVE_TOOLS
  from tests.data.test_reasoning import LLAMA31_TOOLS_TEMPLATE, llama31_tokenizer
  tok = llama31_tokenizer(tmp_path)
  eot = tok._tok.token_to_id("<|eot_id|>")
  tasks = {_task(p).metadata["call"]: _task(p) for p in TOOL_PAIRS}

  def reply(text):
    task = next(t for call, t in tasks.items() if f"What is {call}?" in text)
    if "ipython<|end_header_id|>" not in text.split("Cutting Knowledge")[-1]:
      return tok.encode(tok.chat.write_tool_call(
          "calculator", {"expression": task.metadata["call"]})) + [eot]
    return tok.encode(f"<answer>{task.answer}</answer>") + [eot]

  samples, _ = _rollout(_Scripted(tok, reply), tok, pairs=TOOL_PAIRS, max_turns=3,
                        tool_format="native", new=256)
  hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok._tok,
                                            bos_token="<|begin_of_text|>")
  for s in samples:
    task = next(t for call, t in tasks.items()
                if f"What is {call}?" in _text(tok, s.prompt_tokens))
    question = registry.get(task.domain).native_tools(task)[0]
    call = {"name": "calculator", "arguments": {"expression": task.metadata["call"]}}
    want = hf.apply_chat_template(
        [{"role": "user", "content": question},
         {"role": "assistant", "tool_calls": [{"function": call}]},
         {"role": "tool", "content": task.answer},
         {"role": "assistant", "content": f"<answer>{task.answer}</answer>"}],
        tools=[NATIVE_TOOLS["calculator"]], chat_template=LLAMA31_TOOLS_TEMPLATE,
        tokenize=False, date_string="26 Jul 2024")
    assert _text(tok, s.prompt_tokens + s.response_tokens) == want
    assert s.reward.value == 1.0 and s.reward.components["tool_valid"] == 1.0
  w = worker_lib.RolloutWorker(_Scripted(tok, reply), tok, group_size=1, max_new_tokens=4,
                               process=(0, 1), tool_format="native")
  try:
    ex = trainer._sft_example(["tools/calc_l1"], tok, 1, tool_format="native")
    assert ex["prompt_tokens"].tolist() == w.prompt_tokens(registry.get(
        "tools/calc_l1").sample(2))
  finally:
    w.close()


def test_harmony_multi_turn_has_one_system_message(harmony):
  """A tool's answer goes on from the model's <|return|>, with no second system message
  (a conversation's whole opening used to be encoded again before each tool answer)."""
  tasks = {_task(p).prompt: _task(p) for p in TOOL_PAIRS}

  def reply(text):
    task = next(t for p, t in tasks.items() if p in text)
    if "functions to=assistant" not in text:
      return harmony.encode(f"<|channel|>final<|message|><tool>calculator: "
                            f"{task.metadata['call']}</tool><|return|>")
    return harmony.encode(f"<|channel|>final<|message|><answer>{task.answer}</answer>"
                          "<|return|>")

  samples, _ = _rollout(_Scripted(harmony, reply), harmony, pairs=TOOL_PAIRS, max_turns=3)
  for s in samples:
    text = _text(harmony, s.prompt_tokens + s.response_tokens)
    assert text.count("<|start|>system") == 1 and s.reward.value == 1.0
    assert "<|return|><|start|>functions to=assistant<|channel|>commentary<|message|>" in text


def test_think_mode_reads_text_tags_of_a_byte_tokenizer():
  tok = ByteTokenizer()

  def reply(text):
    return tok.encode(f"<think>hmm</think><answer>{_answer_of(text)}</answer>") + [tok.eos_id]

  samples, w = _rollout(_Scripted(tok, reply), tok, reasoning="think")
  assert w.reads_reasoning
  assert all(s.reasoning == "hmm" and verifier_value(s.reward) == 1.0
             and s.reasoning_tokens == len("<think>hmm</think>") for s in samples)
  _, w = _rollout(_Scripted(tok, reply), tok)
  assert not w.reads_reasoning  # auto: the byte tokenizer's format marks no reasoning



@pytest.mark.parametrize("layout,thinking", [("byte", None), ("qwen3", False),
                                             ("qwen3", None), ("harmony", "low"),
                                             ("deepseek", None)])
def test_sft_demonstrations_open_as_the_rollouts_prompts(qwen3, harmony, deepseek, layout,
                                                         thinking):
  """The warm start's demonstrations and the rollouts share their prompt, token for token:
  the system prompt and the reasoning switch reach both (rollout.system_prompt /
  rollout.thinking)."""
  from posttrain import trainer
  tok = {"byte": ByteTokenizer(), "qwen3": qwen3, "harmony": harmony,
         "deepseek": deepseek}[layout]
  w = worker_lib.RolloutWorker(_Scripted(tok, lambda t: []), tok, group_size=1,
                               max_new_tokens=4, process=(0, 1), thinking=thinking,
                               system_prompt="Think, then answer.")
  try:
    for index in range(3):
      ex = trainer._sft_example(["arithmetic/add_d1"], tok, index, "Think, then answer.",
                                thinking)
      task = registry.get("arithmetic/add_d1").sample(index * 2)
      whole = ex["prompt_tokens"].tolist() + ex["response_tokens"].tolist()
      prompt = w.prompt_tokens(task)
      assert whole[:len(prompt)] == prompt
      # Qwen3 with thinking off: the empty <think> block the rollout prompt closes is, in
      # the demonstration, the last assistant message's own (the template renders it so).
      closed = len(tok.encode("<think>\n\n</think>\n\n")) if thinking is False else 0
      assert len(ex["prompt_tokens"]) == len(prompt) - closed
      text = (_text(tok, w.prompt_tokens(task)) if layout != "byte"
              else tok.decode(w.prompt_tokens(task)))
      assert "Think, then answer." in text
  finally:
    w.close()
