"""Tools for any domain: a task file's math rows solved with Python run in the sandbox,
scored on what the model itself wrote, through rollouts in both tool formats."""

import json

import pytest

from configs import default
from posttrain import experiment, majority_vote, planner
from posttrain.rollout import worker as worker_lib
from posttrain.tasks import registry, train_seed
from posttrain.tasks.jsonl import JsonlDomain
from posttrain.tasks.tool_use import WithTools, instructions, own_text
from tests.rollout.test_reasoning_rollout import _Scripted, _text

ROWS = [{"prompt": [{"role": "system", "content": "Be exact."},
                    {"role": "user", "content": "What is 2**20? Answer after ####."}],
         "answer": "1048576", "verifier": "int"},
        {"prompt": "What is 3**5?", "answer": "243", "verifier": "int",
         "solution": "3**5 = 243, <answer>243</answer>"}]


@pytest.fixture
def domain(tmp_path):
  path = tmp_path / "powers.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
  return WithTools(JsonlDomain.from_file(path), tools=("python", "calculator"))


@pytest.fixture
def sandbox(module_sandbox):
  return module_sandbox


def test_tasks_are_the_inner_ones_with_the_protocol(domain):
  task = domain.sample(train_seed(0))
  inner = domain.inner.sample(train_seed(0))
  assert domain.name == "jsonl/powers/tools" and domain.family == "jsonl"
  assert domain.multi_turn and task.answer == inner.answer == "1048576"
  assert task.prompt == inner.prompt + "\n" + instructions(("python", "calculator"))
  assert "<tool>python: CODE</tool>" in task.prompt
  # A chat prompt's last user message is the amended prompt; the system message stays.
  assert worker_lib.task_messages(task) == [
      {"role": "system", "content": "Be exact."}, {"role": "user", "content": task.prompt}]
  prompt, tools = domain.native_tools(task)
  assert prompt == inner.prompt and [t["function"]["name"] for t in tools] == [
      "python", "calculator"]
  assert domain.demonstration(domain.sample(train_seed(1))) == ROWS[1]["solution"]


def test_steps_run_the_tool_and_the_score_reads_only_the_models_text(domain, sandbox):
  task = domain.sample(train_seed(0))
  call = "<tool>python: print(2**20)</tool>"
  step = domain.step(task, "Let me compute. " + call)
  assert not step.done and step.observation == "<observation>1048576</observation>"
  calc = domain.step(task, "<tool>calculator: 2**20</tool>")
  assert calc.observation == "<observation>1048576</observation>"
  transcript = f"{call}\n{step.observation}\n"
  assert domain.step(task, transcript + "#### 1048576").done  # a turn without a call ends
  assert domain.step(task, transcript + "<answer>1048576</answer>").done
  # The tool printed the answer; only the model's own writing of it counts.
  assert domain.score(task, transcript).value == 0.0
  right = domain.score(task, transcript + "so #### 1048576")
  assert right.value == 1.0 and right.components["tool_calls"] == 1.0
  assert domain.score(task, "#### 1048576").components["tool_calls"] == 0.0
  # A call written as an answer is no answer.
  assert domain.score(task, "<tool>python: print('#### 1048576')</tool>").value == 0.0
  assert own_text(transcript + "x") == "\n\nx"


def test_calls_are_bounded_and_unknown_tools_are_refused(tmp_path, sandbox):
  path = tmp_path / "p.jsonl"
  path.write_text(json.dumps(ROWS[1]) + "\n")
  only_python = WithTools(JsonlDomain.from_file(path), max_calls=1)
  task = only_python.sample(0)
  step = only_python.step(task, "<tool>calculator: 1+2</tool>")
  assert step.observation == "<observation>error: unknown tool; use one of python</observation>"
  two = "<tool>python: print(1)</tool>\n<observation>1</observation>\n<tool>python: 2</tool>"
  assert only_python.step(task, two).done  # the second call is over max_calls=1


@pytest.mark.parametrize("make, error", [
    (lambda d: WithTools(d, tools=("shell",)), "tools must be distinct names"),
    (lambda d: WithTools(d, tools=()), "tools must be distinct names"),
    (lambda d: WithTools(d, max_calls=0), "max_calls"),
    (lambda d: WithTools(WithTools(d)), "multi-turn already"),
    (lambda d: WithTools(registry.get("tools/calc_l1")), "multi-turn already"),
])
def test_bad_wrappers_fail_clearly(domain, make, error):
  with pytest.raises(ValueError, match=error):
    make(domain.inner)


