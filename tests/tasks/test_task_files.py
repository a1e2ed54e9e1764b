"""Task files as users have them: Parquet and JSON arrays, veRL's RL rows, GSM8K's ####
answers, worked solutions, and code rows whose tests run in the sandbox."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from posttrain import majority_vote
from posttrain.tasks import train_seed
from posttrain.tasks.jsonl import JsonlDomain, read_answer

# Two rows as veRL's examples/data_preprocess scripts write them (gsm8k.py, math_dataset.py).
VERL_ROWS = [
    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "Tom has 3 apples and buys 4. How many? Let's "
                 "think step by step and output the final answer after \"####\"."}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "7"},
     "extra_info": {"split": "train", "index": 0, "answer": "3 + 4 = 7\n#### 7"}},
    {"data_source": "DigitalLearningGmbH/MATH-lighteval",
     "prompt": [{"role": "user", "content": "What is 1/2 + 1/4? Let's think step by step and "
                 "output the final answer within \\boxed{}."}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "\\frac{3}{4}"},
     "extra_info": {"split": "train", "index": 1}},
]


def _parquet(path, rows):
  pq.write_table(pa.Table.from_struct_array(pa.array(rows)), path)
  return path


def test_verl_parquet_rows_load_as_tasks(tmp_path):
  path = _parquet(tmp_path / "train.parquet", VERL_ROWS)
  domain = JsonlDomain.from_file(path, verifier="math")
  assert domain.name == "jsonl/train" and len(domain) == 2
  gsm, frac = domain.sample(train_seed(0)), domain.sample(train_seed(1))
  assert gsm.answer == "7" and frac.answer == "\\frac{3}{4}"
  # The prompts ask for #### and \boxed{}: no answer-tag instruction is added to them.
  assert gsm.prompt == VERL_ROWS[0]["prompt"][0]["content"]
  assert gsm.metadata["messages"] == VERL_ROWS[0]["prompt"]
  assert gsm.metadata["data_source"] == "openai/gsm8k" and gsm.metadata["ability"] == "math"
  assert gsm.metadata["extra_info"]["index"] == 0
  assert domain.score(gsm, "3 apples plus 4 is 7.\n#### 7").value == 1.0
  assert domain.score(gsm, "#### 8").value == 0.0
  assert domain.score(frac, "so \\boxed{\\frac{3}{4}}").value == 1.0
  assert domain.score(frac, "so \\boxed{0.75}").value == 1.0


def test_the_same_rows_from_every_format_make_the_same_tasks(tmp_path):
  lines = tmp_path / "a.jsonl"
  lines.write_text("".join(json.dumps(r) + "\n" for r in VERL_ROWS))
  array = tmp_path / "b.json"
  array.write_text(json.dumps(VERL_ROWS))
  parquet = _parquet(tmp_path / "c.parquet", VERL_ROWS)
  tasks = [[JsonlDomain.from_file(p, name="d/x").sample(train_seed(i)) for i in range(2)]
           for p in (lines, array, parquet)]
  assert tasks[0] == tasks[1] == tasks[2]


@pytest.mark.parametrize("text, answer", [
    ("3+4=7\n#### 7", " 7"),
    ("#### 5\nno, wait\n#### 7\nthat's it", " 7"),
    ("#### 7 <answer>8</answer>", "8"),          # tags first
    ("\\boxed{9} then #### 7", "9"),               # then \boxed{}
    ("nothing", None),
])
def test_read_answer_order(text, answer):
  assert read_answer(text) == answer


def test_majority_votes_read_hashes_answers(tmp_path):
  path = _parquet(tmp_path / "g.parquet", VERL_ROWS[:1])
  domain = JsonlDomain.from_file(path, verifier="numeric")
  task = domain.sample(train_seed(0))
  keys = [majority_vote.answer_key(domain, task, t)
          for t in ("#### 7", "<answer>7.0</answer>", "#### 8")]
  assert keys[0] == keys[1] != keys[2]


def test_verl_rows_fail_clearly_without_ground_truth(tmp_path):
  rows = [dict(VERL_ROWS[0], reward_model={"style": "model"})]
  path = tmp_path / "bad.jsonl"
  path.write_text(json.dumps(rows[0]) + "\n")
  with pytest.raises(ValueError, match=r"bad\.jsonl:1: missing 'answer' \(or reward_model"):
    JsonlDomain.from_file(path)


def test_a_rows_solution_is_its_demonstration(tmp_path):
  rows = [{"prompt": "2+2?", "answer": "4", "solution": "2 and 2 make <answer>4</answer>"},
          {"prompt": "3+3?", "answer": "6"}]
  path = tmp_path / "s.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  domain = JsonlDomain.from_file(path)
  worked, plain = domain.sample(train_seed(0)), domain.sample(train_seed(1))
  assert domain.demonstration(worked) == rows[0]["solution"]
  assert domain.demonstration(plain) == "<answer>6</answer>"
  assert domain.score(worked, domain.demonstration(worked)).value == 1.0
  path.write_text(json.dumps({"prompt": "p", "answer": "a", "solution": ""}) + "\n")
  with pytest.raises(ValueError, match=r"s\.jsonl:1: 'solution' must be a non-empty string"):
    JsonlDomain.from_file(path)


def test_a_mixed_file_splits_into_one_domain_per_source(tmp_path):
  rows = VERL_ROWS + [dict(VERL_ROWS[0], extra_info={"index": 2})]
  path = _parquet(tmp_path / "mix.parquet", rows)
  math, gsm = JsonlDomain.split_file(path, "data_source", verifier="math")  # by name
  assert (gsm.name, len(gsm)) == ("jsonl/mix/openai/gsm8k", 2)
  assert (math.name, len(math)) == ("jsonl/mix/DigitalLearningGmbH/MATH-lighteval", 1)
  assert [gsm.sample(train_seed(i)).metadata["extra_info"]["index"] for i in (0, 1, 2)] == [
      0, 2, 0]
  assert math.sample(train_seed(0)).answer == "\\frac{3}{4}"
  plain = tmp_path / "plain.jsonl"
  plain.write_text(json.dumps({"prompt": "p", "answer": "a"}) + "\n")
  with pytest.raises(ValueError, match=r"plain\.jsonl: row 1 has no 'data_source'"):
    JsonlDomain.split_file(plain, "data_source")


def test_a_run_registers_the_split_domains(tmp_path):
  from configs import default
  from posttrain import experiment, planner
  from posttrain.tasks import registry
  path = _parquet(tmp_path / "mix.parquet", VERL_ROWS)
  c = planner.override(default.get_config(), {
      "tasks.files": str(path), "tasks.file_split": "data_source",
      "tasks.file_verifier": "auto"})
  try:
    names = experiment.register_task_sources(c)
    assert names == ["jsonl/mix/DigitalLearningGmbH/MATH-lighteval", "jsonl/mix/openai/gsm8k"]
    task = registry.get(names[1]).sample(train_seed(0))
    assert task.metadata["verifier"] == "math"  # auto: an answer, not test cases
    assert registry.get(names[1]).score(task, "#### 7").value == 1.0
  finally:
    for name in set(registry.names()) & {"jsonl/mix/DigitalLearningGmbH/MATH-lighteval",
                                         "jsonl/mix/openai/gsm8k"}:
      registry.unregister(name)
      experiment._SOURCED.pop(name, None)


# A PRIME / DeepCoder-style code row (veRL's layout): the ground truth is the tests' JSON.
CODE_ROW = {
    "data_source": "codecontests",
    "prompt": [{"role": "user", "content": "Read n and print n squared. Answer in a "
                "```python block."}],
    "ability": "code",
    "reward_model": {"style": "rule",
                     "ground_truth": json.dumps({"inputs": ["3\n", "12\n", "-2\n"],
                                                 "outputs": ["9\n", "144\n", "4\n"]})},
    "extra_info": {"index": 7},
}
CALL_ROW = {"prompt": "Write add(a, b).", "answer": {"fn_name": "add", "inputs": [[1, 2], [5, 5]],
                                                   "outputs": [[3], [10]]},
            "verifier": "code_partial", "solution": "def add(a, b):\n    return a + b\n"}


@pytest.fixture
def sandbox(module_sandbox):
  return module_sandbox


def _fence(code):
  return f"Here:\n```python\n{code}```\n"


def test_code_rows_run_their_tests_in_the_sandbox(tmp_path, sandbox):
  path = _parquet(tmp_path / "mixed.parquet", VERL_ROWS[:1] + [CODE_ROW])
  domain = JsonlDomain.from_file(path, verifier="auto")
  math_task, code_task = domain.sample(train_seed(0)), domain.sample(train_seed(1))
  assert math_task.metadata["verifier"] == "math"
  assert code_task.metadata["verifier"] == "code"
  assert code_task.prompt == CODE_ROW["prompt"][0]["content"]  # no answer-tag instruction
  assert "144" not in code_task.prompt
  right = _fence("n = int(input())\nprint(n * n)\n")
  abs_only = _fence("n = int(input())\nprint(abs(n) * 3)\n")  # right on 3 only
  completions = [right, abs_only, "no code", _fence("print(("), "#### 7"]
  tasks = [code_task] * 4 + [math_task]
  rewards = domain.score_many(tasks, completions)
  assert [r.value for r in rewards] == [1.0, 0.0, 0.0, 0.0, 1.0]
  assert rewards[0].verdict == "correct"
  assert rewards[1].components["tests_passed"] == pytest.approx(1 / 3)
  assert rewards[2].verdict == "no_code" and rewards[3].verdict == "syntax_error"
  # score() and score_many() agree.
  assert [domain.score(t, c).value for t, c in zip(tasks, completions)] == [
      r.value for r in rewards]
  assert majority_vote.answer_key(domain, code_task, right) is None  # nothing to vote on


def test_call_rows_with_partial_credit_and_a_reference_solution(tmp_path, sandbox):
  path = tmp_path / "calls.jsonl"
  path.write_text(json.dumps(CALL_ROW) + "\n")
  domain = JsonlDomain.from_file(path)
  task = domain.sample(train_seed(0))
  demo = domain.demonstration(task)
  assert demo.startswith("```python\ndef add") and demo.endswith("```")
  assert domain.score(task, demo).value == 1.0
  half = _fence("def add(a, b):\n    return 3\n")
  assert domain.score(task, half).value == 0.5  # code_partial: the fraction passed


def test_bad_code_rows_fail_at_load_naming_the_row(tmp_path):
  rows = [CALL_ROW, dict(CALL_ROW, answer={"inputs": [[1]], "outputs": []}),]
  path = tmp_path / "bad.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  with pytest.raises(ValueError, match=r"bad\.jsonl:2: 'answer'") as e:
    JsonlDomain.from_file(path)
  assert "\n" not in str(e.value)
  no_solution = dict(CALL_ROW)
  del no_solution["solution"]
  path.write_text(json.dumps(no_solution) + "\n")
  domain = JsonlDomain.from_file(path)
  with pytest.raises(ValueError, match="needs a 'solution' to demonstrate"):
    domain.demonstration(domain.sample(train_seed(0)))


def test_a_sharded_split_is_one_domain(tmp_path):
  for i, row in enumerate(VERL_ROWS):
    _parquet(tmp_path / f"train-0000{i}-of-00002.parquet", [row])
  domain = JsonlDomain.from_file(str(tmp_path / "train-*.parquet"), verifier="math")
  assert domain.name == "jsonl/train" and len(domain) == 2
  assert [domain.sample(train_seed(i)).answer for i in (0, 1)] == ["7", "\\frac{3}{4}"]
  with pytest.raises(FileNotFoundError, match="matches no file"):
    JsonlDomain.from_file(str(tmp_path / "test-*.parquet"))


def test_a_saved_dataset_is_a_domain_named_by_its_directory(tmp_path):
  from tests.data.test_rows import _save_to_disk
  saved = _save_to_disk(tmp_path / "gsm8k" / "test", [VERL_ROWS])
  domain = JsonlDomain.from_file(str(saved), verifier="math")
  assert domain.name == "jsonl/test" and len(domain) == 2
  assert domain.score(domain.sample(train_seed(0)), "#### 7").value == 1.0
