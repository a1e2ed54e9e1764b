"""Task/Reward contract, answer extraction and seed families."""

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.tasks import (
    Reward,
    Task,
    extract_answer,
    heldout_seed,
    is_heldout_seed,
    registry,
    train_seed,
)
from posttrain.tasks.base import check_seed


def test_task_json_round_trip():
    task = registry.get("structure/json_l3").sample(train_seed(7))
    back = Task.from_dict(json.loads(json.dumps(task.to_dict())))
    assert back == task


def test_task_from_dict_names_missing_keys():
    with pytest.raises(ValueError, match="answer"):
        Task.from_dict({"domain": "x/y", "seed": 1, "prompt": "p"})


def test_reward_round_trip():
    r = Reward(0.5, {"format": 1.0, "exact": 0.0}, "wrong")
    assert Reward.from_dict(json.loads(json.dumps(r.to_dict()))) == r


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("<answer>7</answer>", "7"),
        ("think <answer>1</answer> more <answer>2</answer>", "2"),
        ("<answer>1</answer> then <answer>2", "1"),  # unclosed last tag: last complete pair
        ("<answer>", None),
        ("</answer><answer>", None),
        ("no tags", None),
        ("", None),
        ("<answer></answer>", ""),
        ("<answer><answer></answer>", ""),  # nested: the innermost (last) opening tag
    ],
)
def test_extract_answer(completion, expected):
    assert extract_answer(completion) == expected


@given(st.integers(0, 2**62 - 1), st.integers(0, 2**62 - 1))
def test_train_and_heldout_seeds_never_collide(i, j):
    assert train_seed(i) != heldout_seed(j)
    assert not is_heldout_seed(train_seed(i))
    assert is_heldout_seed(heldout_seed(j))


@pytest.mark.parametrize("bad", [-1, 2**63, 1.5, "3", True, None])
def test_bad_seed_is_a_one_line_error_naming_it(bad):
    with pytest.raises((TypeError, ValueError), match=re.escape(str(bad))):
        check_seed(bad)
    with pytest.raises((TypeError, ValueError)):
        registry.get("arithmetic/add_d1").sample(bad)


@settings(max_examples=50)
@given(st.text(max_size=300))
def test_extract_answer_never_raises(text):
    out = extract_answer(text)
    assert out is None or out in text
