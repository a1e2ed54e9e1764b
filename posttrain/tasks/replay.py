"""Failure replay: scored samples as JSON lines, re-created and re-scored on demand.

A record is ``{"domain", "seed", "completion", "reward": Reward.to_dict()}`` plus, when
written with ``include_task``, the full task for drift detection. Because sampling and
scoring are deterministic, ``replay(record)`` must reproduce the recorded reward exactly;
a mismatch means the domain's generator or verifier changed since the record was written.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from typing import Any

from posttrain.tasks.base import Reward, Task
from posttrain.tasks.catalog import Registry
from posttrain.tasks.catalog import registry as default_registry


def make_record(
    task: Task, completion: str, reward: Reward, include_task: bool = False
) -> dict[str, Any]:
    record = {
        "domain": task.domain,
        "seed": task.seed,
        "completion": completion,
        "reward": reward.to_dict(),
    }
    if include_task:
        record["task"] = task.to_dict()
    return record


def write_records(path: str | os.PathLike, records: Iterable[dict[str, Any]]) -> None:
    """Appends records to a JSONL file (one JSON object per line)."""
    with open(path, "a", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def read_records(source: str) -> list[dict[str, Any]]:
    """Records from a JSONL file path, or from a JSON object/array given inline."""
    text = source.strip()
    if text.startswith(("{", "[")):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"inline record is not valid JSON: {e}") from None
        records = data if isinstance(data, list) else [data]
    else:
        if not os.path.exists(source):
            raise FileNotFoundError(f"record file not found: {source!r}")
        records = []
        with open(source, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{source}:{lineno}: not valid JSON: {e}") from None
    for i, r in enumerate(records):
        missing = [
            k for k in ("domain", "seed", "completion") if not isinstance(r, dict) or k not in r
        ]
        if missing:
            raise ValueError(f"record {i} lacks {missing}")
    return records


@dataclasses.dataclass(frozen=True)
class ReplayResult:
    task: Task
    completion: str
    reward: Reward
    recorded: Reward | None
    task_matches: bool | None

    @property
    def identical(self) -> bool:
        same_reward = self.recorded is None or self.recorded.to_dict() == self.reward.to_dict()
        return same_reward and self.task_matches is not False


def replay(record: dict[str, Any], registry: Registry = default_registry) -> ReplayResult:
    """Re-creates the task from (domain, seed) and re-scores the recorded completion."""
    domain = registry.get(record["domain"])
    seed = record["seed"]
    whole = isinstance(seed, int) or (isinstance(seed, str) and seed.lstrip("-").isdigit())
    if isinstance(seed, bool) or not whole:
        raise ValueError(f"record seed must be an integer, got {seed!r}")
    task = domain.sample(int(seed))
    reward = domain.score(task, record["completion"])
    recorded = Reward.from_dict(record["reward"]) if "reward" in record else None
    task_matches = None
    if "task" in record:
        task_matches = Task.from_dict(record["task"]).to_dict() == task.to_dict()
    return ReplayResult(task, record["completion"], reward, recorded, task_matches)


def format_trace(result: ReplayResult) -> str:
    t, r = result.task, result.reward
    lines = [
        f"domain:     {t.domain} (family {t.family}, level {t.level})",
        f"seed:       {t.seed}",
        "prompt:",
        _indent(t.prompt),
        f"answer:     {t.answer}",
        "completion:",
        _indent(
            result.completion
            if len(result.completion) <= 4000
            else result.completion[:4000] + " ..."
        ),
        f"reward:     {r.value}",
        f"components: {json.dumps(r.components, sort_keys=True)}",
        f"verdict:    {r.verdict}",
    ]
    if result.recorded is not None:
        lines.append(f"recorded:   {result.recorded.value} ({result.recorded.verdict})")
    if result.task_matches is not None:
        lines.append(
            f"task:       {'unchanged' if result.task_matches else 'CHANGED since recording'}"
        )
    lines.append(f"identical:  {'yes' if result.identical else 'NO'}")
    return "\n".join(lines)


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines() or [""])
