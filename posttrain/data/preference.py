"""Preference pairs from JSON-lines files, for DPO and its variants.

    data = PreferenceData.from_files("pairs.jsonl", tok, row_len=2048)
    it = iter(data.dataset(seed=0).to_iter_dataset())    # pairs, reshuffled every epoch

One pair per line, in Hugging Face TRL's two preference formats:

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
    prompt = row["prompt"]
    if isinstance(prompt, str):
      prompt = [{"role": "user", "content": prompt}]
    prompt = parse_messages(prompt, where, "prompt")
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
  if prompt[-1]["role"] == "assistant":
    raise ValueError(f"{where}: the prompt must not end with an assistant turn")
  return prompt, _answer(chosen, where, "chosen"), _answer(rejected, where, "rejected")


def encode_pair(prompt: Sequence[dict], chosen: Sequence[dict], rejected: Sequence[dict],
                tok: Tokenizer) -> dict[str, np.ndarray]:
  """A pair's token arrays (module docstring): both answers after the same context."""
  out, contexts = {}, []
  context = [{**m, "weight": 0} for m in prompt]  # earlier assistant turns are context
  for name, answer in (("chosen", chosen), ("rejected", rejected)):
    ids, mask = tok.encode_chat(context + list(answer))
    trained = np.flatnonzero(mask)
    first, last = int(trained[0]), int(trained[-1])
    contexts.append(ids[:first])
    out[f"{name}_tokens"] = np.asarray(ids[first:last + 1], np.int32)
    out[f"{name}_mask"] = np.asarray(mask[first:last + 1], np.int32)
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
        if not isinstance(row["domain"], str) or not row["domain"]:
          raise ValueError(f"{where}: 'domain' must be a non-empty string, got "
                           f"{row['domain']!r}")
        pair["domain"] = row["domain"]
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
