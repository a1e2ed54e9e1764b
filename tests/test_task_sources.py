"""A run's own tasks: JSON-lines task files, Python modules of domains and reasoning-gym
datasets, registered from the config, selected by tasks.domains, evaluated on eval.domains,
and trained on end to end."""

import importlib.util
import json

import pytest

from configs import default
from posttrain import experiment, planner, trainer
from posttrain.metrics import read_metrics
from posttrain.tasks import registry


@pytest.fixture(autouse=True)
def _clean_registry():
  before = set(registry.names())
  yield
  for name in set(registry.names()) - before:
    registry.unregister(name)
    experiment._SOURCED.pop(name, None)


def _write(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def _config(**over):
  return planner.override(default.get_config(), over)


def test_task_files_join_the_run_and_eval_domains_pick_the_held_out_file(tmp_path):
  train = _write(tmp_path / "sums_train.jsonl",
                 [{"prompt": f"What is {i}/{i + 1}?", "answer": f"{i / (i + 1)}"} for i in
                  range(1, 5)]
                 + [{"prompt": "Spell it.", "answer": "Cat", "verifier": "exact_ci"}])
  test = _write(tmp_path / "sums_test.jsonl", [{"prompt": "What is 1/4?", "answer": "0.25"}])
  c = _config(**{"tasks.files": f"{train}, {test}", "tasks.file_verifier": "numeric",
                 "tasks.domains": "jsonl/sums_train,arithmetic/add_d1",
                 "eval.domains": "jsonl/sums_test"})
  assert experiment.run_domains(c) == ["jsonl/sums_train", "arithmetic/add_d1"]
  assert experiment.eval_domains(c) == ["jsonl/sums_test"]
  assert experiment.run_domains(c) == ["jsonl/sums_train", "arithmetic/add_d1"]  # again: same
  domain = registry.get("jsonl/sums_train")
  task = domain.sample(0)
  assert task.prompt.startswith("What is 1/2?")
  # The file's verifier (numeric) reads rows without one: 1/2 is 0.5.
  assert domain.score(task, "<answer>1/2</answer>").value == 1.0
  assert domain.score(task, "<answer>0.6</answer>").value == 0.0
  # A row's own verifier wins: exact_ci.
  assert domain.score(domain.sample(8), "<answer>cAT</answer>").value == 1.0
  # Without eval.domains, evaluation visits the run's domains.
  assert experiment.eval_domains(_config(**{
      "tasks.files": train, "tasks.domains": "jsonl/sums_tr*"})) == ["jsonl/sums_train"]


MODULE = '''
from posttrain.tasks import Domain, Reward, Task


class Echo(Domain):
  """Repeat the word."""

  def __init__(self, word):
    super().__init__(f"echo/{word}", "echo", 1)
    self.word = word

  def sample(self, seed):
    return Task(self.name, seed, f"Say {self.word}.", self.word, {}, 1, "echo")

  def _score(self, task, completion):
    ok = completion.strip() == task.answer
    return Reward(float(ok), {"exact": float(ok)}, "correct" if ok else "wrong")


def domains():
  return [Echo("hi"), Echo("bye")]
'''


def test_task_modules_by_path_and_by_name(tmp_path, monkeypatch):
  (tmp_path / "echo_tasks.py").write_text(MODULE)
  (tmp_path / "pkg_tasks.py").write_text(
      "from posttrain.tasks import registry\n" + MODULE.replace("def domains():", "def _d():")
      + "for d in _d():\n  registry.register(d.__class__('named_' + d.word))\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  c = _config(**{"tasks.modules": f"{tmp_path / 'echo_tasks.py'},pkg_tasks",
                 "tasks.domains": "echo/*", "tasks.levels": ""})
  want = ["echo/bye", "echo/hi", "echo/named_bye", "echo/named_hi"]  # registry order
  assert experiment.run_domains(c) == want
  assert experiment.run_domains(c) == want  # again: the module is imported once
  echo = registry.get("echo/hi")
  assert echo.score(echo.sample(2), " hi ").value == 1.0
  assert echo.score(echo.sample(2), "bye").value == 0.0


