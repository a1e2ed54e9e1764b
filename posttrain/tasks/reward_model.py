"""Model-based scoring as a supplement to (or replacement of) a domain's verifier.

A scorer is anything with ``score_texts(prompts, completions) -> list[float]`` (for
instance the policy transformer with a scalar head, loaded from a checkpoint).
``ModelScoredDomain`` keeps the wrapped domain's tasks and mixes the two signals:

    value = (1 - mix) * verifier_value + mix * squash(model_score)

``mix=1`` scores with the model alone; ``squash`` maps the raw scalar into [0, 1] (``clip``
for scorers that already emit probabilities, ``sigmoid`` for logits). A scorer that raises
or returns a non-finite number degrades to the verifier value, never to an exception.

``mix_rewards`` is the rule on its own, for callers that score a batch themselves (the
trainer scores every rollout sample of a step with one call); ``verifier_value`` is the
verifier's part of a mixed reward, what pass rates count.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from posttrain.tasks.base import Domain, Reward, StepResult, Task

SQUASH = ("clip", "sigmoid")


@runtime_checkable
class RewardModelScorer(Protocol):
    def score_texts(self, prompts: Sequence[str], completions: Sequence[str]) -> list[float]: ...


def _squash(x: float, how: str) -> float:
    if how == "sigmoid":
        return 0.5 * (1.0 + math.tanh(0.5 * x))  # overflow-free logistic
    return min(1.0, max(0.0, x))


class ModelScoredDomain(Domain):
    """Wraps ``domain`` so ``score`` mixes its verifier with a reward model."""

    def __init__(
        self,
        domain: Domain,
        scorer: RewardModelScorer,
        mix: float = 0.5,
        squash: str = "clip",
        name: str | None = None,
    ):
        if not isinstance(scorer, RewardModelScorer):
            raise TypeError(
                f"scorer must have score_texts(prompts, completions), got {type(scorer).__name__}"
            )
        if not 0.0 <= mix <= 1.0:
            raise ValueError(f"mix must be in [0, 1], got {mix!r}")
        if squash not in SQUASH:
            raise ValueError(f"squash must be one of {SQUASH}, got {squash!r}")
        super().__init__(name or domain.name, domain.family, domain.level)
        self.inner, self.scorer, self.mix, self.squash = domain, scorer, mix, squash
        self.multi_turn = domain.multi_turn

    def sample(self, seed):
        task = self.inner.sample(seed)
        if self.name == self.inner.name:
            return task
        return Task(
            self.name, task.seed, task.prompt, task.answer, task.metadata, task.level, task.family
        )

    def demonstration(self, task):
        return self.inner.demonstration(self._inner_task(task))

    def step(self, task, transcript):
        if not hasattr(self.inner, "step"):
            return StepResult(None, True)  # single-turn: the first reply is final
        return self.inner.step(self._inner_task(task), transcript)

    def _inner_task(self, task: Task) -> Task:
        if not isinstance(task, Task) or task.domain == self.inner.name:
            return task
        return Task(
            self.inner.name,
            task.seed,
            task.prompt,
            task.answer,
            task.metadata,
            task.level,
            task.family,
        )

    def _score(self, task, completion):
        return self.score_many([task], [completion])[0]

    def score_many(self, tasks: Sequence[Task], completions: Sequence[str]) -> list[Reward]:
        """Scores a batch with one scorer call; never raises."""
        if len(tasks) != len(completions):
            raise ValueError(f"got {len(tasks)} tasks but {len(completions)} completions")
        verified = self.inner.score_many([self._inner_task(t) for t in tasks], list(completions))
        if self.mix == 0.0:
            return [_with(r, r.value, None, r.verdict) for r in verified]
        try:
            raw = list(self.scorer.score_texts([t.prompt for t in tasks], list(completions)))
            if len(raw) != len(tasks):
                raise ValueError(f"scorer returned {len(raw)} scores for {len(tasks)} completions")
            model = [float(x) for x in raw]
        except Exception as e:  # noqa: BLE001 - a broken scorer must not stop training
            error = f"{type(e).__name__}: {str(e)[:120]}"
            return [
                _with(r, r.value, None, f"{r.verdict}; reward model failed ({error})")
                for r in verified
            ]
        return mix_rewards(verified, model, self.mix, self.squash)


def mix_rewards(
    verified: Sequence[Reward], scores: Sequence[float], mix: float, squash: str
) -> list[Reward]:
    """Mixes each verifier reward with a reward model's raw score.

        value = (1 - mix) * verifier + mix * squash(score)

    Each result keeps the verifier's components and adds ``verifier`` (the verifier's
    value; an earlier mix's ``verifier`` is kept) and ``model`` (the squashed score). A
    non-finite score gives the verifier's value, without ``model``, and says so in the
    verdict.

    Raises:
        ValueError: ``mix`` outside [0, 1], an unknown ``squash``, or as many scores as
            rewards not given.
    """
    if not 0.0 <= mix <= 1.0:
        raise ValueError(f"mix must be in [0, 1], got {mix!r}")
    if squash not in SQUASH:
        raise ValueError(f"squash must be one of {SQUASH}, got {squash!r}")
    if len(verified) != len(scores):
        raise ValueError(f"got {len(scores)} scores for {len(verified)} rewards")
    out = []
    for r, m in zip(verified, scores):
        m = float(m)
        if not math.isfinite(m):
            out.append(_with(r, r.value, None, f"{r.verdict}; reward model gave {m}"))
            continue
        s = _squash(m, squash)
        out.append(_with(r, (1.0 - mix) * r.value + mix * s, s, r.verdict))
    return out


def verifier_value(reward: Reward) -> float:
    """The verifier's value of a reward, mixed with a model's score or not: what a pass
    (value 1) is judged on."""
    return float(reward.components.get("verifier", reward.value))


def _with(r: Reward, value: float, model: float | None, verdict: str) -> Reward:
    components = dict(r.components)
    # A reward mixed twice (a wrapped domain, then the trainer's model) keeps the first
    # verifier value: the program's verdict, not an earlier mix.
    components["verifier"] = verifier_value(r)
    if model is not None:
        components["model"] = model
    return Reward(value, components, verdict)
