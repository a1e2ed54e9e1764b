"""Supervised fine-tuning data from files: conversations or prompt/completion rows.

    data = SFTData.from_files("train.jsonl,more.jsonl", tok, row_len=2048,
                              cache_dir="/data/cache")   # tokenized once, memory-mapped after
    ds = data.dataset(seed=0)                 # endless grain stream, reshuffled every epoch
    it = iter(ds.to_iter_dataset())           # it.get_state() / set_state() resume exactly

Files are JSON lines (one row per line), a JSON array or Parquet (Hugging Face datasets'
files; `posttrain.data.rows`), gzip allowed for JSON. Rows are in either of the formats
Hugging Face TRL and the OpenAI fine-tuning API read:

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}, ...]}
    {"prompt": "..." | [messages], "completion": "..." | [assistant messages]}
    {"text": "..."}        # plain text (continued pretraining): every token trained on

Roles are system, user, assistant and tool. The loss falls on every assistant message (its
content and end-of-turn token) unless the message says `"weight": 0`, which makes it
context. An assistant message may carry its reasoning ("reasoning_content", or "thinking"
as gpt-oss data names it), which reasoning formats render as their templates do (Qwen3's
<think> block, harmony's analysis channel; `posttrain.data.tokenizer`) and trained on with
the content; other formats reject it. An assistant message may call tools, in OpenAI's
and TRL's layout (`"tool_calls": [{"type": "function", "function": {"name", "arguments"}}]`,
its content null or text), and a row may carry the function schemas its conversation
calls (`"tools": [...]`, TRL's column): Qwen's ChatML, Llama 3.1+ and gpt-oss's harmony
render both as their templates do, and the calls are trained on as the model's own
tokens. Other keys of a row (ids, sources) are ignored.
Every row is parsed and tokenized when the files load, so a bad row fails at once, naming
its file and line.

Rows longer than `row_len` tokens keep their head: the packer cuts the tail, and the
count is logged. A row whose first trained token lies beyond `row_len` cannot teach
anything; such rows are dropped with a warning naming the first one, and only if every
row is too long is that an error. Token ids are held as int32 arrays (4 bytes a token),
one flat column per field for all rows (`posttrain.data.columns`).

With a `cache_dir`, the first load writes those columns there and every later load of the
same files (same paths, sizes and modification times), row_len and tokenizer, by a
restarted or resumed run, another host or another run, memory-maps them: no parsing, no
tokenizing. Editing a file, or changing row_len or the tokenizer, makes a new entry; the
entries of edited or deleted files are removed once a day old, when a load writes a new
entry (`columns.prune`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

from posttrain.data import columns, rows
from posttrain.data.tokenizer import REASONING_FIELDS, ROLES, Tokenizer

log = logging.getLogger("posttrain")


def split_paths(paths: str | Sequence[str]) -> list[str]:
  """A comma-separated string or a sequence of paths as a list of files (empty entries
  dropped, globs expanded: `rows.expand`)."""
  return rows.expand(paths)


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
    calls = m.get("tool_calls")
    if calls is not None and role != "assistant":
      raise ValueError(f"{where}: {key}[{i}] is a {role} message; only assistant messages "
                       "have tool_calls")
    if content is None and calls is not None:
      content = ""  # OpenAI's format: a turn that only calls tools has null content
    if not isinstance(content, str):
      raise ValueError(f"{where}: {key}[{i}] content must be a string, got "
                       f"{type(content).__name__}")
    weight = m.get("weight", 1)
    if isinstance(weight, bool) or weight not in (0, 1):
      raise ValueError(f"{where}: {key}[{i}] weight must be 0 or 1, got {weight!r}")
    if weight == 0 and role != "assistant":
      raise ValueError(f"{where}: {key}[{i}] weight is for assistant messages, not {role!r}")
    message = {"role": role, "content": content, "weight": int(weight)}
    if calls is not None:
      message["tool_calls"] = calls  # checked and written by the chat format
    if role == "tool" and isinstance(m.get("name"), str) and m["name"]:
      message["name"] = m["name"]  # the function it answers (harmony's header names it)
    for field in REASONING_FIELDS:  # an assistant's reasoning, as Qwen3 / gpt-oss data has it
      if m.get(field) is None:
        continue
      if role != "assistant" or not isinstance(m[field], str):
        raise ValueError(f"{where}: {key}[{i}] {field} must be an assistant message's string")
      message[field] = m[field]
    out.append(message)
  return out


def json_object(line: str | dict, where: str) -> dict:
  """One JSON line (or a row `rows.read_rows` already parsed) as a dict; ValueError naming
  `where` otherwise."""
  if isinstance(line, dict):
    return line
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
    raise ValueError(f"{where}: a row needs 'messages', 'prompt' and 'completion', or 'text'; "
                     f"it has {sorted(row)}")
  if not any(m["role"] == "assistant" and m["weight"] for m in messages):
    raise ValueError(f"{where}: no assistant message to train on (none, or all weight 0)")
  return messages


def encode_text(text: Any, where: str, tok: Tokenizer) -> dict[str, np.ndarray]:
  """A plain-text row (TRL's language-modeling format) as a packer trajectory: the
  tokenizer's bos (as its chat format opens a conversation), the text and eos, every token
  after the first trained on (the first has no context to be predicted from)."""
  if not isinstance(text, str) or not text.strip():
    raise ValueError(f"{where}: 'text' must be a non-empty string")
  ids = list(tok.chat.bos) + tok.encode(text) + [tok.eos_id]
  return {"prompt_tokens": np.asarray(ids[:1], np.int32),
          "response_tokens": np.asarray(ids[1:], np.int32),
          "response_mask": np.ones(len(ids) - 1, np.int32)}


def parse_tools(row: dict, where: str) -> list[dict] | None:
  """A row's `tools` (TRL's column: the function schemas the conversation may call), or
  None; a JSON string of the list is read too (as some datasets store it)."""
  tools = row.get("tools")
  if isinstance(tools, str):
    try:
      tools = json.loads(tools)
    except json.JSONDecodeError as e:
      raise ValueError(f"{where}: 'tools' is not valid JSON: {e}") from None
  if tools is None or tools == []:
    return None
  if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
    raise ValueError(f"{where}: 'tools' must be a list of function schemas (objects)")
  return tools


def encode_conversation(messages: Sequence[dict], tok: Tokenizer,
                        tools: Sequence[dict] | None = None) -> dict[str, np.ndarray]:
  """A conversation as a packer trajectory: the context before the first trained token is
  the prompt, the rest the response with its loss mask; untrained turns after the last
  trained token are dropped. `tools`: the schemas the template renders (ChatML, Llama
  3.1+)."""
  ids, mask = tok.encode_chat(messages, tools=tools)
  trained = np.flatnonzero(mask)
  first, last = int(trained[0]), int(trained[-1])
  if first == 0:  # A first token needs a context; a format without BOS headers has one.
    raise ValueError("a conversation cannot start with a trained token")
  return {"prompt_tokens": np.asarray(ids[:first], np.int32),
          "response_tokens": np.asarray(ids[first:last + 1], np.int32),
          "response_mask": np.asarray(mask[first:last + 1], np.int32)}


class JsonlExamples:
  """Tokenized examples of one or more JSON-lines files, with what loading found.

  The examples are held as flat columns (`posttrain.data.columns`): `examples[i]` is a
  dict of int32 views into them (plus a row's optional scalars), `examples[a:b]` a list.
  A subclass says how a line becomes an example (`encode_line`), which token fields and
  optional scalars it has, what the stream yields for one (`item`), and which figures
  over all examples to keep with a cache entry (`summarize`)."""

  KIND = "JSON-lines"
  TOKEN_FIELDS: tuple[str, ...] = ()
  SCALARS: dict[str, type] = {}  # optional per-example scalars: float or str

  def __init__(self, arrays: dict[str, np.ndarray], files: Sequence[str], *,
               strings: dict[str, list[str]] | None = None, dropped: int = 0,
               truncated: int = 0, first_dropped: str | None = None,
               summary: dict[str, int] | None = None):
    self.arrays, self.files, self.strings = arrays, list(files), strings or {}
    self.dropped = dropped          # rows whose first trained token lies beyond row_len
    self.truncated = truncated      # rows longer than row_len (their tails are cut)
    self.first_dropped = first_dropped
    self.summary = summary if summary is not None else self.summarize(arrays)
    self._token_columns = [(f, arrays[f], arrays[f"{f}.offsets"]) for f in self.TOKEN_FIELDS]

  # Views made on access: held as attributes they would tie this object into a reference
  # cycle, and a replaced copy's arrays would outlive it until a full garbage collection.
  @property
  def examples(self) -> columns.LazySequence:
    """The examples (`example(i)`), a read-only sequence; a slice is a list."""
    return columns.LazySequence(len(self), self.example)

  @property
  def sources(self) -> columns.LazySequence:
    """Where each example came from, as "path:line"."""
    return columns.LazySequence(len(self), self._source)

  @classmethod
  def encode_line(cls, line: str, where: str, tok: Tokenizer
                  ) -> tuple[dict[str, np.ndarray], int, int]:
    """(example, tokens before its first trained token, its longest sequence's length)."""
    raise NotImplementedError

  @classmethod
  def encode_lines(cls, line: str, where: str, tok: Tokenizer
                   ) -> list[tuple[dict[str, np.ndarray], int, int]]:
    """The examples one line becomes, as `encode_line` triples: one, unless a subclass
    splits a row (each is then kept, cut or dropped on its own)."""
    return [cls.encode_line(line, where, tok)]

  @classmethod
  def summarize(cls, arrays: dict[str, np.ndarray]) -> dict[str, int]:
    """Figures over all examples, computed once when they are tokenized."""
    del arrays
    return {}

  def item(self, example: dict[str, np.ndarray]) -> dict[str, Any]:
    return example

  def example(self, index: int) -> dict[str, Any]:
    """Example `index` as the dict `encode_line` made: views of the token columns."""
    out = {field: flat[offsets[index]:offsets[index + 1]]
           for field, flat, offsets in self._token_columns}
    for name, kind in self.SCALARS.items():
      if self.arrays[f"{name}.present"][index]:
        value = self.arrays[name][index]
        out[name] = self.strings[name][value] if kind is str else kind(value)
    return out

  def _source(self, index: int) -> str:
    return (f"{self.files[self.arrays['source_file'][index]]}:"
            f"{self.arrays['source_line'][index]}")

  @classmethod
  def from_files(cls, paths: str | Sequence[str], tok: Tokenizer, *, row_len: int,
                 cache_dir: str | None = None):
    """Reads, validates and tokenizes every row of `paths` (comma-separated or a list).

    With `cache_dir`, the tokenized columns are kept there, keyed by the files (path, size,
    modification time), row_len and the tokenizer: a later load of the same files, by this
    run after a restart or by another run, memory-maps them instead of tokenizing."""
    files = split_paths(paths)
    if not files:
      raise ValueError(f"no {cls.KIND} data files given")
    for path in files:
      if not os.path.isfile(path):
        raise FileNotFoundError(f"{cls.KIND} data file not found: {path!r}")
    start = time.perf_counter()
    entry, broken = None, False
    if cache_dir and tok.fingerprint is None:
      log.info("%s data: the tokenizer %s has no fingerprint; not cached", cls.KIND,
               type(tok).__name__)
    elif cache_dir:
      stats = columns.file_stats(files)  # as the key saw them: an entry records these
      key = columns.cache_key(cls.KIND, row_len, files, tok.fingerprint)
      entry = os.path.join(os.path.expanduser(cache_dir), f"{cls.KIND.lower()}-{key[:32]}")
      try:
        data = cls._read(entry, files, key)
      except FileNotFoundError:
        pass
      except columns.CacheEntryError as e:
        broken = True
        log.warning("%s data: cache entry %s is unreadable (%s); tokenizing again",
                    cls.KIND, entry, e)
      else:
        log.info("%s data: cache hit, %d rows memory-mapped from %s in %.2f s", cls.KIND,
                 len(data), entry, time.perf_counter() - start)
        data._warn_long_rows(row_len)
        return data
    data = cls._tokenize(files, tok, row_len)
    outcome = "no cache"
    if entry:
      outcome = "cache miss, not cached"
      try:
        data._write(entry, key, row_len, stats, replace=broken)
        data = cls._read(entry, files, key)
        outcome = f"cache miss, cached in {entry}"
      except (OSError, columns.CacheEntryError) as e:
        log.warning("%s data: could not cache the tokenized rows in %s (%s); continuing "
                    "uncached", cls.KIND, entry, " ".join(str(e).split()))
      else:
        directory, sizes = os.path.dirname(entry), {}
        try:
          removed = columns.prune(directory, keep=(os.path.basename(entry),), sizes=sizes)
        except OSError as e:
          log.warning("%s data cache: could not prune %s (%s)", cls.KIND, directory, e)
        else:
          if removed:
            log.info("%s data cache: removed %d stale entries (%.1f MiB) from %s", cls.KIND,
                     len(removed), sum(sizes.values()) / 2**20, directory)
    log.info("%s data: tokenized %d rows in %.2f s (%s)", cls.KIND, len(data),
             time.perf_counter() - start, outcome)
    data._warn_long_rows(row_len)
    return data

  @classmethod
  def _tokenize(cls, files: list[str], tok: Tokenizer, row_len: int):
    builder = columns.ColumnBuilder(cls.TOKEN_FIELDS, cls.SCALARS)
    dropped, first_dropped, truncated = 0, None, 0
    for file_index, path in enumerate(files):
      for where, row in rows.read_rows(path):
        number = int(where.rsplit(":", 1)[1])
        for example, prompt, length in cls.encode_lines(row, where, tok):
          if prompt + 1 > row_len:
            dropped += 1
            first_dropped = first_dropped or where
            continue
          truncated += length > row_len
          builder.add(example, file_index, number)
    if not len(builder) and not dropped:
      raise ValueError(f"{cls.KIND} data {','.join(files)} holds no rows")
    if not len(builder):
      raise ValueError(f"every {cls.KIND} row's first trained token lies beyond "
                       f"row_len={row_len} (first: {first_dropped}); raise train.row_len")
    arrays, strings = builder.finish()
    return cls(arrays, files, strings=strings, dropped=dropped, truncated=truncated,
               first_dropped=first_dropped)

  def _write(self, entry: str, key: str, row_len: int, file_stats: list[list], *,
             replace: bool) -> None:
    meta = {"version": columns.FORMAT_VERSION, "kind": self.KIND, "key": key,
            "row_len": row_len, "count": len(self), "dropped": self.dropped,
            "truncated": self.truncated, "first_dropped": self.first_dropped,
            "files": [os.path.abspath(p) for p in self.files], "file_stats": file_stats,
            "strings": self.strings, "summary": self.summary}
    columns.write_entry(entry, self.arrays, meta, replace=replace)

  @classmethod
  def _read(cls, entry: str, files: list[str], key: str):
    arrays, meta = columns.read_entry(
        entry, columns.array_names(cls.TOKEN_FIELDS, cls.SCALARS))
    try:
      if (meta["kind"], meta["key"]) != (cls.KIND, key):
        raise columns.CacheEntryError("it holds other data")
      strings = {name: list(meta["strings"][name]) for name, kind in cls.SCALARS.items()
                 if kind is str}
      columns.check_arrays(arrays, cls.TOKEN_FIELDS, cls.SCALARS, int(meta["count"]),
                           strings, len(files))
      # Sources name the files as this load was given them (the key holds their
      # absolute paths, so they are the same files).
      return cls(arrays, files, strings=strings, dropped=int(meta["dropped"]),
                 truncated=int(meta["truncated"]), first_dropped=meta["first_dropped"],
                 summary={k: int(v) for k, v in meta["summary"].items()})
    except columns.CacheEntryError:
      raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
      raise columns.CacheEntryError(f"bad meta.json: {type(e).__name__}: {e}") from None

  def _warn_long_rows(self, row_len: int) -> None:
    if self.dropped:
      log.warning("%s data: dropped %d of %d rows whose first trained token lies beyond "
                  "row_len=%d (first: %s)", self.KIND, self.dropped,
                  self.dropped + len(self), row_len, self.first_dropped)
    if self.truncated:
      log.warning("%s data: %d of %d rows are longer than row_len=%d; their tails are cut",
                  self.KIND, self.truncated, len(self), row_len)

  def __len__(self) -> int:
    return len(self.arrays["source_line"])

  def dataset(self, seed: int, shard: tuple[int, int] = (0, 1)) -> grain.MapDataset:
    """An endless stream of the examples, each epoch in a new order; with `shard=(i, n)`
    every n-th element from the i-th, so n shards interleaved are the unsharded stream."""
    index, count = shard
    if not 0 <= index < count:
      raise ValueError(f"shard index {index} is out of range for {count} shards")
    ds = grain.MapDataset.range(len(self)).shuffle(seed=seed).repeat()
    if count > 1:
      ds = ds[index::count]
    return ds.map(lambda i: self.item(self.example(int(i))))


class SFTData(JsonlExamples):
  """SFT conversations: packer trajectories with the assistant turns' loss mask."""

  KIND = "SFT"
  TOKEN_FIELDS = ("prompt_tokens", "response_tokens", "response_mask")

  @classmethod
  def encode_line(cls, line, where, tok):
    row = json_object(line, where)
    if "text" in row and not {"messages", "prompt", "completion"} & set(row):
      example = encode_text(row["text"], where, tok)
      return example, len(example["prompt_tokens"]), len(example["prompt_tokens"]) + len(
          example["response_tokens"])
    messages, tools = parse_row(row, where), parse_tools(row, where)
    try:
      example = encode_conversation(messages, tok, tools)
    except ValueError as e:
      raise ValueError(f"{where}: {e}") from None
    prompt = len(example["prompt_tokens"])
    return example, prompt, prompt + len(example["response_tokens"])

  @classmethod
  def summarize(cls, arrays):
    return {"trained_tokens": int(np.count_nonzero(arrays["response_mask"]))}

  def item(self, example):
    return {**example, "advantages": np.float32(1.0)}

  @property
  def trained_tokens(self) -> int:
    """Loss tokens over all examples (before any truncation)."""
    return self.summary["trained_tokens"]
