"""A model's reasoning apart from its answer: thinking blocks and harmony channels.

Reasoning models write a chain of thought before the answer:

  think     Qwen3, QwQ, DeepSeek-R1:  "<think>\\n...\\n</think>\\n\\nthe answer"
  channel   Gemma 4:  "<|channel>thought\\n...<channel|>the answer"
  harmony   gpt-oss: "<|channel|>analysis<|message|>...<|end|>"
            "<|start|>assistant<|channel|>final<|message|>the answer<|return|>"

`split_think` and `split_harmony` take a completion's token ids and return a `Response`:
the content (what a verifier, a reward model or a majority vote reads), the reasoning,
how many of the tokens were reasoning, and whether the reasoning ended. The chat formats of
`posttrain.data.tokenizer` pick theirs (`ChatFormat.split_response`); rollouts score the
content (`RolloutWorker(reasoning=...)`).

think: the reasoning is what comes before the first "</think>" (after a "<think>" if there
is one: a template may open the block in the prompt); the content is what follows it. Both
are stripped of surrounding whitespace, as transformers' `parse_response` strips them. A
completion that opened a block and never closed it ran out of tokens while thinking: its
content is empty and `closed` is False. One without tags is all content.

harmony: the completion is a run of messages, each a header (role, `<|channel|>` name,
recipient) and a body up to <|end|>, <|return|> or <|call|>. A message to a function (a
recipient "to=functions.NAME", in the role or the channel part of its header, as gpt-oss's
template and the model write it) is a tool call: its (NAME, body) goes to `calls` once the
message ended. Of the other messages, the analysis channel is the reasoning and every other
channel (final, and commentary preambles) the content, bodies joined by a blank line.
`closed` is False when the model wrote analysis and never left that channel. A completion
with no message in it is all content.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# Gemma 4's thought channel: its tags (special tokens) and the channel's name, which opens
# the block's text ("<|channel>thought\n...<channel|>").
CHANNEL_OPEN, CHANNEL_CLOSE, CHANNEL_THOUGHT = "<|channel>", "<channel|>", "thought"
# RolloutWorker(reasoning=...): "auto" is the tokenizer's own chat format's split; "none"
# scores the whole completion; "think" reads <think> blocks whatever the tokenizer (text
# tags, e.g. a byte tokenizer's).
MODES = ("auto", "none", "think")
# A harmony header's recipient ("to=functions.add"), and the namespace of the functions a
# conversation's tool schemas declare.
HARMONY_TO, HARMONY_FUNCTIONS = "to=", "functions."


@dataclasses.dataclass(frozen=True)
class Response:
  """One completion split into its content and its reasoning.

  reasoning_tokens: tokens the reasoning took (its tags and channel headers included).
  closed: False when the completion was still reasoning at its last token.
  calls: the tool calls the model wrote as messages of their own (harmony's), as
    (function name, arguments text) pairs, in order.
  """

  content: str
  reasoning: str = ""
  reasoning_tokens: int = 0
  closed: bool = True
  calls: tuple[tuple[str, str], ...] = ()


def split_plain(tok, ids: Sequence[int]) -> Response:
  """No reasoning: the whole completion (its stop tokens left out) is the content."""
  stops = set(tok.stop_ids)
  return Response(tok.decode([t for t in ids if int(t) not in stops]))


def _tokens_through(tok, ids: list[int], needle: str) -> int:
  """The fewest leading tokens whose text holds `needle` (which the whole text holds)."""
  lo, hi = 1, len(ids)
  while lo < hi:
    mid = (lo + hi) // 2
    if needle in tok.decode(ids[:mid]):
      hi = mid
    else:
      lo = mid + 1
  return lo


def split_think(tok, ids: Sequence[int], *, open_id: int | None = None,
                close_id: int | None = None, opened: bool = False,
                tags: tuple[str, str] = (THINK_OPEN, THINK_CLOSE), label: str = "") -> Response:
  """Splits at the first </think>. `open_id` / `close_id`: the tags' ids where each is one
  token of the vocabulary (a tokenizer may drop them from decoded text as special tokens);
  otherwise the tags are read in the text. `opened`: the prompt opened the block (DeepSeek
  R1's generation prompt ends with "<think>\n"), so a completion without </think> is all
  reasoning. `tags`: another family's (open, close) in place of <think> and </think>
  (Gemma 4's thought channel, `split_channel`), `label` a name the block's text starts
  with that is no part of the reasoning."""
  think_open, think_close = tags

  def head_of(text, maxsplit=-1):  # the reasoning: after the (last) opening tag
    text = text.split(think_open, maxsplit)[-1].strip()
    return text[len(label):].strip() if label and text.startswith(label) else text

  ids = [int(t) for t in ids]
  stops = set(tok.stop_ids)
  while ids and ids[-1] in stops:
    ids.pop()
  if close_id is not None and close_id in ids:
    cut = ids.index(close_id)
    opens = [p for p in range(cut) if ids[p] == open_id] if open_id is not None else []
    head = tok.decode(ids[opens[-1] + 1 if opens else 0:cut])
    return Response(tok.decode(ids[cut + 1:]).strip(), head_of(head), cut + 1, True)
  text = tok.decode(ids)
  if close_id is None and think_close in text:
    head, _, tail = text.partition(think_close)
    return Response(tail.strip(), head_of(head), _tokens_through(tok, ids, think_close), True)
  opened = opened or text.lstrip().startswith(think_open)
  if open_id is not None and open_id in ids:
    opened = opened or not tok.decode(ids[:ids.index(open_id)]).strip()
  if opened:
    return Response("", head_of(text, 1), len(ids), False)
  return Response(text.strip())


def split_channel(tok, ids: Sequence[int], *, open_id: int | None = None,
                  close_id: int | None = None, opened: bool = False) -> Response:
  """Gemma 4's thought channel: the reasoning is the block "<|channel>thought\n ...
  <channel|>" (its name left out), the content what follows it; read as `split_think`
  reads <think> blocks (a block never closed: all reasoning, not closed)."""
  return split_think(tok, ids, open_id=open_id, close_id=close_id, opened=opened,
                     tags=(CHANNEL_OPEN, CHANNEL_CLOSE), label=CHANNEL_THOUGHT)


def split_harmony(tok, ids: Sequence[int], *, start: int, channel: int, message: int,
                  ends: Sequence[int]) -> Response:
  """Splits a harmony completion into its analysis messages, its calls to functions and the
  rest. `start`, `channel`, `message`: the ids of <|start|>, <|channel|>, <|message|>;
  `ends`: those that end a message (<|end|>, <|return|>, <|call|>)."""
  ids = [int(t) for t in ids]
  ends = set(int(e) for e in ends)
  # channel, the function called (None: not a call), body, tokens, ended
  found: list[tuple[str | None, str | None, str, int, bool]] = []
  i = 0
  while i < len(ids):
    j = i + 1 if ids[i] == start else i
    try:
      k = ids.index(message, j)
    except ValueError:
      break  # a header the model never finished: no body to read
    header = ids[j:k]
    cut = header.index(channel) if channel in header else len(header)
    words = tok.decode(header[cut + 1:]).split() if cut < len(header) else []
    recipients = [w[len(HARMONY_TO):] for w in tok.decode(header[:cut]).split() + words[1:]
                  if w.startswith(HARMONY_TO)]
    function = next((r[len(HARMONY_FUNCTIONS):] for r in recipients
                     if r.startswith(HARMONY_FUNCTIONS)), None)
    stop = next((p for p in range(k + 1, len(ids)) if ids[p] in ends), len(ids))
    ended = stop < len(ids)
    found.append((words[0] if words else None, function, tok.decode(ids[k + 1:stop]),
                  stop + ended - i, ended))
    i = stop + 1
  if not found:
    return split_plain(tok, ids)
  calls = tuple((function, body) for _, function, body, _, ended in found
                if function is not None and ended)
  thought = [(body, n) for name, function, body, n, _ in found
             if name == "analysis" and function is None]
  said = [body.strip() for name, function, body, _, _ in found
          if name != "analysis" and function is None]
  left = len(thought) < len(found)  # a message on another channel, or a call, came
  return Response("\n\n".join(s for s in said if s),
                  "\n\n".join(b.strip() for b, _ in thought if b.strip()),
                  sum(n for _, n in thought), left or not thought, calls)