def test_task_source_errors_are_one_line(tmp_path, monkeypatch):
  good = _write(tmp_path / "a.jsonl", [{"prompt": "p", "answer": "a"}])
  (tmp_path / "other").mkdir()
  twin = _write(tmp_path / "other" / "a.jsonl", [{"prompt": "q", "answer": "b"}])
  cases = [
      ({"tasks.files": str(tmp_path / "nope.jsonl")}, FileNotFoundError, "task file not found"),
      ({"tasks.files": good, "tasks.file_verifier": "fuzzy"}, ValueError,
       "tasks.file_verifier='fuzzy'"),
      ({"tasks.files": f"{good},{twin}"}, ValueError,
       f"tasks.files '{twin}': domain 'jsonl/a' is already registered (from tasks.files "),
      ({"tasks.modules": "no_such_tasks_module"}, ImportError,
       "tasks.modules: cannot import 'no_such_tasks_module'"),
      ({"tasks.modules": str(tmp_path / "missing.py")}, FileNotFoundError, "tasks.modules"),
      ({"tasks.files": _write(tmp_path / "bad.jsonl", [{"prompt": "p"}])}, ValueError,
       "bad.jsonl:1"),
  ]
  (tmp_path / "clash.py").write_text(
      "from posttrain.tasks.families.arithmetic import domains as d\n"
      "def domains():\n  return [d()[0]]\n")
  cases.append(({"tasks.modules": str(tmp_path / "clash.py")}, ValueError, "(built in); rename"))
  (tmp_path / "broken.py").write_text("def domains(:\n")
  cases.append(({"tasks.modules": str(tmp_path / "broken.py")}, ValueError,
                "importing '" + str(tmp_path / "broken.py") + "' failed: SyntaxError"))
  if importlib.util.find_spec("reasoning_gym") is None:  # the extra is not installed
    cases.append(({"tasks.gym": "leg_counting"}, ImportError, "pip install 'posttrain[gym]'"))
  for over, kind, message in cases:
    with pytest.raises(kind) as e:
      experiment.register_task_sources(_config(**over))
    assert message in str(e.value) and "\n" not in str(e.value), (over, str(e.value))
    for name in [n for n in registry.names() if n.startswith("jsonl/")]:
      registry.unregister(name)
      experiment._SOURCED.pop(name, None)
  with pytest.raises(ValueError, match="matches no registered domain"):
    experiment.eval_domains(_config(**{"eval.domains": "jsonl/absent"}))


def test_a_run_trains_on_a_task_file_and_evaluates_on_another(tmp_path):
  """End to end: SFT on the file's demonstrations, RL on its rows (rewards logged under
  its domain), the evaluations on the held-out file's rows only; and launch.eval's
  evaluate_checkpoint sees the same domains."""
  from posttrain import evaluation
  from tests.test_trainer import OVERRIDES
  train = _write(tmp_path / "add_train.jsonl",
                 [{"prompt": f"{a}+{b}=?", "answer": str(a + b)} for a in range(3)
                  for b in range(3)])
  held = _write(tmp_path / "add_held.jsonl", [{"prompt": "3+3=?", "answer": "6"},
                                              {"prompt": "4+1=?", "answer": "5"}])
  over = {**OVERRIDES, "train.rl_steps": 2, "tasks.files": f"{train},{held}",
          "tasks.file_verifier": "int", "tasks.domains": "jsonl/add_train",
          "eval.domains": "jsonl/add_held", "eval.seeds_per_domain": 2}
  c = planner.override(default.get_config(), over)
  work = tmp_path / "run"
  summary = trainer.train(c, str(work))
  assert summary["status"] == "done" and summary["rl_steps"] == 2
  rows = [r for r in read_metrics(str(work)) if "reward/mean" in r]
  assert len(rows) == 2 and all("reward/jsonl/add_train" in r for r in rows)
  final = summary["eval"]["final"]
  assert {t["domain"] for t in final["tasks"]} == {"jsonl/add_held"}
  assert len(final["tasks"]) == 2
  report, _ = evaluation.evaluate_checkpoint(c, str(work), write=False)
  assert list(report["domains"]) == ["jsonl/add_held"]


def test_a_module_registers_a_reward_function_task_files_name(tmp_path):
  """tasks.modules load before tasks.files: a verifier a module registers (here, partial
  credit by distance) scores the file's rows; one that raises scores 0."""
  from posttrain.tasks import jsonl
  (tmp_path / "my_rewards.py").write_text(
      "from posttrain.tasks.jsonl import register_verifier\n"
      "def close(answer, gold):\n"
      "  return max(0.0, 1.0 - abs(float(answer) - float(gold)) / 10)\n"
      "register_verifier('close_to', close)\n")
  rows = _write(tmp_path / "guess.jsonl", [{"prompt": "Guess 50.", "answer": "50"}])
  c = _config(**{"tasks.modules": str(tmp_path / "my_rewards.py"), "tasks.files": rows,
                 "tasks.file_verifier": "close_to", "tasks.domains": "jsonl/guess"})
  try:
    assert experiment.run_domains(c) == ["jsonl/guess"]
    d = registry.get("jsonl/guess")
    task = d.sample(0)
    got = [d.score(task, f"<answer>{x}</answer>") for x in ("50", "47", "100", "fifty")]
    assert [r.value for r in got] == [1.0, pytest.approx(0.7), 0.0, 0.0]
    assert [r.verdict for r in got[:3]] == ["correct", "partial", "wrong"]
    assert got[3].verdict.startswith("error: ValueError")
    with pytest.raises(ValueError, match="is built in"):
      jsonl.register_verifier("exact", lambda a, g: True)
    with pytest.raises(TypeError, match="must be callable"):
      jsonl.register_verifier("x", 3)
  finally:
    jsonl.VERIFIERS.pop("close_to", None)


