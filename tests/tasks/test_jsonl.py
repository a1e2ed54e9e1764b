"""User JSONL task files read through grain, with named verifiers."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.tasks import Registry, heldout_seed, train_seed
from posttrain.tasks.jsonl import JsonlDomain
from posttrain.tasks.replay import make_record, replay

ROWS = [
    {"prompt": "Capital of France?", "answer": "Paris"},
    {"prompt": "Half of 3, as a number?", "answer": "1.5", "verifier": "numeric"},
    {
        "prompt": "What is 6*7? Reply in <answer></answer>.",
        "answer": 42,
        "verifier": "int",
        "level": 2,
    },
    {
        "prompt": "Simplify 2x/4.",
        "answer": "x/2",
        "verifier": "math",
        "metadata": {"source": "unit"},
    },
    {"prompt": "Say YES.", "answer": "yes", "verifier": "exact_ci"},
]


@pytest.fixture
def task_file(tmp_path):
    path = tmp_path / "quiz.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    return path


def test_rows_become_tasks_in_seed_order(task_file):
    domain = JsonlDomain.from_file(task_file)
    assert domain.name == "jsonl/quiz" and domain.family == "jsonl" and len(domain) == 5
    for i, row in enumerate(ROWS):
        for seed in (train_seed(i), heldout_seed(i), train_seed(i + 5)):
            task = domain.sample(seed)
            assert task.answer == str(row["answer"]) and task.metadata["row"] == i
            assert task.prompt.startswith(row["prompt"].rstrip())
            assert task.prompt.count("<answer>") == 1  # instruction appended only when missing
    assert domain.sample(4).level == 2 and domain.sample(0).level == 1
    assert domain.sample(6).metadata["source"] == "unit"


@pytest.mark.parametrize(
    "row, good, bad",
    [
        (0, ["Paris", " Paris "], ["paris", "Lyon"]),
        (1, ["1.5", "3/2", "1.50"], ["1.6", "one and a half"]),
        (2, ["42", "+42"], ["42.0", "forty-two"]),
        (3, ["x/2", "x / 2"], ["x", "2x"]),
        (4, ["YES", "yes"], ["no", "yes!"]),
    ],
)
def test_verifiers(task_file, row, good, bad):
    domain = JsonlDomain.from_file(task_file)
    task = domain.sample(train_seed(row))
    for text in good:
        assert domain.score(task, f"<answer>{text}</answer>").value == 1.0, text
    for text in bad:
        r = domain.score(task, f"<answer>{text}</answer>")
        assert r.value == 0.0 and r.components["format"] == 1.0, text
    assert domain.score(task, domain.demonstration(task)).value == 1.0
    assert domain.score(task, "").value == 0.0


def test_a_boxed_answer_counts_where_no_answer_tags_are(task_file):
    """Math models write \\boxed{} unasked: the last one is the answer, nested braces and
    all, unless <answer> tags are there; majority votes read the same."""
    from posttrain import majority_vote
    from posttrain.tasks.jsonl import last_boxed
    domain = JsonlDomain.from_file(task_file)
    half = domain.sample(train_seed(1))
    assert domain.score(half, "so \\boxed{1} no, \\boxed{\\frac{3}{2}}.").value == 1.0
    assert domain.score(half, "\\boxed{3/2} <answer>1.6</answer>").value == 0.0
    assert domain.score(half, "\\boxed{\\frac{3}{2}").value == 0.0  # never closed
    assert last_boxed("a \\boxed{x^{2}} b") == "x^{2}" and last_boxed("none") is None
    keys = [majority_vote.answer_key(domain, half, t)
            for t in ("\\boxed{3/2}", "<answer>1.5</answer>", "\\boxed{1.6}")]
    assert keys[0] == keys[1] != keys[2]


def test_math_verifier_proves_symbolic_equivalence(task_file):
    pytest.importorskip("math_verify")
    domain = JsonlDomain.from_file(task_file)
    task = domain.sample(train_seed(3))
    for text in ["\\frac{x}{2}", "0.5x", "x*0.5"]:
        assert domain.score(task, f"<answer>{text}</answer>").value == 1.0, text


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 9), st.text(max_size=60))
def test_scoring_never_raises(tmp_path_factory, row, text):
    path = tmp_path_factory.mktemp("q") / "q.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS))
    domain = JsonlDomain.from_file(path)
    for completion in (text, f"<answer>{text}</answer>"):
        r = domain.score(domain.sample(row), completion)
        assert 0.0 <= r.value <= 1.0


@pytest.mark.parametrize(
    "line, match",
    [
        ('{"prompt": "p"}', "missing 'answer'"),
        ('{"prompt": "", "answer": "a"}', "non-empty"),
        ('{"prompt": "p", "answer": "a", "verifier": "fuzzy"}', "fuzzy"),
        ('{"prompt": "p", "answer": null}', "None"),
        ('{"prompt": "p", "answer": "a", "level": 0}', "level"),
        ("[1, 2]", "JSON object"),
        ("{nope", "not valid JSON"),
        ('{"prompt": [], "answer": "a"}', "must end with a user message"),
        ('{"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],'
         ' "answer": "a"}', "must end with a user message"),
        ('{"prompt": [{"role": "tool", "content": "q"}], "answer": "a"}', "prompt\\[0\\]"),
        ('{"prompt": [{"role": "user", "content": 3}], "answer": "a"}', "content must be"),
    ],
)
def test_bad_rows_name_file_and_line(tmp_path, line, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=match) as err:
        JsonlDomain.from_file(path)
    assert "bad.jsonl:2" in str(err.value)


def test_missing_or_empty_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        JsonlDomain.from_file(tmp_path / "none.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no rows"):
        JsonlDomain.from_file(tmp_path / "empty.jsonl")


def test_registered_file_domain_replays(task_file):
    reg = Registry([JsonlDomain.from_file(task_file, name="quiz/v1")])
    domain = reg.get("quiz/v1")
    task = domain.sample(2)
    record = make_record(task, "<answer>3/2</answer>", domain.score(task, "<answer>3/2</answer>"))
    assert replay(record, registry=reg).identical


def test_chat_prompts_reach_the_rollouts_as_messages(tmp_path):
    """A row's prompt may be chat messages (veRL's and TRL's prompt column): the task keeps
    them, the instruction goes on the last user message, a prompt asking for \\boxed{} gets
    none, and rollouts and SFT demonstrations open with the messages (a run's system
    prompt only where the row has none)."""
    from posttrain.rollout import task_messages
    rows = [{"prompt": [{"role": "system", "content": "Be exact."},
                        {"role": "user", "content": "1+1?"},
                        {"role": "assistant", "content": "2"},
                        {"role": "user", "content": "2+2?"}], "answer": "4"},
            {"prompt": [{"role": "user", "content": "3+3? Put it in \\boxed{}."}],
             "answer": "6"},
            {"prompt": "5+5? Answer in \\boxed{}.", "answer": "10"}]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    domain = JsonlDomain.from_file(path)
    first, second, third = (domain.sample(train_seed(i)) for i in range(3))
    assert first.prompt == "2+2?\nPut the final answer in <answer></answer>."
    assert task_messages(first, "Ignored: the row has its own.") == (
        rows[0]["prompt"][:3] + [{"role": "user", "content": first.prompt}])
    assert task_messages(second, "Think.") == [
        {"role": "system", "content": "Think."},
        {"role": "user", "content": "3+3? Put it in \\boxed{}."}]
    assert third.prompt == rows[2]["prompt"] and "messages" not in third.metadata
    assert task_messages(third) == [{"role": "user", "content": rows[2]["prompt"]}]
    assert domain.score(second, "so \\boxed{6}").value == 1.0
