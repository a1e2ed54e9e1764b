"""Task, Reward and Domain: the contract every task family implements.

Answer protocol: a completion puts its final answer inside ``<answer>...</answer>``; when
several are present the last one counts. The ``format`` component is 1 when the tags are
present and the content parses as the domain's answer type. Prompts end with
``ANSWER_INSTRUCTION``, which holds an empty tag pair, so an echoed prompt never carries
an answer.

Seeds: sampling is a pure function of ``(domain name, seed)``. Training seeds are even and
held-out (evaluation) seeds are odd (``train_seed(i) = 2i``, ``heldout_seed(i) = 2i + 1``),
so the two sets are disjoint by construction for every domain. Tiny level-1 task spaces
(e.g. 100 one-digit sums) still repeat the same *content* under different seeds.

Scoring never raises and runs in time linear in the completion length: every parser works
with ``str.find``/``rfind`` and answers longer than ``MAX_ANSWER_CHARS`` are rejected
before parsing.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import random
import zlib
from typing import Any

ANSWER_OPEN = "<answer>"
ANSWER_CLOSE = "</answer>"
ANSWER_INSTRUCTION = "Put the final answer in <answer></answer>."
MAX_ANSWER_CHARS = 4096
MAX_SEED = 2**63

_SEED_INDEX_LIMIT = 2**62


@dataclasses.dataclass(frozen=True, slots=True)
class Task:
    """One problem instance; JSON-serialisable through ``to_dict``/``from_dict``."""

    domain: str
    seed: int
    prompt: str
    answer: str
    metadata: dict = dataclasses.field(default_factory=dict, hash=False)
    level: int = 1
    family: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "domain": self.domain,
            "seed": self.seed,
            "prompt": self.prompt,
            "answer": self.answer,
            "metadata": self.metadata,
            "level": self.level,
            "family": self.family,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Task:
        missing = {"domain", "seed", "prompt", "answer"} - set(d)
        if missing:
            raise ValueError(f"task dict lacks keys {sorted(missing)}")
        return cls(
            domain=str(d["domain"]),
            seed=int(d["seed"]),
            prompt=str(d["prompt"]),
            answer=str(d["answer"]),
            metadata=dict(d.get("metadata") or {}),
            level=int(d.get("level", 1)),
            family=str(d.get("family", "")),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Reward:
    """A score in [0, 1], its named components and a short human-readable verdict."""

    value: float
    components: dict = dataclasses.field(default_factory=dict, hash=False)
    verdict: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"value": self.value, "components": dict(self.components), "verdict": self.verdict}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Reward:
        return cls(
            value=float(d["value"]),
            components={str(k): float(v) for k, v in dict(d.get("components") or {}).items()},
            verdict=str(d.get("verdict", "")),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class StepResult:
    """What a multi-turn environment answers to the model's latest turn."""

    observation: str | None
    done: bool


def train_seed(i: int) -> int:
    """The i-th training seed (even); never equal to any ``heldout_seed``."""
    return 2 * _seed_index(i)


def heldout_seed(i: int) -> int:
    """The i-th held-out evaluation seed (odd); never equal to any ``train_seed``."""
    return 2 * _seed_index(i) + 1


def is_heldout_seed(seed: int) -> bool:
    return seed % 2 == 1


def _seed_index(i: int) -> int:
    if isinstance(i, bool):
        raise TypeError(f"seed index must be an int, got {i!r}")
    i = operator.index(i)
    if not 0 <= i < _SEED_INDEX_LIMIT:
        raise ValueError(f"seed index must be in [0, 2**62), got {i}")
    return i


def check_seed(seed: Any) -> int:
    """Returns ``seed`` as an int in [0, 2**63) or raises a one-line error naming it."""
    if isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {seed!r}")
    try:
        seed = operator.index(seed)
    except TypeError:
        raise TypeError(f"seed must be an int, got {seed!r}") from None
    if not 0 <= seed < MAX_SEED:
        raise ValueError(f"seed must be in [0, 2**63), got {seed}")
    return seed