def test_majority_votes_ignore_what_tools_printed(domain):
  task = domain.sample(train_seed(0))
  printed = "<tool>python: 1</tool>\n<observation>\\boxed{5}</observation>\n"
  keys = [majority_vote.answer_key(domain, task, t) for t in
          (printed, printed + "#### 1048576", "<answer>1048576</answer>")]
  assert keys[0] is None and keys[1] == keys[2] == 1048576


def test_a_run_registers_tool_domains_from_its_config(tmp_path):
  path = tmp_path / "powers.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
  c = planner.override(default.get_config(), {
      "tasks.files": str(path), "tasks.tools": "python", "tasks.tool_domains": "jsonl/*",
      "tasks.tool_max_calls": 2, "tasks.domains": "jsonl/*/tools"})
  try:
    assert experiment.register_task_sources(c) == ["jsonl/powers", "jsonl/powers/tools"]
    assert experiment.run_domains(c) == ["jsonl/powers/tools"]
    wrapped = registry.get("jsonl/powers/tools")
    assert wrapped.tools == ("python",) and wrapped.sample(0).metadata["max_calls"] == 2
    for over, error in [({"tasks.tool_domains": ""}, "give both"),
                        ({"tasks.tools": "shell"}, "the tools are"),
                        ({"tasks.tool_domains": "nothing/*"}, "matches no single-turn")]:
      with pytest.raises(ValueError, match=error):
        experiment.register_task_sources(planner.override(c, over))
  finally:
    for name in ("jsonl/powers", "jsonl/powers/tools"):
      if name in registry.names():
        registry.unregister(name)
      experiment._SOURCED.pop(name, None)


@pytest.mark.parametrize("tool_format", ["text", "native"])
def test_a_rollout_calls_python_and_answers(domain, sandbox, qwen3, tool_format):
  """Qwen3 (thinking): call Python in the turn's text or as Qwen's own call, read the
  observation, answer; the transcript masks the tool's turn and the reward is 1."""

  def reply(text):
    if "tool_response" not in text:
      call = ("<tool>python: print(2**20)</tool>" if tool_format == "text" else
              qwen3.chat.write_tool_call("python", {"code": "print(2**20)"}))
      return qwen3.encode(f"<think>\ncompute it\n</think>\n\n{call}") + [qwen3.eos_id]
    return qwen3.encode("<think>\ndone\n</think>\n\n#### 1048576") + [qwen3.eos_id]

  registry.register(domain)
  try:
    w = worker_lib.RolloutWorker(_Scripted(qwen3, reply), qwen3, group_size=2,
                                 max_new_tokens=160, chunk_rows=4, scoring_threads=1,
                                 process=(0, 1), max_turns=3, tool_format=tool_format)
    try:
      groups = w.rollout([(domain.name, train_seed(0))], seed=0)
    finally:
      w.close()
  finally:
    registry.unregister(domain.name)
  for s in groups[0].samples:
    prompt = _text(qwen3, s.prompt_tokens)
    assert ("# Tools" in prompt) == (tool_format == "native")
    assert ("<tool>python: CODE</tool>" in prompt) == (tool_format == "text")
    assert s.turns == 2 and s.tool_calls == 1
    assert s.text == ("<tool>python: print(2**20)</tool>\n<observation>1048576</observation>"
                      "\n#### 1048576")
    assert s.reward.value == 1.0 and s.reward.components["tool_calls"] == 1.0
    tool_turn = _text(qwen3, [t for t, m in zip(s.response_tokens, s.response_mask) if not m])
    assert "1048576" in tool_turn



@pytest.mark.slow
def test_a_run_trains_on_a_task_file_with_python_at_hand(tmp_path, sandbox):
  """End to end: SFT on the rows' demonstrations, then RL with the Python tool on the
  file's tool domain (multi-turn rollouts), rewards logged under it."""
  from posttrain import trainer
  from posttrain.metrics import read_metrics
  from tests.test_trainer import OVERRIDES
  path = tmp_path / "powers.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
  c = planner.override(default.get_config(), {
      **OVERRIDES, "train.rl_steps": 1, "tasks.files": str(path), "tasks.tools": "python",
      "tasks.tool_domains": "jsonl/*", "tasks.domains": "jsonl/*/tools",
      "rollout.max_turns": 2, "eval.seeds_per_domain": 1, "train.row_len": 384,
      "rollout.max_len": 384})
  try:
    summary = trainer.train(c, str(tmp_path / "run"))
  finally:
    for name in ("jsonl/powers", "jsonl/powers/tools"):
      if name in registry.names():
        registry.unregister(name)
      experiment._SOURCED.pop(name, None)
  assert summary["status"] == "done" and summary["rl_steps"] == 1
  (row,) = [r for r in read_metrics(str(tmp_path / "run")) if "reward/mean" in r]
  assert "reward/jsonl/powers/tools" in row
