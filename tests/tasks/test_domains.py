"""The contract every registered domain keeps (issue 6 tests).

Reference answers score 1.0, empty/random/echoed/hostile completions score 0.0 without
raising, the same seed gives the same task (also in a fresh process), and a 1 MB hostile
completion is scored in bounded time.
"""

import functools
import json
import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from posttrain.tasks import Reward, heldout_seed, registry, train_seed
from posttrain.tasks.procedural import ProceduralDomain

from ._subprocess import run_python

ALL = registry.names()
SEEDS = [train_seed(0), train_seed(1), train_seed(12345), heldout_seed(0), heldout_seed(999)]
# Code and tool domains have their own answer formats (tested in test_code/test_tools).
FAST = [n for n in ALL if registry.get(n).family not in ("code", "tools")]


@functools.cache
def _sandbox_problem() -> str | None:
    """Why code domains cannot run here (a host without namespaces), or None."""
    try:
        from posttrain.tasks.execution import get_sandbox

        get_sandbox()
    except Exception as e:  # noqa: BLE001
        return f"no sandbox: {type(e).__name__}: {e}"
    return None


def _valid(r: Reward) -> bool:
    return isinstance(r, Reward) and 0.0 <= r.value <= 1.0 and isinstance(r.verdict, str)


@pytest.mark.parametrize("name", ALL)
def test_demonstration_scores_one_and_sampling_is_deterministic(name):
    domain = registry.get(name)
    if domain.family == "code" and _sandbox_problem():
        pytest.skip(_sandbox_problem())
    for seed in SEEDS:
        task = domain.sample(seed)
        assert task == domain.sample(seed)
        assert (task.domain, task.seed, task.level, task.family) == (
            name,
            seed,
            domain.level,
            domain.family,
        )
        json.dumps(task.to_dict())  # JSON-serialisable
        reward = domain.score(task, domain.demonstration(task))
        assert reward.value == 1.0, (task, reward)
        assert reward.components["format"] == 1.0


@pytest.mark.parametrize("name", ALL)
def test_empty_echo_and_hostile_completions_score_zero(name):
    domain = registry.get(name)
    task = domain.sample(train_seed(3))
    for completion in [
        "",
        " ",
        task.prompt,
        task.prompt * 3,
        "<answer></answer>",
        "<answer>",
        "</answer>",
        "<answer>\x00\ud800\u202e</answer>",
        "<answer>" + "9" * 5000 + "</answer>",
        "<answer>" + "[" * 3000 + "</answer>",
    ]:
        reward = domain.score(task, completion)
        assert _valid(reward)
        assert reward.value == 0.0, (completion[:50], reward)


@pytest.mark.parametrize("name", ALL)
def test_non_string_and_foreign_inputs_never_raise(name):
    domain = registry.get(name)
    task = domain.sample(train_seed(5))
    other = registry.get(
        "arithmetic/add_d1" if name != "arithmetic/add_d1" else "arithmetic/sub_d1"
    )
    for completion in [None, 123, b"<answer>1</answer>", ["x"]]:
        assert domain.score(task, completion).value == 0.0
    assert domain.score(other.sample(0), domain.demonstration(task)).value == 0.0
    assert domain.score("not a task", "x").value == 0.0


@pytest.fixture(scope="module")
def megabyte_garbage():
    rng = random.Random(0)
    pieces = [
        "<answer>",
        "</tool>",
        "<tool>",
        "```python\n",
        "```",
        "<observation>",
        "(",
        "[",
        "{",
        "a",
        "7",
        " ",
        "\n",
        "é",
    ]
    unclosed = "".join(rng.choice(pieces) for _ in range(200_000))
    unclosed = unclosed.replace("</answer>", "")
    return [
        (unclosed + "x" * (1 << 20))[: 1 << 20],
        "<answer>" + "1" * (1 << 20) + "</answer>",
        "<answer>" * (1 << 17),
        "<tool>calculator: 1+1</tool>" * 30_000,
    ]


@pytest.mark.parametrize("name", ALL)
def test_megabyte_hostile_completion_scores_zero_in_bounded_time(name, megabyte_garbage):
    domain = registry.get(name)
    task = domain.sample(train_seed(9))
    for completion in megabyte_garbage:
        start = time.perf_counter()
        reward = domain.score(task, completion)
        elapsed = time.perf_counter() - start
        assert reward.value == 0.0
        # A correctness bound, not a benchmark: linear-time parsing of 1 MB takes
        # milliseconds; a quadratic scan would take minutes.
        assert elapsed < 5.0, (name, elapsed)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(ALL), st.integers(0, 2**63 - 1), st.text(max_size=120))
def test_random_text_never_raises_and_scores_zero(name, seed, text):
    domain = registry.get(name)
    task = domain.sample(seed)
    reward = domain.score(task, text)
    assert _valid(reward)
    if "<answer>" not in text:
        assert reward.value == 0.0


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from([n for n in FAST if isinstance(registry.get(n), ProceduralDomain)]),
    st.integers(0, 2**20),
    # Answer tags inside the content make a different (nested) answer: test_base covers it.
    st.text(max_size=40).filter(lambda t: "<answer>" not in t and "</answer>" not in t),
)
def test_random_tagged_answer_scores_one_only_when_equal(name, seed, text):
    domain = registry.get(name)
    task = domain.sample(seed)
    reward = domain.score(task, f"thinking... <answer>{text}</answer>")
    assert _valid(reward)
    parsed = domain.kind.parse(text)
    assert reward.value == float(parsed is not None and parsed == domain.kind.parse(task.answer))
    assert reward.components["format"] == float(parsed is not None)


def test_same_seed_same_task_in_a_fresh_process():
    names = ALL[::7]
    code = (
        "import json, sys\n"
        "from posttrain.tasks import registry\n"
        "names = json.loads(sys.argv[1])\n"
        "print(json.dumps([registry.get(n).sample(s).to_dict() for n in names for s in (0, 1, 2**62 + 3)]))\n"
    )
    out = run_python("-c", code, json.dumps(names), check=True).stdout
    here = [registry.get(n).sample(s).to_dict() for n in names for s in (0, 1, 2**62 + 3)]
    assert json.loads(out) == here


@pytest.mark.parametrize("name", FAST)
def test_seeds_give_varied_tasks(name):
    domain = registry.get(name)
    prompts = {domain.sample(train_seed(i)).prompt for i in range(40)}
    assert len(prompts) >= 3, name


# Pinned outputs: a generator change silently invalidates every replay record and
# held-out set, so it must show up as a failing test.
GOLDEN = {
    ("arithmetic/add_d1", 12345): ("What is 0+3?", "3"),
    ("strings/reverse_l1", 12345): ("Reverse the string: oak", "kao"),
    ("lists/sort_l3", 12345): (
        "Sort in ascending order: [92, 53, 6, 5, 71, 29]",
        "[5, 6, 29, 53, 71, 92]",
    ),
    ("structure/json_l2", 12345): (
        'In {"a": {"size": 55, "a": 68}, "id": 69}, what is the value of a.a?',
        "68",
    ),
    ("equations/system_l4", 12345): ("Solve: -x + 4y = 41; 5x + y = 68. Answer as x, y", "11, 13"),
}


@pytest.mark.parametrize("key", sorted(GOLDEN))
def test_generators_are_pinned(key):
    task = registry.get(key[0]).sample(key[1])
    assert (task.prompt.splitlines()[0], task.answer) == GOLDEN[key]


def test_level_one_prompts_are_short():
    for name in registry.names(level=1):
        for seed in range(5):
            assert len(registry.get(name).sample(seed).prompt.encode()) <= 400, name