def extract_answer(completion: str) -> str | None:
    """Content of the last ``<answer>...</answer>`` pair, or None when absent."""
    start = completion.rfind(ANSWER_OPEN)
    if start < 0:
        return None
    start += len(ANSWER_OPEN)
    end = completion.find(ANSWER_CLOSE, start)
    if end < 0:
        # An unclosed last tag: fall back to the last complete pair, if any.
        end = completion.rfind(ANSWER_CLOSE, 0, start)
        if end < 0:
            return None
        start = completion.rfind(ANSWER_OPEN, 0, end)
        if start < 0:
            return None
        start += len(ANSWER_OPEN)
    return completion[start:end]


def zero_reward(verdict: str, **components: float) -> Reward:
    comps = {"format": 0.0, "exact": 0.0}
    comps.update(components)
    return Reward(0.0, comps, verdict)


class Domain:
    """A generator of tasks from seeds plus a verifier for completions.

    Subclasses implement ``_sample(rng, seed)`` and ``_score(task, completion)``; the public
    methods add seed validation, determinism and the never-raise guarantee.
    """

    multi_turn: bool = False

    def __init__(self, name: str, family: str, level: int):
        if "/" not in name or not name.startswith(family + "/"):
            raise ValueError(f"domain name must look like '{family}/<op>', got {name!r}")
        if not isinstance(level, int) or level < 1:
            raise ValueError(f"domain level must be an int >= 1, got {level!r}")
        self.name = name
        self.family = family
        self.level = level
        # Mixing the name into the RNG seed gives unrelated tasks for the same seed in
        # different domains; crc32 is stable across processes, unlike hash().
        self._salt = zlib.crc32(name.encode())

    @property
    def track(self) -> str:
        """The name without its level suffix: the ladder this domain sits on."""
        head, sep, tail = self.name.rpartition("_")
        if sep and tail[:1].isalpha() and tail[1:].isdigit():
            return head
        return self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, level={self.level})"

    def rng(self, seed: int) -> random.Random:
        return random.Random((check_seed(seed) << 32) | self._salt)

    def sample(self, seed: int) -> Task:
        return self._sample(self.rng(seed), seed)

    def score(self, task: Task, completion: str) -> Reward:
        """Scores ``completion`` against ``task``; never raises."""
        try:
            if not isinstance(completion, str):
                return zero_reward(f"completion is not a string: {type(completion).__name__}")
            if not isinstance(task, Task):
                return zero_reward(f"task is not a Task: {type(task).__name__}")
            if task.domain != self.name:
                return zero_reward(f"task belongs to {task.domain!r}, not {self.name!r}")
            reward = self._score(task, completion)
        except Exception as e:  # noqa: BLE001 - the contract is that scoring never raises
            return zero_reward(f"error: {type(e).__name__}: {str(e)[:200]}")
        value = reward.value
        if not (isinstance(value, (int, float)) and math.isfinite(value)):
            return zero_reward(f"non-finite score from verifier: {value!r}")
        if not 0.0 <= value <= 1.0:
            reward = Reward(min(1.0, max(0.0, float(value))), reward.components, reward.verdict)
        return reward

    def score_many(self, tasks: list[Task], completions: list[str]) -> list[Reward]:
        """Scores a batch; domains that run programs override this to run them in parallel."""
        if len(tasks) != len(completions):
            raise ValueError(f"got {len(tasks)} tasks but {len(completions)} completions")
        return [self.score(t, c) for t, c in zip(tasks, completions)]

    def demonstration(self, task: Task) -> str:
        """A completion that scores 1.0 (used for the SFT warm start)."""
        return f"{ANSWER_OPEN}{task.answer}{ANSWER_CLOSE}"

    def _sample(self, rng: random.Random, seed: int) -> Task:
        raise NotImplementedError

    def _score(self, task: Task, completion: str) -> Reward:
        raise NotImplementedError
