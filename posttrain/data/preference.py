"""Preference pairs from data files, for DPO and its variants.

    data = PreferenceData.from_files("pairs.jsonl", tok, row_len=2048)
    it = iter(data.dataset(seed=0).to_iter_dataset())    # pairs, reshuffled every epoch

One pair per row (JSON lines, a JSON array or Parquet, as Hugging Face datasets hold
them: `posttrain.data.rows`), in TRL's two preference formats:

    {"prompt": "..." | [messages], "chosen": "..." | [messages], "rejected": "..." | [messages]}
    {"chosen": [messages], "rejected": [messages]}      # the shared leading turns are the prompt

A string prompt is one user turn and a string answer one assistant turn. Answers are
assistant turns (with tool turns between them); the loss falls on their assistant tokens
(`"weight": 0` makes one context), through the model's chat template, exactly as in SFT
(`posttrain.data.sft`). Each pair comes out as

    prompt_tokens               int32 [P]  the shared context up to the answers
    chosen_tokens, chosen_mask  int32 [C]  the preferred answer and its loss mask
    rejected_tokens, rejected_mask

A row may carry a `"margin"` (a number, TRL's column): the reward model's Bradley-Terry
loss then asks its chosen answer to score at least that much above the rejected one
(`posttrain.rl.reward_model`); the DPO losses ignore it. An optional `"domain"` (a
string) names the row's group: a reward model's held-out accuracy is reported per group.

Unpaired feedback, for KTO, is `UnpairedData`: one answer per row with a verdict, in
TRL's unpaired format, `{"prompt": ..., "completion": "..." | [messages], "label": true}`
(`false`: undesirable), optionally with a `"domain"`. A pair row in either format above is
accepted too and becomes two examples, its chosen answer desirable and its rejected one
undesirable (TRL's `unpair_preference_dataset`). Each example comes out as

    prompt_tokens                        int32 [P]  the context up to the answer
    completion_tokens, completion_mask   int32 [C]  the answer and its loss mask
    label                                1.0 desirable, 0.0 undesirable

Rows are validated and tokenized when the files load: a bad row fails naming file and
line. A pair longer than `row_len` keeps its head (the packer cuts each answer's tail);
a pair whose prompt leaves no answer token in `row_len` is dropped with a warning. With a
`cache_dir` the tokenized pairs are kept for later loads, memory-mapped, as SFT data are
(`posttrain.data.sft`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from posttrain.data.sft import JsonlExamples, json_object, parse_messages
from posttrain.data.tokenizer import Tokenizer


def _answer(value, where: str, key: str) -> list[dict]:
  if isinstance(value, str):
    value = [{"role": "assistant", "content": value}]
  messages = parse_messages(value, where, key)
  roles = {m["role"] for m in messages}
  if roles - {"assistant", "tool"} or messages[0]["role"] != "assistant":
    raise ValueError(f"{where}: {key!r} must be assistant turns (tool turns between them), "
                     f"starting with an assistant turn; it holds {[m['role'] for m in messages]}")
  if not any(m["role"] == "assistant" and m["weight"] for m in messages):
    raise ValueError(f"{where}: {key!r} has no assistant message to train on")
  return messages


def _prompt(value, where: str) -> list[dict]:
  if isinstance(value, str):
    value = [{"role": "user", "content": value}]
  prompt = parse_messages(value, where, "prompt")
  if prompt[-1]["role"] == "assistant":
    raise ValueError(f"{where}: the prompt must not end with an assistant turn")
  return prompt


def _domain(value, where: str) -> str:
  if not isinstance(value, str) or not value:
    raise ValueError(f"{where}: 'domain' must be a non-empty string, got {value!r}")
  return value


def _margin(value, where: str) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
    raise ValueError(f"{where}: 'margin' must be a finite number, got {value!r}")
  return float(value)


def parse_pair(line: str | dict, where: str) -> tuple[list[dict], list[dict], list[dict]]:
  """One JSON line (or its parsed object) as (prompt, chosen, rejected) message lists;
  ValueError naming `where`."""
  row = json_object(line, where) if isinstance(line, str) else line
  if "chosen" not in row or "rejected" not in row:
    raise ValueError(f"{where}: a pair needs 'chosen' and 'rejected' (and 'prompt' unless "
                     f"they are conversations sharing their first turns); it has {sorted(row)}")
  if "prompt" in row:
    prompt = _prompt(row["prompt"], where)
    chosen, rejected = row["chosen"], row["rejected"]
  else:
    whole = {k: parse_messages(row[k], where, k) for k in ("chosen", "rejected")}
    shared = 0
    for a, b in zip(whole["chosen"], whole["rejected"]):
      if a != b:
        break
      shared += 1
    # The prompt ends before the answers' first assistant turn.
    while shared and whole["chosen"][shared - 1]["role"] == "assistant":
      shared -= 1
    if shared == 0:
      raise ValueError(f"{where}: without 'prompt', 'chosen' and 'rejected' must share their "
                       "first turns (the prompt)")
    prompt = whole["chosen"][:shared]
    chosen, rejected = whole["chosen"][shared:], whole["rejected"][shared:]
  return prompt, _answer(chosen, where, "chosen"), _answer(rejected, where, "rejected")


def parse_unpaired(line: str | dict, where: str
                   ) -> list[tuple[list[dict], list[dict], bool]]:
  """One JSON line (or its parsed object) as its (prompt, completion, desirable) examples:
  one for an unpaired row, two for a pair (chosen desirable, then rejected); ValueError
  naming `where`."""
  row = json_object(line, where) if isinstance(line, str) else line
  paired = "chosen" in row or "rejected" in row
  if "completion" in row and paired:
    raise ValueError(f"{where}: give 'completion' and 'label', or a pair's 'chosen' and "
                     "'rejected', not both")
  if paired:
    prompt, chosen, rejected = parse_pair(row, where)
    return [(prompt, chosen, True), (prompt, rejected, False)]
  if "completion" not in row or "prompt" not in row:
    raise ValueError(f"{where}: a row needs 'prompt', 'completion' and 'label', or a pair's "
                     f"'chosen' and 'rejected'; it has {sorted(row)}")
  prompt = _prompt(row["prompt"], where)
  completion = _answer(row["completion"], where, "completion")
  if "label" not in row:
    raise ValueError(f"{where}: an unpaired row needs a 'label' (true: desirable)")
  if not isinstance(row["label"], bool):
    raise ValueError(f"{where}: 'label' must be true or false, got {row['label']!r}")
  return [(prompt, completion, row["label"])]


def _encode_answer(prompt: Sequence[dict], answer: Sequence[dict], tok: Tokenizer
                   ) -> tuple[list[int], np.ndarray, np.ndarray]:
  """(tokens before the first trained one, the answer's tokens from it to the last trained
  one, their loss mask) of `answer` after `prompt`."""
  context = [{**m, "weight": 0} for m in prompt]  # earlier assistant turns are context
  ids, mask = tok.encode_chat(context + list(answer))
  trained = np.flatnonzero(mask)
  first, last = int(trained[0]), int(trained[-1])
  return (ids[:first], np.asarray(ids[first:last + 1], np.int32),
          np.asarray(mask[first:last + 1], np.int32))


def encode_unpaired(prompt: Sequence[dict], completion: Sequence[dict], tok: Tokenizer
                    ) -> dict[str, np.ndarray]:
  """An unpaired example's token arrays (module docstring), as `encode_pair` makes one
  answer's."""
  context, tokens, mask = _encode_answer(prompt, completion, tok)
  return {"prompt_tokens": np.asarray(context, np.int32), "completion_tokens": tokens,
          "completion_mask": mask}


