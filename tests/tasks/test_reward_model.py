"""Model-based scoring mixed with verifiers, tested with fake scorers."""

import math

import pytest

from posttrain.tasks import ModelScoredDomain, RewardModelScorer, registry


class ConstantScorer:
    def __init__(self, value):
        self.value = value
        self.calls = 0

    def score_texts(self, prompts, completions):
        self.calls += 1
        assert len(prompts) == len(completions)
        return [self.value] * len(prompts)


class LengthScorer:
    """Scores by completion length (a stand-in for a learned model)."""

    def score_texts(self, prompts, completions):
        return [min(1.0, len(c) / 100) for c in completions]


class BrokenScorer:
    def score_texts(self, prompts, completions):
        raise RuntimeError("checkpoint missing")


BASE = registry.get("arithmetic/add_d1")


def test_scorer_protocol_is_structural():
    assert isinstance(ConstantScorer(0.0), RewardModelScorer)
    with pytest.raises(TypeError, match="score_texts"):
        ModelScoredDomain(BASE, object())


@pytest.mark.parametrize("mix", [0.0, 0.25, 0.5, 1.0])
def test_mixes_verifier_and_model(mix):
    domain = ModelScoredDomain(BASE, ConstantScorer(0.4), mix=mix)
    task = domain.sample(3)
    right = domain.score(task, domain.demonstration(task))
    wrong = domain.score(task, "<answer>-1</answer>")
    assert right.value == pytest.approx((1 - mix) * 1.0 + mix * 0.4)
    assert wrong.value == pytest.approx(mix * 0.4)
    assert right.components["verifier"] == 1.0 and right.components["exact"] == 1.0
    if mix:
        assert right.components["model"] == pytest.approx(0.4)


def test_sigmoid_squash_and_clip():
    logits = ModelScoredDomain(BASE, ConstantScorer(2.0), mix=1.0, squash="sigmoid")
    task = logits.sample(0)
    assert logits.score(task, "x").value == pytest.approx(1 / (1 + math.exp(-2.0)))
    big = ModelScoredDomain(BASE, ConstantScorer(1e6), mix=1.0, squash="sigmoid")
    assert big.score(task, "x").value == pytest.approx(1.0)
    clipped = ModelScoredDomain(BASE, ConstantScorer(7.0), mix=1.0)
    assert clipped.score(task, "x").value == 1.0


def test_batch_scoring_calls_the_model_once():
    scorer = ConstantScorer(1.0)
    domain = ModelScoredDomain(BASE, scorer, mix=0.5)
    tasks = [domain.sample(s) for s in range(5)]
    rewards = domain.score_many(tasks, [domain.demonstration(t) for t in tasks])
    assert scorer.calls == 1 and [r.value for r in rewards] == [1.0] * 5


@pytest.mark.parametrize("scorer", [BrokenScorer(), ConstantScorer(float("nan"))])
def test_failing_model_falls_back_to_verifier(scorer):
    domain = ModelScoredDomain(BASE, scorer, mix=0.7)
    task = domain.sample(1)
    r = domain.score(task, domain.demonstration(task))
    assert r.value == 1.0 and "model" not in r.components
    assert "reward model" in r.verdict


def test_renamed_wrapper_is_a_separate_registered_domain():
    domain = ModelScoredDomain(BASE, LengthScorer(), mix=0.5, name="arithmetic/add_d1_rm")
    task = domain.sample(2)
    assert task.domain == "arithmetic/add_d1_rm" and task.prompt == BASE.sample(2).prompt
    short = domain.score(task, domain.demonstration(task))
    assert short.value == pytest.approx(0.5 + 0.5 * len(domain.demonstration(task)) / 100)
    assert domain.score(BASE.sample(2), "x").verdict.startswith("task belongs")


@pytest.mark.parametrize("kwargs", [{"mix": 1.5}, {"squash": "tanh"}])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        ModelScoredDomain(BASE, ConstantScorer(0.0), **kwargs)


def test_wrapped_single_turn_domain_ends_after_one_turn():
    domain = ModelScoredDomain(BASE, ConstantScorer(0.0))
    step = domain.step(domain.sample(0), "<tool>calculator: 1+1</tool>")
    assert step.done and step.observation is None
    tools = ModelScoredDomain(registry.get("tools/calc_l1"), ConstantScorer(0.0))
    assert tools.step(tools.sample(0), "<tool>calculator: 1+1</tool>").observation == (
        "<observation>2</observation>"
    )
