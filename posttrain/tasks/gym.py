"""reasoning-gym datasets as domains (optional extra ``[gym]``, imported lazily).

``gym_domains()`` wraps every registered reasoning-gym dataset as ``gym/<dataset>``. Each
domain builds one dataset object lazily (seed ``dataset_seed``, virtual size ``size``) and
maps a task seed to item ``seed % size``; ``size`` is even, so training (even) and held-out
(odd) seeds land on disjoint items. A few datasets precompute ``size`` items when built
(e.g. ``gsm_symbolic``, ``acre``, ``list_functions``): give those a small ``size``.

Scoring runs the dataset's own ``score_answer`` on the text inside the last ``<answer>``
tags; any exception, non-number or NaN from it scores 0. Some datasets accept several
answers and their stored ``answer`` is only an example, so ``demonstration`` is not
guaranteed to score 1.0 for every dataset.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from posttrain.tasks.base import (
    ANSWER_INSTRUCTION,
    MAX_ANSWER_CHARS,
    Domain,
    Reward,
    Task,
    check_seed,
    extract_answer,
    zero_reward,
)

DEFAULT_SIZE = 2**20


def _reasoning_gym():
    try:
        import reasoning_gym
    except ImportError:
        raise ImportError(
            "reasoning-gym is not installed; install the extra: pip install 'posttrain[gym]'"
        ) from None
    return reasoning_gym


def available_datasets() -> list[str]:
    """Names of the datasets registered in the installed reasoning-gym."""
    return sorted(_reasoning_gym().factory.DATASETS)


class GymDomain(Domain):
    """One reasoning-gym dataset behind the ``Domain`` interface."""

    def __init__(
        self,
        dataset: str,
        config: dict[str, Any] | None = None,
        level: int = 1,
        name: str | None = None,
        size: int = DEFAULT_SIZE,
        dataset_seed: int = 0,
    ):
        rg = _reasoning_gym()
        if dataset not in rg.factory.DATASETS:
            raise ValueError(f"unknown reasoning-gym dataset {dataset!r}")
        if size < 2 or size % 2:
            raise ValueError(f"size must be an even int >= 2, got {size!r}")
        name = name or f"gym/{dataset}"
        super().__init__(name, name.split("/", 1)[0], level)
        self.dataset_name = dataset
        self.config = dict(config or {})
        self.size = size
        self.dataset_seed = dataset_seed
        self._entry = functools.lru_cache(maxsize=4096)(self._make_entry)

    @functools.cached_property
    def dataset(self):
        return _reasoning_gym().create_dataset(
            self.dataset_name, seed=self.dataset_seed, size=self.size, **self.config
        )

    def _make_entry(self, index: int) -> dict[str, Any]:
        return self.dataset[index]

    def sample(self, seed):
        seed = check_seed(seed)
        index = seed % self.size
        try:
            entry = self._entry(index)
        except Exception as e:  # surfaces as one line naming the dataset and item
            raise RuntimeError(
                f"{self.name}: generating item {index} failed: {type(e).__name__}: {e}"
            ) from None
        answer = "" if entry.get("answer") is None else str(entry["answer"])
        return Task(
            self.name,
            seed,
            f"{entry['question'].rstrip()}\n{ANSWER_INSTRUCTION}",
            answer,
            {"gym_dataset": self.dataset_name, "gym_index": index},
            self.level,
            self.family,
        )

    def _score(self, task, completion):
        raw = extract_answer(completion)
        if raw is None:
            return zero_reward("no_answer")
        if len(raw) > MAX_ANSWER_CHARS:
            return zero_reward("answer_too_long")
        raw = raw.strip()
        if not raw:
            return zero_reward("unparseable")
        try:
            value = float(
                self.dataset.score_answer(answer=raw, entry=self._entry(task.seed % self.size))
            )
        except Exception as e:  # noqa: BLE001 - some gym scorers raise on malformed answers
            return zero_reward(f"wrong (gym scorer raised {type(e).__name__})", format=1.0)
        if not math.isfinite(value):
            return zero_reward(f"wrong (gym scorer returned {value})", format=1.0)
        value = min(1.0, max(0.0, value))
        exact = float(value >= 1.0)
        return Reward(
            value,
            {"format": 1.0, "exact": exact, "partial": value},
            "correct" if exact else "wrong",
        )


def gym_domains(names: list[str] | None = None, **kwargs) -> list[GymDomain]:
    """``GymDomain``s for ``names`` (default: every dataset except ``composite``)."""
    names = [n for n in available_datasets() if n != "composite"] if names is None else names
    return [GymDomain(n, **kwargs) for n in names]