def encode_pair(prompt: Sequence[dict], chosen: Sequence[dict], rejected: Sequence[dict],
                tok: Tokenizer) -> dict[str, np.ndarray]:
  """A pair's token arrays (module docstring): both answers after the same context."""
  out, contexts = {}, []
  for name, answer in (("chosen", chosen), ("rejected", rejected)):
    context, out[f"{name}_tokens"], out[f"{name}_mask"] = _encode_answer(prompt, answer, tok)
    contexts.append(context)
  if contexts[0] != contexts[1]:
    raise ValueError("'chosen' and 'rejected' must start training at the same point: give "
                     "their untrained leading turns in the prompt")
  out["prompt_tokens"] = np.asarray(contexts[0], np.int32)
  return out


class PreferenceData(JsonlExamples):
  """Preference pairs (module docstring)."""

  KIND = "preference"
  # In the order encode_pair makes them.
  TOKEN_FIELDS = ("chosen_tokens", "chosen_mask", "rejected_tokens", "rejected_mask",
                  "prompt_tokens")
  SCALARS = {"margin": float, "domain": str}

  @classmethod
  def encode_line(cls, line, where, tok):
    try:
      row = json_object(line, where)
      pair = encode_pair(*parse_pair(row, where), tok)
      if "margin" in row:
        pair["margin"] = _margin(row["margin"], where)
      if "domain" in row:
        pair["domain"] = _domain(row["domain"], where)
    except ValueError as e:
      message = str(e)
      raise ValueError(message if message.startswith(where) else f"{where}: {message}"
                       ) from None
    prompt = len(pair["prompt_tokens"])
    longest = max(len(pair["chosen_tokens"]), len(pair["rejected_tokens"]))
    return pair, prompt, prompt + longest

  @classmethod
  def summarize(cls, arrays):
    chosen, rejected = arrays["chosen_tokens"], arrays["rejected_tokens"]
    c, r = arrays["chosen_tokens.offsets"], arrays["rejected_tokens.offsets"]
    same_length = np.flatnonzero(np.diff(c) == np.diff(r))
    return {"identical": sum(bool(np.array_equal(chosen[c[i]:c[i + 1]],
                                                 rejected[r[i]:r[i + 1]]))
                             for i in same_length)}

  @property
  def identical(self) -> int:
    """Pairs whose two answers are the same tokens (they teach nothing)."""
    return self.summary["identical"]


