"""Supervised fine-tuning data from JSON-lines files: conversations or prompt/completion rows.

    data = SFTData.from_files("train.jsonl,more.jsonl", tok, row_len=2048)
    ds = data.dataset(seed=0)                 # endless grain stream, reshuffled every epoch
    it = iter(ds.to_iter_dataset())           # it.get_state() / set_state() resume exactly

One row per line, in either of the formats Hugging Face TRL and the OpenAI fine-tuning API
read:

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}, ...]}
    {"prompt": "..." | [messages], "completion": "..." | [assistant messages]}

Roles are system, user, assistant and tool. The loss falls on every assistant message (its
content and end-of-turn token) unless the message says `"weight": 0`, which makes it
context. Other keys of a row (ids, sources) are ignored. Every row is parsed and
tokenized when the files load, so a bad row fails at once, naming its file and line.

Rows longer than `row_len` tokens keep their head: the packer cuts the tail, and the
count is logged. A row whose first trained token lies beyond `row_len` cannot teach
anything; such rows are dropped with a warning naming the first one, and only if every
row is too long is that an error. Token ids are held as int32 arrays (4 bytes a token).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

from posttrain.data.tokenizer import ROLES, Tokenizer

log = logging.getLogger("posttrain")


def split_paths(paths: str | Sequence[str]) -> list[str]:
  """A comma-separated string or a sequence of paths as a list (empty entries dropped)."""
  if isinstance(paths, str):
    paths = paths.split(",")
  return [os.path.expanduser(p.strip()) for p in paths if p and p.strip()]


def parse_messages(value: Any, where: str, key: str) -> list[dict]:
  if not isinstance(value, list) or not value:
    raise ValueError(f"{where}: {key!r} must be a non-empty list of messages")
  out = []
  for i, m in enumerate(value):
    if not isinstance(m, dict):
      raise ValueError(f"{where}: {key}[{i}] must be an object with 'role' and 'content'")
    role, content = m.get("role"), m.get("content")
    if role not in ROLES:
      raise ValueError(f"{where}: {key}[{i}] has role {role!r}; expected one of {ROLES}")
    if not isinstance(content, str):
      raise ValueError(f"{where}: {key}[{i}] content must be a string, got "
                       f"{type(content).__name__}")
    weight = m.get("weight", 1)
    if isinstance(weight, bool) or weight not in (0, 1):
      raise ValueError(f"{where}: {key}[{i}] weight must be 0 or 1, got {weight!r}")
    if weight == 0 and role != "assistant":
      raise ValueError(f"{where}: {key}[{i}] weight is for assistant messages, not {role!r}")
    out.append({"role": role, "content": content, "weight": int(weight)})
  return out


def json_object(line: str, where: str) -> dict:
  """One JSON line as a dict; ValueError naming `where` otherwise."""
  try:
    row = json.loads(line)
  except json.JSONDecodeError as e:
    raise ValueError(f"{where}: not valid JSON: {e}") from None
  if not isinstance(row, dict):
    raise ValueError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
  return row


def parse_row(line: str, where: str) -> list[dict]:
  """One JSON line as the conversation it trains on; ValueError naming `where`."""
  row = json_object(line, where)
  if "messages" in row:
    if "prompt" in row or "completion" in row:
      raise ValueError(f"{where}: give 'messages' or 'prompt' and 'completion', not both")
    messages = parse_messages(row["messages"], where, "messages")
  elif "prompt" in row and "completion" in row:
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(prompt, str):
      prompt = [{"role": "user", "content": prompt}]
    if isinstance(completion, str):
      completion = [{"role": "assistant", "content": completion}]
    messages = (parse_messages(prompt, where, "prompt")
                + parse_messages(completion, where, "completion"))
    roles = {m["role"] for m in messages[len(prompt):]}
    if roles - {"assistant", "tool"}:
      raise ValueError(f"{where}: 'completion' holds {sorted(roles - {'assistant', 'tool'})} "
                       "messages; a completion is assistant (and tool) turns")
  else:
    raise ValueError(f"{where}: a row needs 'messages', or 'prompt' and 'completion'; it has "
                     f"{sorted(row)}")
  if not any(m["role"] == "assistant" and m["weight"] for m in messages):
    raise ValueError(f"{where}: no assistant message to train on (none, or all weight 0)")
  return messages


def encode_conversation(messages: Sequence[dict], tok: Tokenizer) -> dict[str, np.ndarray]:
  """A conversation as a packer trajectory: the context before the first trained token is
  the prompt, the rest the response with its loss mask; untrained turns after the last
  trained token are dropped."""
  ids, mask = tok.encode_chat(messages)
  trained = np.flatnonzero(mask)
  first, last = int(trained[0]), int(trained[-1])
  if first == 0:  # A first token needs a context; a format without BOS headers has one.
    raise ValueError("a conversation cannot start with a trained token")
  return {"prompt_tokens": np.asarray(ids[:first], np.int32),
          "response_tokens": np.asarray(ids[first:last + 1], np.int32),
          "response_mask": np.asarray(mask[first:last + 1], np.int32)}


@dataclasses.dataclass
class JsonlExamples:
  """Tokenized examples of one or more JSON-lines files, with what loading found.

  A subclass says how a line becomes an example (`encode_line`) and what the stream
  yields for one (`item`)."""

  examples: list[dict[str, np.ndarray]]
  sources: list[str]          # "path:line" of each example
  dropped: int = 0            # rows whose first trained token lies beyond row_len
  truncated: int = 0          # rows longer than row_len (their tails are cut)

  KIND = "JSON-lines"

  @classmethod
  def encode_line(cls, line: str, where: str, tok: Tokenizer
                  ) -> tuple[dict[str, np.ndarray], int, int]:
    """(example, tokens before its first trained token, its longest sequence's length)."""
    raise NotImplementedError

  def item(self, example: dict[str, np.ndarray]) -> dict[str, Any]:
    return example

  @classmethod
  def from_files(cls, paths: str | Sequence[str], tok: Tokenizer, *, row_len: int):
    """Reads, validates and tokenizes every row of `paths` (comma-separated or a list)."""
    files = split_paths(paths)
    if not files:
      raise ValueError(f"no {cls.KIND} data files given")
    examples, sources = [], []
    dropped, first_dropped, truncated = 0, None, 0
    for path in files:
      if not os.path.isfile(path):
        raise FileNotFoundError(f"{cls.KIND} data file not found: {path!r}")
      with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
          if not line.strip():
            continue
          where = f"{path}:{number}"
          example, prompt, length = cls.encode_line(line, where, tok)
          if prompt + 1 > row_len:
            dropped += 1
            first_dropped = first_dropped or where
            continue
          truncated += length > row_len
          examples.append(example)
          sources.append(where)
    if not examples and not dropped:
      raise ValueError(f"{cls.KIND} data {','.join(files)} holds no rows")
    if not examples:
      raise ValueError(f"every {cls.KIND} row's first trained token lies beyond "
                       f"row_len={row_len} (first: {first_dropped}); raise train.row_len")
    if dropped:
      log.warning("%s data: dropped %d of %d rows whose first trained token lies beyond "
                  "row_len=%d (first: %s)", cls.KIND, dropped, dropped + len(examples),
                  row_len, first_dropped)
    if truncated:
      log.warning("%s data: %d of %d rows are longer than row_len=%d; their tails are cut",
                  cls.KIND, truncated, len(examples), row_len)
    return cls(examples, sources, dropped, truncated)

  def __len__(self) -> int:
    return len(self.examples)

  def dataset(self, seed: int, shard: tuple[int, int] = (0, 1)) -> grain.MapDataset:
    """An endless stream of the examples, each epoch in a new order; with `shard=(i, n)`
    every n-th element from the i-th, so n shards interleaved are the unsharded stream."""
    index, count = shard
    if not 0 <= index < count:
      raise ValueError(f"shard index {index} is out of range for {count} shards")
    ds = grain.MapDataset.range(len(self.examples)).shuffle(seed=seed).repeat()
    if count > 1:
      ds = ds[index::count]
    return ds.map(lambda i: self.item(self.examples[int(i)]))


class SFTData(JsonlExamples):
  """SFT conversations: packer trajectories with the assistant turns' loss mask."""

  KIND = "SFT"

  @classmethod
  def encode_line(cls, line, where, tok):
    messages = parse_row(line, where)
    try:
      example = encode_conversation(messages, tok)
    except ValueError as e:
      raise ValueError(f"{where}: {e}") from None
    prompt = len(example["prompt_tokens"])
    return example, prompt, prompt + len(example["response_tokens"])

  def item(self, example):
    return {**example, "advantages": np.float32(1.0)}

  @property
  def trained_tokens(self) -> int:
    """Loss tokens over all examples (before any truncation)."""
    return int(sum(int(np.count_nonzero(e["response_mask"])) for e in self.examples))
