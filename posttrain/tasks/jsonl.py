"""User task files: JSON lines of ``{"prompt", "answer", "verifier"?, "metadata"?, "level"?}``.

Rows are read through a grain ``MapDataset`` (random access by index) and validated when
the file is loaded, so a bad row fails early with its line number. A prompt is a string
(the user's message) or a list of chat messages (system, user and assistant turns ending
with the user's, as veRL's and TRL's prompt columns hold them; `Task.metadata["messages"]`,
which rollouts send as they are). A prompt that mentions neither ``<answer>`` nor
``\\boxed{`` gets ``ANSWER_INSTRUCTION`` appended (to its last message).

Verifiers compare the text inside the completion's last ``<answer>`` tags (without any,
its last ``\\boxed{...}``) with the row's answer: ``exact`` (after stripping whitespace),
``exact_ci`` (also case-insensitive), ``int``, ``numeric`` (rel. tolerance 1e-6, fractions
and percentages allowed) and ``math`` (math-verify when installed, see
``posttrain.tasks.mathcheck``), and any ``register_verifier`` added (a reward function of
your own: True / False or partial credit in [0, 1]).

Seeds map to rows as ``row = (seed // 2) % n``: ``train_seed(i)`` and ``heldout_seed(i)``
both visit row ``i``, so iterating either seed family walks the file in order. Keep
evaluation rows in a separate file if they must not be trained on.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable

import grain

from posttrain.tasks.base import (
    ANSWER_INSTRUCTION,
    ANSWER_OPEN,
    MAX_ANSWER_CHARS,
    Domain,
    Reward,
    Task,
    check_seed,
    extract_answer,
    zero_reward,
)
from posttrain.tasks.mathcheck import fallback_equal, math_equal, to_number
from posttrain.tasks.procedural import parse_int

VERIFIERS: dict[str, Callable[[str, str], bool]] = {
    "exact": lambda pred, gold: pred.strip() == gold.strip(),
    "exact_ci": lambda pred, gold: pred.strip().lower() == gold.strip().lower(),
    "int": lambda pred, gold: (p := parse_int(pred)) is not None and p == parse_int(gold),
    "numeric": lambda pred, gold: to_number(pred) is not None and fallback_equal(pred, gold),
    "math": math_equal,
}
BUILTIN_VERIFIERS = tuple(VERIFIERS)


def register_verifier(name: str, fn: Callable[[str, str], bool | float]) -> None:
    """Adds a verifier task files (and ``tasks.file_verifier``) can name.

    ``fn(answer, gold)`` gets the completion's answer (as the built-in verifiers read it)
    and the row's, and returns True / False or a score in [0, 1] (partial credit; 1 is
    correct). Register before the files load: a ``tasks.modules`` module does it when
    imported, and the run imports those first. An exception in ``fn`` scores 0.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"a verifier's name must be a non-empty string, got {name!r}")
    if name in BUILTIN_VERIFIERS:
        raise ValueError(f"verifier {name!r} is built in; pick another name")
    if not callable(fn):
        raise TypeError(f"verifier {name!r} must be callable, got {type(fn).__name__}")
    VERIFIERS[name] = fn


def _parse_row(line: str, where: str, default_verifier: str) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON: {e}") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    for key in ("prompt", "answer"):
        if key not in row:
            raise ValueError(f"{where}: missing {key!r}")
    messages = None
    if isinstance(row["prompt"], list):
        messages = _parse_messages(row["prompt"], where)
        row = {**row, "prompt": messages[-1]["content"]}
    if not isinstance(row["prompt"], str) or not row["prompt"].strip():
        raise ValueError(f"{where}: 'prompt' must be a non-empty string or a list of messages")
    if isinstance(row["answer"], bool) or not isinstance(row["answer"], (str, int, float)):
        raise ValueError(f"{where}: 'answer' must be a string or number, got {row['answer']!r}")
    verifier = row.get("verifier", default_verifier)
    if verifier not in VERIFIERS:
        raise ValueError(f"{where}: unknown verifier {verifier!r}; known: {sorted(VERIFIERS)}")
    metadata = row.get("metadata", {})
    if not isinstance(metadata, dict):
        raise ValueError(f"{where}: 'metadata' must be an object")
    level = row.get("level", None)
    if level is not None and (isinstance(level, bool) or not isinstance(level, int) or level < 1):
        raise ValueError(f"{where}: 'level' must be an int >= 1, got {level!r}")
    prompt = row["prompt"]
    asked = " ".join(m["content"] for m in messages) if messages else prompt
    if ANSWER_OPEN not in asked and _BOXED not in asked:
        prompt = f"{prompt.rstrip()}\n{ANSWER_INSTRUCTION}"
    if messages:
        metadata = {**metadata, "messages": messages[:-1] + [
            {"role": "user", "content": prompt}]}
    return {
        "prompt": prompt,
        "answer": str(row["answer"]),
        "verifier": verifier,
        "metadata": metadata,
        "level": level,
    }