class UnpairedData(JsonlExamples):
  """Unpaired feedback for KTO: one answer with a desirable/undesirable label per example
  (module docstring)."""

  KIND = "unpaired"
  TOKEN_FIELDS = ("prompt_tokens", "completion_tokens", "completion_mask")
  SCALARS = {"label": float, "domain": str}  # label: 1.0 desirable, 0.0 undesirable

  @classmethod
  def encode_lines(cls, line, where, tok):
    try:
      row = json_object(line, where)
      domain = _domain(row["domain"], where) if "domain" in row else None
      examples = []
      for prompt, completion, desirable in parse_unpaired(row, where):
        example = {**encode_unpaired(prompt, completion, tok), "label": float(desirable)}
        if domain is not None:
          example["domain"] = domain
        examples.append(example)
    except ValueError as e:
      message = str(e)
      raise ValueError(message if message.startswith(where) else f"{where}: {message}"
                       ) from None
    return [(x, len(x["prompt_tokens"]),
             len(x["prompt_tokens"]) + len(x["completion_tokens"])) for x in examples]

  @classmethod
  def encode_line(cls, line, where, tok):
    examples = cls.encode_lines(line, where, tok)
    if len(examples) != 1:
      raise ValueError(f"{where}: a pair row is two examples; use encode_lines")
    return examples[0]

  @classmethod
  def summarize(cls, arrays):
    desirable = int(np.count_nonzero(arrays["label"]))
    return {"desirable": desirable, "undesirable": len(arrays["label"]) - desirable}

  def item(self, example):
    return {**example, "label": bool(example["label"])}

  @property
  def desirable(self) -> int:
    """Examples labelled desirable."""
    return self.summary["desirable"]

  @property
  def undesirable(self) -> int:
    """Examples labelled undesirable."""
    return self.summary["undesirable"]
