"""reasoning-gym adapter (runs only where the optional [gym] extra is installed)."""

import pytest

pytest.importorskip("reasoning_gym")

from posttrain.tasks import heldout_seed, train_seed  # noqa: E402
from posttrain.tasks.gym import GymDomain, available_datasets, gym_domains  # noqa: E402

WELL_BEHAVED = ["basic_arithmetic", "chain_sum", "letter_counting", "word_sorting"]


@pytest.mark.parametrize("dataset", WELL_BEHAVED)
def test_demonstration_scores_one_and_garbage_zero(dataset):
    domain = GymDomain(dataset)
    assert domain.name == f"gym/{dataset}"
    for seed in (train_seed(0), train_seed(7), heldout_seed(3)):
        task = domain.sample(seed)
        assert task == domain.sample(seed)
        assert domain.score(task, domain.demonstration(task)).value == 1.0
        for junk in ("", "no tags", "<answer></answer>", "<answer>\x00zz</answer>", task.prompt):
            assert domain.score(task, junk).value == 0.0


def test_raising_gym_scorer_scores_zero():
    # prime_factorization's own scorer raises ValueError on non-numeric answers.
    domain = GymDomain("prime_factorization")
    task = domain.sample(train_seed(1))
    r = domain.score(task, "<answer>zzz</answer>")
    assert r.value == 0.0 and "raised" in r.verdict
    assert domain.score(task, domain.demonstration(task)).value == 1.0


def test_train_and_heldout_seeds_use_disjoint_items():
    domain = GymDomain("basic_arithmetic", size=64)
    train = {domain.sample(train_seed(i)).metadata["gym_index"] for i in range(100)}
    held = {domain.sample(heldout_seed(i)).metadata["gym_index"] for i in range(100)}
    assert train and held and not train & held


def test_listing_and_errors():
    assert len(available_datasets()) >= 100
    assert [d.name for d in gym_domains(["chain_sum"])] == ["gym/chain_sum"]
    with pytest.raises(ValueError, match="no_such_set"):
        GymDomain("no_such_set")
    with pytest.raises(ValueError, match="size"):
        GymDomain("chain_sum", size=7)
