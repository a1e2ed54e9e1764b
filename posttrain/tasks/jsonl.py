"""User task files: rows of ``{"prompt", "answer", "verifier"?, "metadata"?, "level"?,
"solution"?}``.

Files are JSON lines, a JSON array, Parquet, Arrow or a ``save_to_disk`` directory
(``posttrain.data.rows``; gzip allowed for JSON; a glob reads a sharded split as one
domain), read and validated when loaded, so a bad row fails early with its line (or row)
number. A prompt is a string (the user's message) or a list of chat messages (system,
user and assistant turns ending with the user's, as veRL's and TRL's prompt columns hold
them; `Task.metadata["messages"]`, which rollouts send as they are). veRL's RL rows load
as they are: ``reward_model.ground_truth`` is the answer, and ``data_source``, ``ability``
and ``extra_info`` go into the metadata. A prompt that mentions none of ``<answer>``,
``\\boxed{`` and ``####`` gets ``ANSWER_INSTRUCTION`` appended (to its last message).

Verifiers compare the text inside the completion's last ``<answer>`` tags (without any,
its last ``\\boxed{...}``; without that, what follows its last ``####`` on that line, as
GSM8K answers) with the row's answer: ``exact`` (after stripping whitespace),
``exact_ci`` (also case-insensitive), ``int``, ``numeric`` (rel. tolerance 1e-6, fractions
and percentages allowed) and ``math`` (math-verify when installed, see
``posttrain.tasks.mathcheck``), and any ``register_verifier`` added (a reward function of
your own: True / False or partial credit in [0, 1]).

``code`` and ``code_partial`` rows hold test cases as their answer (APPS / TACO /
CodeContests' ``{"inputs", "outputs", "fn_name"?}``, LiveCodeBench's list of ``{"input",
"output"}``; ``posttrain.tasks.code_tests``): the completion's last ```python block runs
against them in the sandbox, and the reward is 1 when every test passes (``code``) or the
fraction passed (``code_partial``). ``auto`` picks ``code`` for rows whose answer is test
cases and ``math`` for the rest (a mixed math and code file, such as veRL's). A row's
``solution`` (a worked answer, or a code row's reference program) is its demonstration
for the SFT warm start.

Seeds map to rows as ``row = (seed // 2) % n``: ``train_seed(i)`` and ``heldout_seed(i)``
both visit row ``i``, so iterating either seed family walks the file in order. Keep
evaluation rows in a separate file if they must not be trained on.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
from collections.abc import Callable

import grain

from posttrain.data.rows import expand, read_rows, shard_stem
from posttrain.tasks import code_tests, execution
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


SUITE_VERIFIERS = ("code", "code_partial")
VERL_METADATA = ("data_source", "ability", "extra_info")
AUTO = "auto"


def verifier_names() -> list[str]:
    """Every verifier a task file (or ``tasks.file_verifier``) may name."""
    return sorted([*VERIFIERS, *SUITE_VERIFIERS, AUTO])


def _row_object(line: str | dict, where: str) -> dict:
    if isinstance(line, dict):
        return line
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON: {e}") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    return row


def _verl_row(row: dict, where: str) -> dict:
    """veRL's RL row (``data_source``, ``prompt``, ``ability``, ``reward_model.ground_truth``,
    ``extra_info``) in this module's layout: the ground truth is the answer, the rest
    metadata."""
    if not isinstance(row.get("metadata", {}), dict):
        raise ValueError(f"{where}: 'metadata' must be an object")
    metadata = dict(row.get("metadata") or {})
    for key in VERL_METADATA:
        if key in row:
            metadata.setdefault(key, row[key])
    row = {**row, "metadata": metadata}
    reward_model = row.get("reward_model")
    if "answer" in row or not isinstance(reward_model, dict):
        return row
    if "ground_truth" not in reward_model:
        raise ValueError(f"{where}: missing 'answer' (or reward_model.ground_truth)")
    return {**row, "answer": reward_model["ground_truth"]}


def _parse_row(line: str | dict, where: str, default_verifier: str) -> dict:
    row = _verl_row(_row_object(line, where), where)
    for key in ("prompt", "answer"):
        if key not in row:
            raise ValueError(f"{where}: missing {key!r}")
    messages = None
    if isinstance(row["prompt"], list):
        messages = _parse_messages(row["prompt"], where)
        row = {**row, "prompt": messages[-1]["content"]}
    if not isinstance(row["prompt"], str) or not row["prompt"].strip():
        raise ValueError(f"{where}: 'prompt' must be a non-empty string or a list of messages")
    verifier = row.get("verifier", default_verifier)
    if verifier not in verifier_names():
        raise ValueError(f"{where}: unknown verifier {verifier!r}; known: {verifier_names()}")
    answer = row["answer"]
    if verifier == AUTO:
        verifier = "code" if _looks_like_tests(answer) else "math"
    if verifier in SUITE_VERIFIERS:
        answer = code_tests.parse_tests(answer, f"{where}: 'answer'").to_json()
    elif isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise ValueError(f"{where}: 'answer' must be a string or number, got {answer!r}")
    metadata = row.get("metadata", {})
    if not isinstance(metadata, dict):
        raise ValueError(f"{where}: 'metadata' must be an object")
    level = row.get("level", None)
    if level is not None and (isinstance(level, bool) or not isinstance(level, int) or level < 1):
        raise ValueError(f"{where}: 'level' must be an int >= 1, got {level!r}")
    solution = row.get("solution")
    if solution is not None and (not isinstance(solution, str) or not solution.strip()):
        raise ValueError(f"{where}: 'solution' must be a non-empty string")
    prompt = row["prompt"]
    asked = " ".join(m["content"] for m in messages) if messages else prompt
    if verifier not in SUITE_VERIFIERS and not any(
            mark in asked for mark in (ANSWER_OPEN, _BOXED, _HASHES)):
        prompt = f"{prompt.rstrip()}\n{ANSWER_INSTRUCTION}"
    if messages:
        metadata = {**metadata, "messages": messages[:-1] + [
            {"role": "user", "content": prompt}]}
    return {
        "prompt": prompt,
        "answer": str(answer),
        "verifier": verifier,
        "metadata": metadata,
        "level": level,
        "solution": solution,
    }


def _looks_like_tests(answer) -> bool:
    """Whether ``auto`` reads ``answer`` as test cases (an object or list of them, or JSON
    text of one) rather than a final answer."""
    if isinstance(answer, str) and answer.lstrip()[:1] in ("{", "["):
        try:
            answer = json.loads(answer)
        except ValueError:
            return False
    if isinstance(answer, dict):
        return "inputs" in answer and "outputs" in answer
    return (isinstance(answer, list) and bool(answer)
            and all(isinstance(t, dict) and "input" in t for t in answer))


_BOXED = "\\boxed{"
_HASHES = "####"
_FENCE = "```python"
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


def last_hashes(text: str) -> str | None:
    """What follows the last ``####`` up to the end of its line (GSM8K's answer mark), or
    None."""
    start = text.rfind(_HASHES)
    if start < 0:
        return None
    return text[start + len(_HASHES):].split("\n", 1)[0]


def read_answer(completion: str) -> str | None:
    """What a task file's verifier reads: the last ``<answer>`` pair's content, else the
    last ``\\boxed{...}``'s (math models answer that way unasked), else what follows the
    last ``####`` on its line (as GSM8K's solutions and veRL's GSM8K prompt end); None
    without any."""
    raw = extract_answer(completion)
    if raw is None:
        raw = last_boxed(completion)
    return last_hashes(completion) if raw is None else raw


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
        """Loads and validates ``path`` (JSON lines, a JSON array or Parquet:
        `posttrain.data.rows`; a glob such as ``train-*.parquet`` reads the files it
        matches, in name order, as one domain); the default name is ``jsonl/<file stem>``
        (a sharded split's stem without the shard suffix: ``jsonl/train``)."""
        path = os.fspath(path)
        if verifier not in verifier_names():
            raise ValueError(f"unknown verifier {verifier!r}; known: {verifier_names()}")
        files = expand([path], "task")
        for file in files:
            if not os.path.exists(file):
                raise FileNotFoundError(f"task file not found: {file!r}")
        # Every row is parsed now, so a bad one fails at load naming its line.
        parsed = [_parse_row(row, where, verifier)
                  for file in files for where, row in read_rows(file)]
        if name is None:  # a saved dataset's directory names it, else its (first) file
            name = f"jsonl/{shard_stem(path if os.path.isdir(path) else files[0])}"
        return cls(grain.MapDataset.source(parsed), name, level)

    @classmethod
    def split_file(
        cls,
        path: str | os.PathLike,
        key: str,
        verifier: str = "exact",
        level: int = 1,
    ) -> list[JsonlDomain]:
        """One domain per value of the rows' metadata ``key`` (veRL's ``data_source``, say),
        named ``jsonl/<file stem>/<value>``, each holding its rows in file order; sorted by
        name. The curriculum then weights the sources apart and evaluation reports each."""
        whole = cls.from_file(path, verifier=verifier, level=level)
        groups: dict[str, list[dict]] = {}
        for i in range(len(whole)):
            row = whole._rows[i]
            value = row["metadata"].get(key)
            if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
                raise ValueError(f"{os.fspath(path)}: row {i + 1} has no {key!r} (a string) "
                                 f"to split the file by")
            part = re.sub(r"[^A-Za-z0-9_.\-/]+", "_", str(value)).strip("/") or "_"
            groups.setdefault(f"{whole.name}/{part}", []).append(row)
        return [cls(grain.MapDataset.source(rows), name, level)
                for name, rows in sorted(groups.items())]

    def __len__(self) -> int:
        return len(self._rows)

    def sample(self, seed):
        seed = check_seed(seed)
        index = (seed // 2) % len(self._rows)
        row = self._rows[index]
        metadata = {"row": index, "verifier": row["verifier"], **row["metadata"]}
        if row["solution"] is not None:
            metadata["solution"] = row["solution"]
        return Task(
            self.name,
            seed,
            row["prompt"],
            row["answer"],
            metadata,
            row["level"] or self.level,
            self.family,
        )

    def demonstration(self, task):
        """The row's ``solution`` when it has one (a code row's in a fenced block), else
        the answer in answer tags; a code row without a solution has none to give."""
        solution = task.metadata.get("solution")
        code = task.metadata.get("verifier") in SUITE_VERIFIERS
        if solution is None:
            if code:
                raise ValueError(f"{self.name} row {task.metadata.get('row')}: a code row "
                                 "needs a 'solution' to demonstrate")
            return super().demonstration(task)
        if code and _FENCE not in solution:
            return f"{_FENCE}\n{solution.strip()}\n```"
        return solution

    def _score(self, task, completion):
        if task.metadata.get("verifier") in SUITE_VERIFIERS:
            final, request, suite, marker = self._prepare_code(task, completion)
            if final is not None:
                return final
            return self._finish_code(task, suite, execution.get_sandbox().run(request), marker)
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

    def _prepare_code(self, task, completion):
        suite = code_tests.parse_tests(task.answer, f"{self.name} answer")
        marker = "@@" + secrets.token_hex(12)
        final, request = code_tests.prepare(completion, suite, marker)
        return final, request, suite, marker

    def _finish_code(self, task, suite, result, marker):
        partial = task.metadata["verifier"] == "code_partial"
        return code_tests.score(suite, result, marker, partial=partial)

    def score_many(self, tasks, completions):
        """Scores a batch; the code rows' programs run in one ``run_many`` call. Never
        raises."""
        if len(tasks) != len(completions):
            raise ValueError(f"got {len(tasks)} tasks but {len(completions)} completions")
        rewards: list[Reward | None] = [None] * len(tasks)
        pending = []
        for i, (task, completion) in enumerate(zip(tasks, completions)):
            if not (isinstance(task, Task) and task.domain == self.name
                    and isinstance(completion, str)
                    and task.metadata.get("verifier") in SUITE_VERIFIERS):
                rewards[i] = self.score(task, completion)
                continue
            try:
                final, request, suite, marker = self._prepare_code(task, completion)
            except Exception as e:  # noqa: BLE001 - scoring never raises
                final = zero_reward(f"error: {type(e).__name__}: {str(e)[:200]}")
            if final is not None:
                rewards[i] = final
            else:
                pending.append((i, request, suite, marker))
        if pending:
            try:
                results = execution.get_sandbox().run_many([p[1] for p in pending])
                for (i, _, suite, marker), result in zip(pending, results):
                    rewards[i] = self._finish_code(tasks[i], suite, result, marker)
            except Exception as e:  # noqa: BLE001 - e.g. no sandbox on this host
                for i, *_ in pending:
                    rewards[i] = zero_reward(
                        f"sandbox_error: {type(e).__name__}: {str(e)[:200]}", format=1.0,
                        parses=1.0)
        return rewards
