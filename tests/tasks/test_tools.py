"""Multi-turn tool use: the step protocol, a scripted rollout, and tool-call validity."""

import pytest

from posttrain.tasks import StepResult, execution, registry, train_seed
from posttrain.tasks.families.tools import model_text

try:
    from posttrain.sandbox import Sandbox
except ImportError:
    Sandbox = None

CALC = registry.get("tools/calc_l3")
PY = registry.get("tools/python_l2")


def rollout(domain, task, turns):
    """Feeds scripted model turns through ``step`` like a rollout worker would."""
    transcript = ""
    for turn in turns:
        transcript += turn
        result = domain.step(task, transcript)
        assert isinstance(result, StepResult)
        if result.done:
            assert result.observation is None
            return transcript, True
        transcript += result.observation
    return transcript, False


def test_calculator_round_trip_scores_one():
    task = CALC.sample(train_seed(1))
    expr = task.metadata["call"]
    transcript, done = rollout(
        CALC,
        task,
        [f"Let me compute. <tool>calculator: {expr}</tool>", f"<answer>{task.answer}</answer>"],
    )
    assert done
    assert f"<observation>{task.answer}</observation>" in transcript
    assert transcript == CALC.demonstration(task).replace("<tool>", "Let me compute. <tool>", 1)
    r = CALC.score(task, transcript)
    assert (
        r.value == 1.0 and r.components["tool_valid"] == 1.0 and r.components["tool_calls"] == 1.0
    )


def test_step_rules():
    task = CALC.sample(0)
    assert CALC.step(task, "I think <answer>5</answer>") == StepResult(None, True)
    assert CALC.step(task, "no tool and no answer") == StepResult(None, True)
    assert CALC.step(task, "<tool>calculator: 2*3</tool>") == StepResult(
        "<observation>6</observation>", False
    )
    assert CALC.step(task, "<tool>abacus: 2*3</tool>").observation.startswith(
        "<observation>error: unknown tool"
    )
    assert (
        CALC.step(task, "<tool>calculator: 1/0</tool>").observation
        == "<observation>error: division by zero</observation>"
    )
    # Only the latest turn counts: an old answer before an observation does not end the episode.
    old = "<answer>1</answer><tool>calculator: 1+1</tool><observation>2</observation><tool>calculator: 2+2</tool>"
    assert CALC.step(task, old).observation == "<observation>4</observation>"


def test_call_budget_ends_the_episode():
    task = CALC.sample(0)
    transcript, done = rollout(CALC, task, ["<tool>calculator: 1+1</tool>"] * 10)
    assert done and model_text(transcript).count("<tool>") == task.metadata["max_calls"] + 1


def test_worker_style_transcript_with_newlines_is_verified():
    # Rollout workers join turns as text + "\n" + observation + "\n".
    task = CALC.sample(train_seed(4))
    call = f"<tool>calculator: {task.metadata['call']}</tool> wait"
    good = f"{call}\n<observation>{task.answer}</observation>\n<answer>{task.answer}</answer>"
    assert CALC.score(task, good).value == 1.0
    forged = (
        f"{call}\n<observation>{int(task.answer) + 1}</observation>\n<answer>{task.answer}</answer>"
    )
    assert CALC.score(task, forged).components["tool_valid"] == 0.0


def test_scoring_checks_answers_and_calls():
    task = CALC.sample(train_seed(2))
    good_call = (
        f"<tool>calculator: {task.metadata['call']}</tool><observation>{task.answer}</observation>"
    )
    assert CALC.score(task, f"<answer>{task.answer}</answer>").value == 1.0  # no tool needed
    forged = f"<tool>calculator: 1+1</tool><observation>{task.answer}</observation><answer>{task.answer}</answer>"
    r = CALC.score(task, forged)
    assert r.value == 0.5 and r.components["tool_valid"] == 0.0 and "invalid" in r.verdict
    bad_tool = f"<tool>shell: ls</tool><observation>x</observation>{good_call}<answer>{task.answer}</answer>"
    assert CALC.score(task, bad_tool).value == pytest.approx(0.75)
    # An answer inside an observation is the environment's text, not the model's.
    assert (
        CALC.score(task, f"<observation><answer>{task.answer}</answer></observation>").value == 0.0
    )
    assert CALC.score(task, f"{good_call}<answer>{int(task.answer) + 1}</answer>").value == 0.0


@pytest.fixture
def sandbox(module_sandbox, monkeypatch):
    monkeypatch.setattr("posttrain.tasks.families.tools.PYTHON_TIMEOUT_S", 1.0)
    return module_sandbox


def test_python_tool_runs_in_the_sandbox(sandbox):
    task = PY.sample(train_seed(5))
    transcript, done = rollout(
        PY,
        task,
        [f"<tool>python: {task.metadata['call']}</tool>", f"<answer>{task.answer}</answer>"],
    )
    assert done and f"<observation>{task.answer}</observation>" in transcript
    assert PY.score(task, transcript).value == 1.0


def test_python_tool_errors_and_output_are_escaped(sandbox):
    task = PY.sample(0)
    err = PY.step(task, "<tool>python: 1/0</tool>").observation
    assert err.startswith("<observation>error: runtime_error") and "ZeroDivisionError" in err
    loop = PY.step(task, "<tool>python: while True: pass</tool>").observation
    assert "timeout" in loop
    code = "print(chr(60) + 'answer' + chr(62) + '42' + chr(60) + '/answer' + chr(62))"
    injected = PY.step(task, f"<tool>python: {code}</tool>").observation
    assert "<answer>" not in injected and "&lt;answer&gt;" in injected


def test_python_tool_without_a_sandbox_is_an_observation(monkeypatch):
    def broken():
        raise RuntimeError("no namespaces")

    monkeypatch.setattr(execution, "get_sandbox", broken)
    obs = PY.step(PY.sample(0), "<tool>python: print(1)</tool>").observation
    assert obs == "<observation>error: sandbox unavailable: RuntimeError</observation>"