def test_a_qwen3_run_logs_its_reasoning_and_reads_its_content(tmp_path, scored):
  """End to end with a Qwen3-style tokenizer (ChatML with <think>): the run's prompts close
  thinking when rollout.thinking=off, the verifier reads each completion's content, and
  the reasoning metrics are logged."""
  from tests.data.test_reasoning import QWEN3_SPECIALS, _write_tokenizer
  from tests.test_trainer import OVERRIDES
  tok_dir = tmp_path / "tok"
  tok_dir.mkdir()
  tok = _write_tokenizer(tok_dir, QWEN3_SPECIALS)
  seen = scored
  over = {**OVERRIDES, "tokenizer": str(tok_dir), "model.overrides.vocab_size": 320,
          "train.rl_steps": 1, "sft.steps": 0, "eval.seeds_per_domain": 0,
          "rollout.thinking": "off"}
  c = planner.override(default.get_config(), over)
  assert trainer.train(c, str(tmp_path / "run"))["status"] == "done"
  (row,) = [r for r in read_metrics(str(tmp_path / "run")) if "reward/mean" in r]
  assert seen and 0.0 <= row["reasoning/unclosed_fraction"] <= 1.0
  assert row["reasoning/length_mean"] == pytest.approx(
      sum(s.reasoning_tokens for s in seen) / len(seen))
  for s in seen:
    assert tok._tok.decode(s.prompt_tokens, skip_special_tokens=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert s.text == tok.split_response(s.response_tokens).content


def test_an_unchanged_task_file_is_read_once(tmp_path, monkeypatch):
  from posttrain.tasks import jsonl
  path = _write(tmp_path / "once.jsonl", [{"prompt": "p", "answer": "a"}])
  reads = []
  from_file = jsonl.JsonlDomain.from_file.__func__

  def counting(cls, *a, **k):
    reads.append(a)
    return from_file(cls, *a, **k)

  monkeypatch.setattr(jsonl.JsonlDomain, "from_file", classmethod(counting))
  c = _config(**{"tasks.files": path, "tasks.domains": "jsonl/once"})
  for _ in range(3):
    assert experiment.run_domains(c) == ["jsonl/once"]
  assert len(reads) == 1
  _write(tmp_path / "once.jsonl", [{"prompt": "p", "answer": "b"}, {"prompt": "q", "answer": "c"}])
  assert experiment.run_domains(c) == ["jsonl/once"] and len(reads) == 2
  assert len(registry.get("jsonl/once")) == 2


def test_a_run_on_a_verl_parquet_file_of_math_and_code(tmp_path):
  """End to end on veRL's layout: one Parquet file of math and code rows, split into a
  domain per data_source; SFT on the rows' worked solutions; RL scores the code rows in
  the sandbox and the math rows by their answers, each logged under its own domain."""
  pa = pytest.importorskip("pyarrow")
  pq = pytest.importorskip("pyarrow.parquet")
  from tests.test_trainer import OVERRIDES
  rows = []
  for a in range(4):
    rows.append({"data_source": "sums", "ability": "math",
                 "prompt": [{"role": "user", "content": f"{a}+1? End with #### and it."}],
                 "reward_model": {"style": "rule", "ground_truth": str(a + 1)},
                 "extra_info": {"solution": f"{a}+1={a + 1}\n#### {a + 1}"}})
    tests = {"inputs": [f"{a}\n"], "outputs": [f"{2 * a}\n"]}
    rows.append({"data_source": "double", "ability": "code",
                 "prompt": [{"role": "user", "content": "Print twice the input number."}],
                 "reward_model": {"style": "rule", "ground_truth": json.dumps(tests)},
                 "extra_info": {"solution": "print(2 * int(input()))"}})
  for row in rows:  # the worked solutions, as a preprocessing script would put them
    row["solution"] = row["extra_info"]["solution"]
  path = tmp_path / "mixed.parquet"
  pq.write_table(pa.Table.from_struct_array(pa.array(rows)), path)
  over = {**OVERRIDES, "train.rl_steps": 1, "tasks.files": str(path),
          "tasks.file_verifier": "auto", "tasks.file_split": "data_source",
          "tasks.domains": "jsonl/mixed/*", "eval.seeds_per_domain": 1}
  c = planner.override(default.get_config(), over)
  names = experiment.register_task_sources(c)
  assert names == ["jsonl/mixed/double", "jsonl/mixed/sums"]
  code = registry.get("jsonl/mixed/double")
  task = code.sample(0)
  assert code.demonstration(task) == "```python\nprint(2 * int(input()))\n```"
  assert code.score(task, code.demonstration(task)).value == 1.0  # in the sandbox
  work = tmp_path / "run"
  summary = trainer.train(c, str(work))
  assert summary["status"] == "done" and summary["rl_steps"] == 1
  (row,) = [r for r in read_metrics(str(work)) if "reward/mean" in r]
  assert {"reward/jsonl/mixed/double", "reward/jsonl/mixed/sums"} <= set(row)