_BOXED = "\\boxed{"
_PROMPT_ROLES = ("system", "user", "assistant")


def _parse_messages(value: list, where: str) -> list[dict]:
    """A chat prompt: messages of system, user and assistant turns, ending with a user's."""
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in _PROMPT_ROLES:
            raise ValueError(f"{where}: prompt[{i}] must be an object with a role in "
                             f"{_PROMPT_ROLES}")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: prompt[{i}] content must be a string")
        out.append({"role": m["role"], "content": m["content"]})
    if not out or out[-1]["role"] != "user":
        raise ValueError(f"{where}: a prompt's messages must end with a user message")
    return out


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (nested braces balanced), or None."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, begin = 1, start + len(_BOXED)
    for end in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth == 0:
            return text[begin:end]
    return None


def read_answer(completion: str) -> str | None:
    """What a task file's verifier reads: the last ``<answer>`` pair's content, else the
    last ``\\boxed{...}``'s (math models answer that way unasked); None without either."""
    raw = extract_answer(completion)
    return last_boxed(completion) if raw is None else raw


class JsonlDomain(Domain):
    """A domain over the rows of a user JSONL file."""

    def __init__(self, rows: grain.MapDataset, name: str, level: int = 1):
        family = name.split("/", 1)[0]
        super().__init__(name, family, level)
        self._rows = rows
        if len(rows) == 0:
            raise ValueError(f"task file for {name!r} has no rows")

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike,
        name: str | None = None,
        verifier: str = "exact",
        level: int = 1,
    ) -> JsonlDomain:
        """Loads and validates ``path``; the default name is ``jsonl/<file stem>``."""
        path = os.fspath(path)
        if verifier not in VERIFIERS:
            raise ValueError(f"unknown verifier {verifier!r}; known: {sorted(VERIFIERS)}")
        if not os.path.exists(path):
            raise FileNotFoundError(f"task file not found: {path!r}")
        with open(path, encoding="utf-8") as f:
            lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
        rows = grain.MapDataset.source(lines).map(
            lambda item: _parse_row(item[1], f"{path}:{item[0]}", verifier)
        )
        for i in range(len(rows)):
            rows[i]  # noqa: B018 - validate every row now, not mid-training
        if name is None:
            name = f"jsonl/{os.path.splitext(os.path.basename(path))[0]}"
        return cls(rows, name, level)

    def __len__(self) -> int:
        return len(self._rows)

    def sample(self, seed):
        seed = check_seed(seed)
        index = (seed // 2) % len(self._rows)
        row = self._rows[index]
        metadata = {"row": index, "verifier": row["verifier"], **row["metadata"]}
        return Task(
            self.name,
            seed,
            row["prompt"],
            row["answer"],
            metadata,
            row["level"] or self.level,
            self.family,
        )

    def _score(self, task, completion):
        raw = read_answer(completion)
        if raw is None:
            return zero_reward("no_answer")
        if len(raw) > MAX_ANSWER_CHARS:
            return zero_reward("answer_too_long")
        if not raw.strip():
            return zero_reward("unparseable")
        verifier = task.metadata.get("verifier", "exact")
        check = VERIFIERS.get(verifier)
        if check is None:
            return zero_reward(f"unknown verifier {verifier!r}")
        value = float(check(raw, task.answer))
        value = min(max(value, 0.0), 1.0) if math.isfinite(value) else 0.0
        exact = value >= 1.0
        verdict = "correct" if exact else ("partial" if value > 0 else "wrong")
        return Reward(value, {"format": 1.0, "exact": float(exact)}, verdict)
