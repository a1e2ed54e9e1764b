"""Procedural single-turn domains: a generator function plus an answer type.

A family module writes ``generate(rng, level) -> (question, answer, metadata)`` and picks
an answer kind; ``ProceduralDomain`` turns that into a ``Domain``. Answer kinds parse the
text between the answer tags strictly (ASCII digits only, no ``eval``) and say whether it
is in the expected format; the reward value is exact match, and list/string kinds also
report a ``partial`` component (fraction of positions right) for shaping and analysis.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from typing import Any

from posttrain.tasks.base import (
    ANSWER_INSTRUCTION,
    MAX_ANSWER_CHARS,
    Domain,
    Reward,
    Task,
    extract_answer,
    zero_reward,
)

Generator = Callable[[random.Random, int], tuple[str, str, dict]]

_INT_RE = re.compile(r"[+-]?[0-9]+")
_GROUPED_INT_RE = re.compile(r"[+-]?[0-9]{1,3}(?:,[0-9]{3})+")
_LIST_SPLIT_RE = re.compile(r"[,\s]+")
_MAX_INT_CHARS = 400
_QUOTES = "\"'`"


def _unquote(text: str) -> str:
    t = text.strip()
    if len(t) >= 2 and t[0] == t[-1] and t[0] in _QUOTES:
        t = t[1:-1].strip()
    return t


def parse_int(text: str) -> int | None:
    """Strict integer parse: optional sign, ASCII digits, optional 1,000 grouping."""
    t = text.strip()
    if not t or len(t) > _MAX_INT_CHARS:
        return None
    if _INT_RE.fullmatch(t):
        return int(t)
    if _GROUPED_INT_RE.fullmatch(t):
        return int(t.replace(",", ""))
    return None


def parse_int_list(text: str) -> list[int] | None:
    """Parses ``[1, 2, 3]``, ``1, 2, 3`` or ``1 2 3``; None if any item is not an int."""
    t = text.strip()
    if len(t) >= 2 and (t[0], t[-1]) in (("[", "]"), ("(", ")")):
        t = t[1:-1].strip()
    if not t:
        return []
    out = []
    for item in _LIST_SPLIT_RE.split(t):
        if not item:
            continue
        if not _INT_RE.fullmatch(item) or len(item) > _MAX_INT_CHARS:
            return None
        out.append(int(item))
    return out


def _positional_match(pred: Sequence, gold: Sequence) -> float:
    n = max(len(pred), len(gold))
    if n == 0:
        return 1.0
    return sum(1 for a, b in zip(pred, gold) if a == b) / n


class AnswerKind:
    """How an answer string is parsed and compared."""

    has_partial = False

    def parse(self, text: str) -> Any | None:
        raise NotImplementedError

    def partial(self, pred: Any, gold: Any) -> float:
        return float(pred == gold)


class IntAnswer(AnswerKind):
    def parse(self, text):
        return parse_int(_unquote(text))


class StringAnswer(AnswerKind):
    """Exact string after stripping whitespace and one pair of surrounding quotes."""

    has_partial = True

    def parse(self, text):
        t = _unquote(text)
        return t or None

    def partial(self, pred, gold):
        return _positional_match(pred, gold)


class IntListAnswer(AnswerKind):
    has_partial = True

    def parse(self, text):
        return parse_int_list(text)

    def partial(self, pred, gold):
        return _positional_match(pred, gold)


class ChoiceAnswer(AnswerKind):
    """One of a fixed set of words, case-insensitive (``yes``/``no``, ``even``/``odd``)."""

    def __init__(self, *options: str):
        self.options = frozenset(o.lower() for o in options)

    def parse(self, text):
        t = _unquote(text).rstrip(".").lower()
        return t if t in self.options else None


class BaseIntAnswer(AnswerKind):
    """An integer written in ``base`` (2..16), with an optional 0b/0o/0x prefix."""

    _PREFIX = {2: "0b", 8: "0o", 16: "0x"}

    def __init__(self, base: int):
        self.base = base
        self._digits = frozenset("0123456789abcdef"[:base])

    def parse(self, text):
        t = _unquote(text).lower()
        prefix = self._PREFIX.get(self.base)
        if prefix and t.startswith(prefix):
            t = t[len(prefix) :]
        if not t or len(t) > _MAX_INT_CHARS or not set(t) <= self._digits:
            return None
        return int(t, self.base)


INT = IntAnswer()
STRING = StringAnswer()
INT_LIST = IntListAnswer()
BOOL = ChoiceAnswer("true", "false")
YES_NO = ChoiceAnswer("yes", "no")


def score_answer(kind: AnswerKind, completion: str, gold_text: str) -> Reward:
    """Exact-match reward with format (and, where defined, partial) components."""
    raw = extract_answer(completion)
    if raw is None:
        return zero_reward("no_answer")
    if len(raw) > MAX_ANSWER_CHARS:
        return zero_reward("answer_too_long")
    pred = kind.parse(raw)
    if pred is None:
        return zero_reward("unparseable")
    gold = kind.parse(gold_text)
    exact = pred == gold
    components = {"format": 1.0, "exact": float(exact)}
    if kind.has_partial:
        components["partial"] = 1.0 if exact else kind.partial(pred, gold)
    return Reward(float(exact), components, "correct" if exact else "wrong")


class ProceduralDomain(Domain):
    """A single-turn domain from a generator function and an answer kind."""

    def __init__(self, name: str, family: str, level: int, generate: Generator, kind: AnswerKind):
        super().__init__(name, family, level)
        self._generate = generate
        self.kind = kind

    def _sample(self, rng, seed):
        question, answer, metadata = self._generate(rng, self.level)
        return Task(
            self.name,
            seed,
            f"{question}\n{ANSWER_INSTRUCTION}",
            answer,
            metadata,
            self.level,
            self.family,
        )

    def _score(self, task, completion):
        return score_answer(self.kind, completion, task.answer)


def ladder(
    family: str,
    op: str,
    generate: Generator,
    kind: AnswerKind,
    levels: int = 5,
    suffix: str = "l",
) -> list[ProceduralDomain]:
    """Domains ``family/op_<suffix>1 .. op_<suffix>N`` sharing one generator."""
    return [
        ProceduralDomain(f"{family}/{op}_{suffix}{level}", family, level, generate, kind)
        for level in range(1, levels + 1)
    ]
