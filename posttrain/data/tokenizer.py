"""Tokenizers and chat templates that return a loss mask with the token ids.

Two tokenizers share one interface:
  * `ByteTokenizer`: no files; ids 0..255 are bytes, specials follow (roles, pad, eos).
    The embedded default and the tests use it.
  * `HFTokenizer`: a Hugging Face `tokenizer.json` through the `tokenizers` package, with the
    DeepSeek-R1, Mistral, Llama 3, ChatML (Qwen), Gemma or harmony (gpt-oss) chat format
    picked from the vocabulary.

`encode_chat(messages)` returns (ids, mask) where mask[i] = 1 exactly for tokens the model
itself produced (assistant content and its end-of-turn token, and its reasoning and channel
headers in formats that have them): the SFT and RL loss mask. An assistant message with
`"weight": 0` (the OpenAI fine-tuning format's flag) is context, masked like a user turn.

Reasoning models: an assistant message may carry its reasoning ("reasoning_content", or
"thinking" as gpt-oss's template calls it); Qwen3's ChatML (a vocabulary with <think>) and
harmony render it as their templates do, and `encode_chat(..., thinking=...)` sets their
reasoning switch. `split_response(ids)` reads a completion back into its content and its
reasoning (`posttrain.data.reasoning`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
from typing import Any, Sequence

from posttrain.data import reasoning as reasoning_lib

Message = dict  # {"role": "system"|"user"|"assistant"|"tool", "content": str}

# Harmony (gpt-oss): the system message its chat template always opens with (without the
# current date, so that a prompt's ids do not change from day to day), at a reasoning effort
# (low, medium or high; the template's default is medium), and with the line the template
# adds when the conversation declares functions (`tools`). A conversation's own system
# message becomes a developer message, "# Instructions\n\n" + its content + "\n\n".
def harmony_system(effort: str = "medium", tools: bool = False) -> str:
  return ("You are ChatGPT, a large language model trained by OpenAI.\n"
          f"Knowledge cutoff: 2024-06\n\nReasoning: {effort}\n\n"
          "# Valid channels: analysis, commentary, final. Channel must be included "
          "for every message."
          + ("\nCalls to these tools must go to the commentary channel: 'functions'."
             if tools else ""))


HARMONY_SYSTEM = harmony_system()
HARMONY_EFFORTS = ("low", "medium", "high")
ROLES = ("system", "user", "assistant", "tool")
# load_tokenizer("template:PATH"): the tokenizer's own chat template, whatever its tokens.
TEMPLATE_PREFIX = "template:"
REASONING_FIELDS = ("reasoning_content", "thinking")  # an assistant message's reasoning


class ChatFormat:
  """A chat layout: per-role header tokens, an end-of-turn token, and plain-text glue.

  `fold_system` (Gemma, whose template has no system turn): a leading system message
  becomes the start of the first user turn, "<system>\n\n<user>". `strip`: contents are
  stripped of surrounding whitespace, as Gemma's template trims them. `ends`: end-of-turn
  tokens of particular roles; `generation_header`: what opens the turn the model writes,
  when it is not the assistant's header; `closing`: what a conversation rendered without
  a generation prompt ends with (Phi's templates: the eos token).

  The mask marks what the model writes after a generation prompt: an assistant message's
  content and its end-of-turn token (and, in formats that have them, its reasoning and
  channel headers). An assistant message with `"weight": 0` is context, masked like a
  user turn. `reasoning`: how this format's completions carry reasoning (None, "think",
  "harmony"); `split_response` reads it.
  """

  name = "plain"
  reasoning: str | None = None
  opens_reasoning = False  # the generation prompt opens the reasoning block (DeepSeek-R1)

  def __init__(self, tok: "Tokenizer", headers: dict[str, list[int]], end_of_turn: list[int],
               after_end: list[int] = (), bos: list[int] = (), fold_system: bool = False,
               strip: bool = False, ends: dict[str, list[int]] | None = None,
               generation_header: list[int] | None = None, name: str | None = None,
               closing: list[int] = ()):
    self.tok, self.headers, self.end_of_turn = tok, headers, list(end_of_turn)
    self.closing = list(closing)
    self.after_end, self.bos = list(after_end), list(bos)
    self.fold_system, self.strip = fold_system, strip
    self.ends = {role: list(end) for role, end in (ends or {}).items()}
    self.generation_header = list(headers["assistant"] if generation_header is None
                                  else generation_header)
    if name:
      self.name = name

  # --- rendering ------------------------------------------------------------------------

  def encode(self, messages: Sequence[Message], add_generation_prompt: bool = False,
             thinking: bool | str | None = None, tools: Sequence[dict] | None = None
             ) -> tuple[list[int], list[int]]:
    """(ids, mask) of a whole conversation. `thinking`: the generation prompt's reasoning
    switch where the format has one (see `generation_prompt`). `tools`: function schemas
    the model may call in its own format, where the format renders them (ChatML)."""
    self.check_tools(tools)
    self.check_thinking(thinking)
    return self._conversation(*self.opening(thinking), messages, add_generation_prompt,
                              thinking)

  def _conversation(self, ids: list[int], mask: list[int], messages: Sequence[Message],
                    add_generation_prompt: bool, thinking) -> tuple[list[int], list[int]]:
    """(ids, mask) of an opening followed by `messages` and, when asked, the generation
    prompt."""
    body, own = self._render(messages, add_generation_prompt)
    ids, mask = ids + body, mask + own
    if add_generation_prompt:
      prompt = self.generation_prompt(thinking)
      ids, mask = ids + prompt, mask + [0] * len(prompt)
    elif self.closing:
      ids, mask = ids + self.closing, mask + [0] * len(self.closing)
    return ids, mask

  def continuation(self, messages: Sequence[Message], *, ended: bool = True,
                   thinking: bool | str | None = None) -> list[int]:
    """The tokens that carry a transcript on after a model turn: the turn's end-of-turn
    when the model did not write one (`ended` False: it ran out of tokens), what the
    template puts after a turn's end, `messages` (a tool's answer, a user turn) and the
    next generation prompt. No opening (bos, system preamble): that is in the transcript."""
    self.check_thinking(thinking)
    ids = ([] if ended else list(self.end_of_turn)) + list(self.after_end)
    return ids + self._render(messages, True)[0] + self.generation_prompt(thinking)

  def opening(self, thinking=None) -> tuple[list[int], list[int]]:
    """What every conversation starts with (bos; harmony's system message), masked out."""
    del thinking
    return list(self.bos), [0] * len(self.bos)

  def generation_prompt(self, thinking: bool | str | None = None) -> list[int]:
    """What opens the turn the model writes."""
    del thinking
    return list(self.generation_header)

  def check_tools(self, tools) -> None:
    """Raises ValueError where tools are given to a format that does not render them."""
    if tools:
      raise ValueError(f"the {self.name} chat format does not render tool schemas here: "
                       "rollout.tool_format=native needs Qwen's ChatML, Llama 3.1+ or "
                       "harmony (gpt-oss); use text")

  def read_tool_calls(self, text: str) -> list[tuple[int, int, Any, Any]]:
    """(start, end, name, arguments) of the tool calls a model wrote in its own format in
    `text` (none where the format has no such format here)."""
    del text
    return []

  def write_tool_call(self, name: str, arguments: dict) -> str:
    """A tool call as the model writes it in its own format (its template's rendering)."""
    raise ValueError(f"the {self.name} chat format has no tool calls of its own here")

  def write_tool_calls(self, content: str, calls: Sequence[tuple[str, dict | str]]) -> str:
    """An assistant turn's content with its structured calls ((name, arguments) pairs, the
    arguments an object or its JSON text) written after it, as the template renders an
    OpenAI-style message's `tool_calls`."""
    del content, calls
    raise ValueError(f"the {self.name} chat format has no tool calls of its own here: "
                     "messages with 'tool_calls' need Qwen's ChatML, Llama 3.1+ or harmony")

  def fold_tool_calls(self, messages: Sequence[Message]) -> list[Message]:
    """`messages` with each assistant message's structured `tool_calls` (OpenAI's and
    TRL's: [{"type": "function", "function": {"name", "arguments"}}], or the inner
    objects) written into its content by `write_tool_calls`."""
    out = []
    for i, m in enumerate(messages):
      if isinstance(m, dict) and m.get("tool_calls") is not None:
        if m.get("role") != "assistant":
          raise ValueError(f"message {i}: only an assistant message has tool_calls, not a "
                           f"{m.get('role')!r} message")
        content = m.get("content") or ""
        if not isinstance(content, str):
          raise ValueError(f"message {i}: content must be a string, got "
                           f"{type(content).__name__}")
        calls = _structured_calls(m["tool_calls"], f"message {i}")
        m = {k: v for k, v in m.items() if k != "tool_calls"}
        m["content"] = self.write_tool_calls(content, calls)
      out.append(m)
    return out

  def check_thinking(self, thinking) -> None:
    """Raises ValueError unless `thinking` is a reasoning switch this format takes."""
    if thinking is not None:
      raise ValueError(f"the {self.name} chat format has no reasoning switch; thinking must "
                       f"be None, got {thinking!r}")

  def _message(self, m: Message) -> tuple[str, str, str | None]:
    """(role, content, reasoning) of a message, checked."""
    role, content = m.get("role"), m.get("content", "")
    if role not in self.headers:
      raise ValueError(f"unknown chat role {role!r}; expected one of {ROLES}")
    if not isinstance(content, str):
      raise ValueError(f"message content must be a string, got {type(content).__name__}")
    reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
    if reasoning is not None and not isinstance(reasoning, str):
      raise ValueError(f"message reasoning must be a string, got {type(reasoning).__name__}")
    if reasoning and (role != "assistant" or self.reasoning is None):
      where = (f"the {self.name} chat format has no reasoning" if role == "assistant"
               else f"a {role} message has no reasoning")
      raise ValueError(f"{where}: move the message's reasoning into its content or drop it")
    return role, content, reasoning

  def _render(self, messages: Sequence[Message], add_generation_prompt: bool
              ) -> tuple[list[int], list[int]]:
    del add_generation_prompt
    ids, mask = [], []
    prefix = ""
    if (self.fold_system and len(messages) > 1 and messages[0].get("role") == "system"
        and messages[1].get("role") == "user" and isinstance(messages[0].get("content"), str)):
      prefix, messages = messages[0]["content"] + "\n\n", messages[1:]
    for m in messages:
      role, content, _ = self._message(m)
      if self.strip:
        content = content.strip()
      body = self.tok.encode(prefix + content) + self.ends.get(role, self.end_of_turn)
      prefix = ""
      own = 1 if role == "assistant" and m.get("weight", 1) else 0
      ids += self.headers[role] + body + self.after_end
      mask += [0] * len(self.headers[role]) + [own] * len(body) + [0] * len(self.after_end)
    return ids, mask

  # --- reading completions --------------------------------------------------------------

  def split_response(self, ids: Sequence[int], prompt: Sequence[int] | None = None
                     ) -> reasoning_lib.Response:
    """A completion's content and reasoning (`posttrain.data.reasoning`). `prompt`: the
    tokens before it, where the format's reading depends on them (DeepSeek-R1's)."""
    del prompt
    return reasoning_lib.split_plain(self.tok, ids)


def _structured_calls(value: Any, where: str) -> list[tuple[str, dict | str]]:
  """(name, arguments) of an OpenAI-style `tool_calls` list; ValueError naming `where`."""
  if not isinstance(value, list) or not value:
    raise ValueError(f"{where}: tool_calls must be a non-empty list")
  calls = []
  for j, call in enumerate(value):
    function = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(function, dict):
      raise ValueError(f"{where}: tool_calls[{j}] must be an object with a 'function'")
    name, arguments = function.get("name"), function.get("arguments", {})
    if not isinstance(name, str) or not name:
      raise ValueError(f"{where}: tool_calls[{j}] needs a function name")
    if not isinstance(arguments, (dict, str)):
      raise ValueError(f"{where}: tool_calls[{j}] arguments must be an object or its JSON "
                       f"text, got {type(arguments).__name__}")
    calls.append((name, arguments))
  return calls


class Llama3Format(ChatFormat):
  """Llama 3's layout, as its templates render text conversations: contents trimmed, tool
  answers in "ipython" turns.

  `dated` (the Llama 3.1 - 3.3 templates, which write "Cutting Knowledge Date"): every
  conversation opens with a system turn, "Cutting Knowledge Date: December 2023\nToday
  Date: 26 Jul 2024\n\n" and then the conversation's own system message, if any. The date
  is the template's fallback, fixed so that a prompt's ids do not change from day to day
  (the template writes today's where it can). `json_tools` (the same templates): a tool's
  answer is written as a JSON string, as their `tojson` writes a string. With tool
  schemas (dated templates), the system turn says "Environment: ipython", the first user
  message carries the schemas (the templates' tools_in_user_message), and the model calls
  a tool by answering a JSON object, {"name": ..., "parameters": {...}}.
  """

  def __init__(self, tok, headers, end_of_turn, *, dated: bool = False,
               json_tools: bool = False, **kw):
    super().__init__(tok, headers, end_of_turn, strip=True, name="Llama 3", **kw)
    self.dated, self.json_tools = dated, json_tools

  def encode(self, messages, add_generation_prompt=False, thinking=None, tools=None):
    self.check_tools(tools)
    if not self.dated:
      return super().encode(messages, add_generation_prompt, thinking)
    system = ""
    if messages and messages[0].get("role") == "system":
      system = self._message(messages[0])[1].strip()
      messages = messages[1:]
    environment = "Environment: ipython\n" if tools else ""
    head = (self.headers["system"] + self.tok.encode(
        f"{environment}Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
        f"{system}") + self.end_of_turn)
    if tools:
      if not messages or messages[0].get("role") != "user":
        raise ValueError("Llama 3 writes tool schemas into the first user message; the "
                         "conversation has none")
      listed = "".join(json.dumps(t, ensure_ascii=False, indent=4) + "\n\n" for t in tools)
      first = self._message(messages[0])[1].strip()
      messages = [dict(messages[0], content=(
          "Given the following functions, please respond with a JSON for a function call "
          "with its proper arguments that best answers the given prompt.\n\nRespond in the "
          'format {"name": function name, "parameters": dictionary of argument name and its '
          f'value}}.Do not use variables.\n\n{listed}{first}'))] + list(messages[1:])
    ids, mask = super().encode(messages, add_generation_prompt, thinking)
    n = len(self.bos)
    return ids[:n] + head + ids[n:], mask[:n] + [0] * len(head) + mask[n:]

  def check_tools(self, tools) -> None:
    if tools and not self.dated:
      super().check_tools(tools)

  def write_tool_call(self, name, arguments):
    return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)

  def write_tool_calls(self, content, calls):
    """Llama 3.1's: the turn is its one call's JSON; the template writes no content beside
    it, so a turn with content is refused rather than losing it. Arguments given as text
    are written as a JSON string, as the template's tojson writes them."""
    if not self.dated:
      return super().write_tool_calls(content, calls)
    if len(calls) != 1:
      raise ValueError(f"Llama 3.1's template renders one tool call per turn, got "
                       f"{len(calls)}")
    if content.strip():
      raise ValueError("Llama 3.1's template writes a tool-calling turn as the call alone "
                       "and would drop its content; move the content to its own turn")
    (name, arguments), = calls
    return (f'{{"name": "{name}", "parameters": '
            f'{json.dumps(arguments, ensure_ascii=False)}}}')

  def read_tool_calls(self, text):
    """A Llama 3.1 call: the whole answer a JSON object with a "name" (and "parameters")."""
    try:
      call = json.loads(text.strip())
    except ValueError:
      return []
    if not isinstance(call, dict) or "name" not in call:
      return []
    return [(0, len(text), call.get("name"), call.get("parameters", call.get("arguments")))]

  def _render(self, messages, add_generation_prompt):
    if self.json_tools:
      messages = [dict(m, content=json.dumps(m["content"], ensure_ascii=False))
                  if m.get("role") == "tool" and isinstance(m.get("content"), str) else m
                  for m in messages]
    return super()._render(messages, add_generation_prompt)


class MistralFormat(ChatFormat):
  """Mistral's [INST] layout (Mistral-7B-Instruct-v0.3's template, text conversations):
  bos, "[INST] user[/INST]" turns, assistant turns " content</s>" (trimmed), the system
  message prepended to the last user message ("[INST] system\n\nuser[/INST]"), and no
  generation prompt: the model writes after "[/INST]". Tool answers are user turns (the
  template's [TOOL_RESULTS] need tool-call ids our tool domains do not make).
  """

  def __init__(self, tok, *, bos, eos, inst, inst_end):
    self.inst, self.inst_end = inst, inst_end
    headers = {r: [] for r in ROLES}
    super().__init__(tok, headers, [eos], bos=[bos] if bos is not None else [],
                     generation_header=[], name="Mistral")

  def encode(self, messages, add_generation_prompt=False, thinking=None, tools=None):
    self.check_tools(tools)
    self.check_thinking(thinking)
    system = None
    if messages and messages[0].get("role") == "system":
      system, messages = self._message(messages[0])[1], list(messages[1:])
    body, own = self._render(messages, add_generation_prompt, system=system)
    return list(self.bos) + body, [0] * len(self.bos) + own

  def _render(self, messages, add_generation_prompt, system=None):
    del add_generation_prompt
    users = [i for i, m in enumerate(messages) if m.get("role") in ("user", "tool")]
    ids, mask = [], []
    for i, m in enumerate(messages):
      role, content, _ = self._message(m)
      if role == "system":
        raise ValueError("the Mistral format takes a system message only at the start")
      if role in ("user", "tool"):
        if system is not None and users and i == users[-1]:
          content = f"{system}\n\n{content}"
        turn = [self.inst] + self.tok.encode(f" {content}") + [self.inst_end]
        ids += turn
        mask += [0] * len(turn)
      else:
        body = self.tok.encode(" " + content.strip()) + self.end_of_turn
        ids += body
        mask += [1 if m.get("weight", 1) else 0] * len(body)
    return ids, mask


def read_wrapped_json_calls(text: str, opener: str, closer: str,
                            arguments_key: str = "arguments") -> list[tuple[int, int, Any, Any]]:
  """(start, end, name, arguments) of each JSON call object between `opener` and `closer`
  tags in `text`; a block whose JSON does not parse to an object is a call with no name."""
  calls, pos = [], 0
  while True:
    start = text.find(opener, pos)
    end = text.find(closer, start + len(opener)) if start >= 0 else -1
    if end < 0:
      return calls
    try:
      call = json.loads(text[start + len(opener):end])
    except ValueError:
      call = None
    if not isinstance(call, dict):
      call = {}
    pos = end + len(closer)
    calls.append((start, pos, call.get("name"), call.get(arguments_key)))


class ChatMLFormat(ChatFormat):
  """Qwen's ChatML, as the Qwen 2.5 and Qwen3 templates render it.

  A conversation without a system message opens with the template's default one, where it
  has one (Qwen 2 and 2.5: "You are Qwen, created by Alibaba Cloud. ..."; read from the
  tokenizer's chat template, `default_system`). Tool messages are user turns,
  "<|im_start|>user\n<tool_response>\n...\n</tool_response>", consecutive ones sharing one
  turn. With `think` (a vocabulary with <think> and </think>: Qwen3), an assistant
  message after the last user query (a tool-calling run's turns, or the final answer in
  training data) carries its reasoning ("reasoning_content", or a <think> block in its
  content) as "<think>\nR\n</think>\n\n" before the content; the last message always gets
  the block, empty when it has no reasoning; earlier turns lose theirs, as the template
  drops them. `thinking=False` closes an empty block in the
  generation prompt (the template's enable_thinking=False).
  """

  def __init__(self, tok, headers, end_of_turn, *, think: tuple[int, int] | None,
               default_system: str | None = None, **kw):
    super().__init__(tok, headers, end_of_turn, name="ChatML", **kw)
    self.think_ids = think
    self.reasoning = "think" if think else None
    self.default_system = default_system

  def encode(self, messages, add_generation_prompt=False, thinking=None, tools=None):
    if self.default_system and (not messages or messages[0].get("role") != "system"):
      messages = [{"role": "system", "content": self.default_system}] + list(messages)
    if not tools:
      return super().encode(messages, add_generation_prompt, thinking)
    # Qwen's tools block: the system turn (the conversation's own system message, then a
    # blank line) followed by the function schemas and how to call them.
    system = ""
    if messages and messages[0].get("role") == "system":
      system, messages = self._message(messages[0])[1] + "\n\n", list(messages[1:])
    listed = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    head = (self.headers["system"] + self.tok.encode(
        f"{system}# Tools\n\nYou may call one or more functions to assist with the user "
        "query.\n\nYou are provided with function signatures within <tools></tools> XML "
        f"tags:\n<tools>{listed}\n</tools>\n\nFor each function call, return a json object "
        "with function name and arguments within <tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call>") + self.end_of_turn + self.after_end)
    ids, mask = super().encode(messages, add_generation_prompt, thinking)
    return head + ids, [0] * len(head) + mask

  def check_tools(self, tools) -> None:
    pass  # ChatML renders them

  def write_tool_call(self, name, arguments):
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{call}\n</tool_call>"

  def write_tool_calls(self, content, calls):
    """Qwen's: each call a <tool_call> block after the content, a newline before each but
    the first when there is no content; arguments given as text are written as they are."""
    parts = [content]
    for i, (name, arguments) in enumerate(calls):
      if i or content:
        parts.append("\n")
      if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
      parts.append(f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>')
    return "".join(parts)

  def read_tool_calls(self, text):
    """Qwen's calls: <tool_call>{"name": ..., "arguments": ...}</tool_call> (JSON); a block
    whose JSON does not parse is a call with no name."""
    return read_wrapped_json_calls(text, "<tool_call>", "</tool_call>")

  def check_thinking(self, thinking) -> None:
    if thinking is None:
      return
    if not self.think_ids:
      super().check_thinking(thinking)
    if not isinstance(thinking, bool):
      raise ValueError(f"thinking must be None, True or False for ChatML with <think>, got "
                       f"{thinking!r}")

  def generation_prompt(self, thinking=None) -> list[int]:
    ids = list(self.generation_header)
    if thinking is False:
      ids += self.tok.encode(f"{reasoning_lib.THINK_OPEN}\n\n{reasoning_lib.THINK_CLOSE}\n\n")
    return ids

  def _render(self, messages, add_generation_prompt):
    del add_generation_prompt
    last_query = len(messages) - 1
    for i in range(len(messages) - 1, -1, -1):
      c = messages[i].get("content")
      if messages[i].get("role") == "user" and isinstance(c, str) and not (
          c.startswith("<tool_response>") and c.endswith("</tool_response>")):
        last_query = i
        break
    ids, mask = [], []

    def add(tokens, own=0):
      ids.extend(tokens)
      mask.extend([own] * len(tokens))

    close = self.end_of_turn + self.after_end
    for i, m in enumerate(messages):
      role, content, thought = self._message(m)
      if role == "tool":
        if i == 0 or messages[i - 1].get("role") != "tool":
          add(self.headers["user"][:1] + self.tok.encode("user"))
        add(self.tok.encode(f"\n<tool_response>\n{content}\n</tool_response>"))
        if i == len(messages) - 1 or messages[i + 1].get("role") != "tool":
          add(close)
        continue
      if role != "assistant":
        add(self.headers[role] + self.tok.encode(content) + close)
        continue
      if self.think_ids:
        if thought is None and reasoning_lib.THINK_CLOSE in content:
          head, _, _ = content.partition(reasoning_lib.THINK_CLOSE)
          thought = head.rstrip("\n").split(reasoning_lib.THINK_OPEN)[-1].lstrip("\n")
          content = content.split(reasoning_lib.THINK_CLOSE)[-1].lstrip("\n")
        if i > last_query and (i == len(messages) - 1 or thought):
          thought, content = (thought or "").strip("\n"), content.lstrip("\n")
          content = (f"{reasoning_lib.THINK_OPEN}\n{thought}\n{reasoning_lib.THINK_CLOSE}"
                     f"\n\n{content}")
      add(self.headers["assistant"])
      add(self.tok.encode(content) + self.end_of_turn, 1 if m.get("weight", 1) else 0)
      add(self.after_end)
    return ids, mask

  def split_response(self, ids, prompt=None):
    if not self.think_ids:
      return super().split_response(ids)
    return reasoning_lib.split_think(self.tok, ids, open_id=self.think_ids[0],
                                     close_id=self.think_ids[1])


class DeepSeekR1Format(ChatFormat):
  """DeepSeek-R1's layout (its distills of Qwen and Llama), as its template renders text
  conversations: bos, the system message bare, "<｜User｜>" turns, "<｜Assistant｜>" turns
  ending in "<｜end▁of▁sentence｜>" with their reasoning cut (the text up to </think>), and
  a generation prompt that opens the reasoning, "<｜Assistant｜><think>\n": a completion
  without </think> is all reasoning. The last message of a training conversation keeps
  its reasoning ("reasoning_content") in the form the model writes it after that prompt
  (the template would cut it). Tool answers are written as the template writes them,
  inside "<｜tool▁outputs▁begin｜>" ... "<｜tool▁outputs▁end｜>", after which the model goes
  on without a generation prompt. The model always thinks: no reasoning switch.
  """

  reasoning = "think"
  opens_reasoning = True

  def __init__(self, tok, *, bos, eos, user, assistant, tool_marks, think):
    # tool_marks: the ids of <｜tool▁outputs▁begin｜>, <｜tool▁outputs▁end｜>,
    # <｜tool▁output▁begin｜>, <｜tool▁output▁end｜> (None where the vocabulary lacks them).
    self.marks = dict(user=user, assistant=assistant,
                      **dict(zip(("outputs", "outputs_end", "output", "output_end"),
                                 tool_marks)))
    headers = {"system": [], "user": [user], "assistant": [assistant], "tool": []}
    super().__init__(tok, headers, [eos], bos=[bos] if bos is not None else [],
                     generation_header=[assistant] + tok.encode(
                         f"{reasoning_lib.THINK_OPEN}\n"), name="DeepSeek-R1")
    self.think_ids = think

  def check_thinking(self, thinking) -> None:
    if thinking is not None and thinking is not True:
      raise ValueError(f"thinking must be None or True for DeepSeek-R1 models, which always "
                       f"think; got {thinking!r}")

  def encode(self, messages, add_generation_prompt=False, thinking=None, tools=None):
    self.check_tools(tools)
    self.check_thinking(thinking)
    systems = [m for m in messages if m.get("role") == "system"]
    ids, mask = list(self.bos), [0] * len(self.bos)
    if systems:  # the template writes the last system message, bare, after bos
      text = self._message(systems[-1])[1]
      ids += self.tok.encode(text)
      mask += [0] * (len(ids) - len(mask))
    body, own = self._render([m for m in messages if m.get("role") != "system"],
                             add_generation_prompt)
    ids, mask = ids + body, mask + own
    if add_generation_prompt and not (messages and messages[-1].get("role") == "tool"):
      ids += self.generation_header
      mask += [0] * len(self.generation_header)
    return ids, mask

  def continuation(self, messages, *, ended=True, thinking=None):
    self.check_thinking(thinking)
    ids = [] if ended else list(self.end_of_turn)
    ids += self._render(messages, True)[0]
    if not (messages and messages[-1].get("role") == "tool"):
      ids += self.generation_header
    return ids

  def _render(self, messages, add_generation_prompt):
    ids, mask = [], []

    def add(tokens, own=0):
      ids.extend(tokens)
      mask.extend([own] * len(tokens))

    m_ = self.marks
    in_tools, first_output = False, True
    for i, m in enumerate(messages):
      role, content, thought = self._message(m)
      if role == "system":
        raise ValueError("the DeepSeek-R1 format writes a system message only at the start")
      if role == "user":
        in_tools = False
        add([m_["user"]] + self.tok.encode(content))
      elif role == "tool":
        if None in (m_["outputs"], m_["outputs_end"], m_["output"], m_["output_end"]):
          raise ValueError("this DeepSeek-R1 vocabulary has no tool-output tokens")
        in_tools = True
        head = [m_["outputs"]] if first_output else self.tok.encode("\n")
        add(head + [m_["output"]] + self.tok.encode(content) + [m_["output_end"]])
        first_output = False
      else:
        own = 1 if m.get("weight", 1) else 0
        last = i == len(messages) - 1 and not add_generation_prompt
        if in_tools:
          add([m_["outputs_end"]])
          add(self.tok.encode(content) + self.end_of_turn, own)
          in_tools = False
          continue
        if last and thought is not None:
          add(self.generation_header)
          add(self.tok.encode(f"{thought}\n{reasoning_lib.THINK_CLOSE}\n\n{content}")
              + self.end_of_turn, own)
          continue
        if reasoning_lib.THINK_CLOSE in content:
          content = content.split(reasoning_lib.THINK_CLOSE)[-1]
        add([m_["assistant"]])
        add(self.tok.encode(content) + self.end_of_turn, own)
    if in_tools:
      add([m_["outputs_end"]])
    return ids, mask

  def split_response(self, ids, prompt=None):
    """Reasoning first where the prompt opened it: after the generation prompt (or no
    prompt given), not after tool answers, which the model answers directly."""
    header = self.generation_header
    opened = prompt is None or list(prompt[-len(header):]) == header
    open_id, close_id = self.think_ids or (None, None)
    return reasoning_lib.split_think(self.tok, ids, open_id=open_id, close_id=close_id,
                                     opened=opened)


class HarmonyFormat(ChatFormat):
  """gpt-oss's harmony, as its chat template renders conversations, tool calls included.

  The fixed system message (at the reasoning effort `thinking` names: low, medium or high;
  None or True: medium) opens every conversation; a leading system message becomes
  developer instructions, and function schemas (`tools`) follow them in the developer
  message as the template's TypeScript-like `namespace functions` (`harmony_functions`). An
  assistant message is a final-channel message: the last message of a training
  conversation (no generation prompt) ends with <|return|> and is preceded by its reasoning
  ("thinking" or "reasoning_content") as an analysis message; earlier ones end with <|end|>
  and lose their reasoning, as the template drops it. The model's own tokens are
  everything after "<|start|>assistant" (through a call's <|call|>) but an earlier turn's
  <|end|>, which the template writes in place of the <|return|> the model wrote. The
  generation prompt leaves the channel to the model; <|return|> and <|call|> stop a turn,
  <|end|> (which closes an analysis message) does not.

  Tool calls: an assistant message with (one) structured `tool_calls` is a message to the
  function, "<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>"
  + the arguments as JSON (the template's tojson: arguments given as text become a JSON
  string) + "<|call|>", preceded by the message's reasoning (or its content: not both) as
  an analysis message while no final answer follows it, as the template keeps it. A tool
  message answering a call is
  "<|start|>functions.NAME to=assistant<|channel|>commentary<|message|>" + its content as
  a JSON string + "<|end|>", NAME the last call's function or else the message's "name";
  one that answers no call (a text-protocol tool turn) keeps the header
  "functions to=assistant" and its content as it is (the template has no such message).
  """

  reasoning = "harmony"

  def __init__(self, tok, *, start, message, channel, end, ret, call):
    self.ids = dict(start=start, message=message, channel=channel, end=end, ret=ret,
                    call=call)
    assistant = [start] + tok.encode("assistant")
    headers = {
        "system": [start] + tok.encode("developer") + [message],
        "user": [start] + tok.encode("user") + [message],
        "assistant": assistant,
        "tool": [start] + tok.encode("functions to=assistant") + [channel]
        + tok.encode("commentary") + [message]}
    super().__init__(tok, headers, [end], ends={"assistant": [ret]},
                     generation_header=assistant, name="harmony")
    self._ends = [i for i in (end, ret, call) if i is not None]

  def check_thinking(self, thinking) -> None:
    if thinking is not None and thinking is not True and thinking not in HARMONY_EFFORTS:
      raise ValueError(f"thinking must be None, True or one of {HARMONY_EFFORTS} for harmony "
                       f"(gpt-oss always reasons), got {thinking!r}")

  def check_tools(self, tools) -> None:
    pass  # harmony renders them (`harmony_functions` checks each schema)

  def write_tool_call(self, name, arguments):
    raise ValueError("harmony writes a tool call as a message of its own, not as text: give "
                     "the assistant message structured 'tool_calls'")

  def fold_tool_calls(self, messages):
    """Harmony's calls stay structured (`_render` writes them): each is checked here."""
    out = []
    for i, m in enumerate(messages):
      if isinstance(m, dict) and "tool_calls" in m:
        if m["tool_calls"] is None:
          m = {k: v for k, v in m.items() if k != "tool_calls"}
        else:
          self._call(m, f"message {i}")
          if m.get("content") is None:
            m = dict(m, content="")
      out.append(m)
    return out

  def _call(self, m: Message, where: str) -> tuple[str, dict | str, str]:
    """(name, arguments, content type) of a message's one structured call."""
    if m.get("role") != "assistant":
      raise ValueError(f"{where}: only an assistant message has tool_calls, not a "
                       f"{m.get('role')!r} message")
    calls = _structured_calls(m["tool_calls"], where)
    if len(calls) != 1:
      raise ValueError(f"{where}: harmony's template renders one tool call per assistant "
                       f"message, got {len(calls)}; give each call a message of its own")
    (name, arguments), = calls
    call = m["tool_calls"][0]
    function = call.get("function") or call
    content_type = function.get("content_type", "json")
    if not isinstance(content_type, str) or not content_type:
      raise ValueError(f"{where}: tool_calls[0] content_type must be a string, got "
                       f"{content_type!r}")
    return name, arguments, content_type

  def opening(self, thinking=None, tools: bool = False):
    effort = thinking if isinstance(thinking, str) else "medium"
    ids = ([self.ids["start"]] + self.tok.encode("system") + [self.ids["message"]]
           + self.tok.encode(harmony_system(effort, tools)) + [self.ids["end"]])
    return ids, [0] * len(ids)

  def encode(self, messages, add_generation_prompt=False, thinking=None, tools=None):
    self.check_thinking(thinking)
    schemas = harmony_functions(tools) if tools else ""
    ids, mask = self.opening(thinking, tools=bool(tools))
    messages = list(messages)
    instructions = ""
    if messages and messages[0].get("role") == "system":
      instructions, messages = self._message(messages[0])[1], messages[1:]
    if instructions or tools:  # the developer message
      text = ((f"# Instructions\n\n{instructions}\n\n" if instructions else "")
              + (f"# Tools\n\n{schemas}" if tools else ""))
      developer = self.headers["system"] + self.tok.encode(text) + [self.ids["end"]]
      ids, mask = ids + developer, mask + [0] * len(developer)
    return self._conversation(ids, mask, messages, add_generation_prompt, thinking)

  def _render(self, messages, add_generation_prompt):
    ids, mask = [], []

    def add(tokens, own=0):
      ids.extend(tokens)
      mask.extend([own] * len(tokens))

    channel, message, end = self.ids["channel"], self.ids["message"], self.ids["end"]
    analysis = [channel] + self.tok.encode("analysis") + [message]
    called = None  # the function of the last call, which a tool message answers
    for i, m in enumerate(messages):
      role, content, thought = self._message(m)
      if role == "system":
        add(self.headers["system"] + self.tok.encode(f"# Instructions\n\n{content}\n\n")
            + [end])
      elif role == "tool":
        name = called or m.get("name")
        if name is None:
          add(self.headers["tool"] + self.tok.encode(content) + [end])
          continue
        if not isinstance(name, str) or not name:
          raise ValueError(f"message {i}: a tool message's name must be a function name, "
                           f"got {name!r}")
        add([self.ids["start"]] + self.tok.encode(f"functions.{name} to=assistant")
            + [channel] + self.tok.encode("commentary") + [message]
            + self.tok.encode(_tojson(content)) + [end])
      elif role != "assistant":
        add(self.headers[role] + self.tok.encode(content) + [end])
      else:
        if any(tag in text for text in (content, thought or "")
               for tag in ("<|channel|>analysis<|message|>", "<|channel|>final<|message|>")):
          raise ValueError("an assistant message holds harmony channel tags: pass the "
                           "analysis in 'thinking' and the final message in 'content'")
        own = 1 if m.get("weight", 1) else 0
        last = i == len(messages) - 1 and not add_generation_prompt
        add(self.headers["assistant"])
        if m.get("tool_calls") is not None:
          name, arguments, content_type = self._call(m, f"message {i}")
          if content and thought:
            raise ValueError(f"message {i}: harmony's template writes a tool-calling "
                             "message's analysis from its content or its reasoning, not both")
          if self.ids["call"] is None:
            raise ValueError("this harmony vocabulary has no <|call|> token")
          answered = any(later.get("role") == "assistant" and later.get("tool_calls") is None
                         for later in messages[i + 1:])
          if (content or thought) and not answered:  # kept while no final answer follows
            add(analysis + self.tok.encode(content or thought) + [end]
                + self.headers["assistant"], own)
          add(self.tok.encode(f" to=functions.{name}") + [channel]
              + self.tok.encode(f"commentary {content_type}") + [message]
              + self.tok.encode(_tojson(arguments)) + [self.ids["call"]], own)
          called = name
          continue
        if last and thought is not None:
          add(analysis + self.tok.encode(thought) + [end] + self.headers["assistant"], own)
        add([channel] + self.tok.encode("final") + [message] + self.tok.encode(content), own)
        if last:
          add([self.ids["ret"]], own)
        else:
          add([end])  # the template's, in place of the <|return|> the model wrote
          called = None
    return ids, mask

  def split_response(self, ids, prompt=None):
    return reasoning_lib.split_harmony(self.tok, ids, start=self.ids["start"],
                                       channel=self.ids["channel"],
                                       message=self.ids["message"], ends=self._ends)


def _tojson(value: Any) -> str:
  """JSON as chat templates' `tojson` writes it (transformers': ", " and ": ", unicode)."""
  return json.dumps(value, ensure_ascii=False)


def harmony_functions(tools: Sequence[dict]) -> str:
  """Function schemas as gpt-oss's template declares them in the developer message (its
  `render_tool_namespace("functions", tools)`): a TypeScript-like namespace, one
  `type NAME = (_: {...}) => any;` per function, each parameter after its description,
  "?" when it is optional, and its default. Schemas are OpenAI's, {"type": "function",
  "function": {"name", "description", "parameters"}} (or the inner object)."""
  if not isinstance(tools, (list, tuple)):
    raise ValueError(f"tools must be a list of function schemas, got {type(tools).__name__}")
  out = ["## functions\n\nnamespace functions {\n\n"]
  for i, tool in enumerate(tools):
    function = tool.get("function", tool) if isinstance(tool, dict) else None
    if not isinstance(function, dict):
      raise ValueError(f"tools[{i}] must be a function schema (an object), got {tool!r:.80}")
    name, description = function.get("name"), function.get("description")
    if not isinstance(name, str) or not name:
      raise ValueError(f"tools[{i}] needs a function name")
    if not isinstance(description, str):
      raise ValueError(f"tools[{i}] ({name}) needs a description: harmony's template writes "
                       "one for every function")
    out.append(f"// {description}\ntype {name} = ")
    parameters = function.get("parameters")
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    if not properties:
      out.append("() => any;\n\n")
      continue
    if not isinstance(properties, dict):
      raise ValueError(f"tools[{i}] ({name}): parameters.properties must be an object")
    required = parameters.get("required") or []
    out.append("(_: {\n")
    for param, spec in properties.items():
      get = _getter(spec)
      if get("description"):
        out.append(f"// {get('description')}\n")
      out.append(f"{param}{'' if param in required else '?'}: {_typescript_type(spec)}")
      if isinstance(spec, dict) and "default" in spec:
        default = spec["default"]
        if get("enum") or get("oneOf"):  # the template adds these defaults as they are
          if not isinstance(default, str):
            raise ValueError(f"tools[{i}] ({name}) parameter {param}: harmony's template "
                             f"writes this default as text, got {default!r}")
          out.append((", // default: " if get("enum") else "// default: ") + default)
        else:
          out.append(f", // default: {_tojson(default)}")
      out.append(",\n")
    out.append("}) => any;\n\n")
  out.append("} // namespace functions")
  return "".join(out)


def _getter(spec: Any):
  """A schema's fields, missing ones None (the template reads a non-object as all missing)."""
  return spec.get if isinstance(spec, dict) else (lambda key, default=None: default)


def _typescript_type(spec: Any) -> str:
  """A JSON schema's type as gpt-oss's template writes it (its `render_typescript_type`),
  whitespace included: a nested object's fields are each "\n" + 16 spaces after their
  colon, a oneOf's variants are joined by " | \n", as the template's own layout leaves
  them."""
  get = _getter(spec)
  kind = get("type")
  if kind == "array":
    items = get("items")
    if not items:
      text = "any[]"
    elif _getter(items)("type") in _ARRAYS:
      text = _ARRAYS[_getter(items)("type")]
    else:
      inner = _typescript_type(items)
      text = "any[]" if inner == "object | object" or len(inner) > 50 else inner + "[]"
    return text + (" | null" if get("nullable") else "")
  if isinstance(kind, list) and kind:  # a union of types, ["string", "null"]
    return " | ".join(str(k) for k in kind)
  variants = get("oneOf")
  if variants:
    # The template means to write "any" for a union with objects in it, but its flag, set
    # inside a loop, never leaves the loop (Jinja's scoping): every variant is written.
    parts = []
    for v in variants:
      part = _typescript_type(v)
      if _getter(v)("description"):
        part += f"// {_getter(v)('description')}"
      if isinstance(v, dict) and "default" in v:
        part += " " * 20 + f"// default: {_tojson(v['default'])}"
      parts.append(part)
    return " | \n".join(parts)
  if kind == "string":
    if get("enum"):
      return '"' + '" | "'.join(str(e) for e in get("enum")) + '"'
    return "string" + (" | null" if get("nullable") else "")
  if kind in ("number", "integer", "boolean"):
    return "boolean" if kind == "boolean" else "number"
  if kind == "object":
    properties = get("properties")
    if not properties:
      return "object"
    required = get("required") or []
    return "{\n" + ", ".join(
        f"{name}{'' if name in required else '?'}: \n{' ' * 16}{_typescript_type(p)}"
        for name, p in properties.items()) + "}"
  return "any"


_ARRAYS = {"string": "string[]", "number": "number[]", "integer": "number[]",
           "boolean": "boolean[]"}


class Tokenizer:
  """Interface: encode/decode text, special ids, and the chat format."""

  vocab_size: int
  pad_id: int
  eos_id: int
  chat: ChatFormat

  def encode(self, text: str) -> list[int]:
    raise NotImplementedError

  def decode(self, ids: Sequence[int]) -> str:
    raise NotImplementedError

  def encode_chat(self, messages: Sequence[Message], add_generation_prompt: bool = False,
                  thinking: bool | str | None = None, tools: Sequence[dict] | None = None
                  ) -> tuple[list[int], list[int]]:
    """Token ids and the model-token mask of a conversation. `thinking`: the reasoning
    switch of formats that have one (Qwen3's ChatML: True / False; harmony: an effort,
    low / medium / high); None, the template's default. `tools`: function schemas for a
    model that calls tools in its own format (ChatML, Llama 3.1+, harmony). Assistant
    messages may carry structured `tool_calls` (`ChatFormat.fold_tool_calls`)."""
    if any(isinstance(m, dict) and "tool_calls" in m for m in messages):
      messages = self.chat.fold_tool_calls(messages)
    if tools:
      return self.chat.encode(messages, add_generation_prompt, thinking, tools)
    return self.chat.encode(messages, add_generation_prompt, thinking)

  def split_response(self, ids: Sequence[int], prompt: Sequence[int] | None = None
                     ) -> reasoning_lib.Response:
    """A completion's content and reasoning, as this tokenizer's chat format writes them
    (`prompt`: the tokens before it, which some formats read)."""
    return self.chat.split_response(ids, prompt)

  @property
  def fingerprint(self) -> str | None:
    """A string that changes whenever this tokenizer's ids for some text could change; it
    keys the tokenized-data cache (`posttrain.data.sft`). None: unknown, data it tokenizes
    is not cached."""
    return None

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """Tokens that end an assistant turn: the format's end of turn, eos, and those the
    model's generation config stops at."""
    end = self.chat.ends.get("assistant", self.chat.end_of_turn)
    return tuple(sorted(set(end[-1:] + [self.eos_id]
                            + list(getattr(self, "extra_stop_ids", ())))))

  def save(self, directory: str) -> list[str]:
    """Writes the files `load_tokenizer(directory)` reads back, into a model folder being
    exported; returns their paths. A built-in tokenizer has none: load it by name."""
    del directory
    return []


class ByteTokenizer(Tokenizer):
  """UTF-8 bytes plus 16 special tokens; vocab_size 272."""

  SPECIALS = ("<pad>", "<eos>", "<bos>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>",
              "<|end|>") + tuple(f"<|reserved_{i}|>" for i in range(8))

  def __init__(self):
    self.special_ids = {s: 256 + i for i, s in enumerate(self.SPECIALS)}
    self.vocab_size = 256 + len(self.SPECIALS)
    self.pad_id = self.special_ids["<pad>"]
    self.eos_id = self.special_ids["<eos>"]
    self.bos_id = self.special_ids["<bos>"]
    headers = {r: [self.special_ids[f"<|{r}|>"]] for r in ROLES}
    self.chat = ChatFormat(self, headers, [self.special_ids["<|end|>"]])

  @property
  def fingerprint(self) -> str:
    # The class name: a subclass may encode differently.
    return f"{type(self).__name__}:{','.join(self.SPECIALS)}"

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))

  def decode(self, ids: Sequence[int]) -> str:
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


# Besides tokenizer.json, the files of a Hugging Face tokenizer folder that an exported
# model folder gets a copy of (chat template, special tokens).
_HF_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


class HFTokenizer(Tokenizer):
  """A `tokenizer.json` (Hugging Face `tokenizers`) with the Llama 3, ChatML, Phi, Phi-4,
  Gemma or harmony (gpt-oss) format, or with `chat_format="template"` (and for any other
  tokenizer that has a chat template) its own template (`posttrain.data.templates`)."""

  def __init__(self, path: str, chat_format: str = "auto"):
    if chat_format not in ("auto", "template"):
      raise ValueError(f"chat_format={chat_format!r}; expected auto or template")
    from tokenizers import Tokenizer as _HFTok  # Optional extra: posttrain[hf].
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.exists(file):
      raise FileNotFoundError(f"tokenizer file {file} does not exist")
    self._tok = _HFTok.from_file(file)
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    cfg_file = os.path.join(os.path.dirname(file), "tokenizer_config.json")
    cfg = json.load(open(cfg_file)) if os.path.exists(cfg_file) else {}
    # What an exported model folder gets a copy of (`save`).
    self._files = [file] + [os.path.join(os.path.dirname(file), name) for name in _HF_FILES
                            if os.path.exists(os.path.join(os.path.dirname(file), name))]
    vocab = self._tok.get_vocab(with_added_tokens=True)

    def tid(s):
      return vocab.get(s)

    self._forced_template = chat_format == "template"
    if self._forced_template:
      self._template_format(file, cfg)
    elif tid("<｜User｜>") is not None and tid("<｜Assistant｜>") is not None:  # DeepSeek-R1
      think = (tid(reasoning_lib.THINK_OPEN), tid(reasoning_lib.THINK_CLOSE))
      self.chat = DeepSeekR1Format(
          self, bos=tid("<｜begin▁of▁sentence｜>"), eos=tid("<｜end▁of▁sentence｜>"),
          user=tid("<｜User｜>"), assistant=tid("<｜Assistant｜>"),
          tool_marks=tuple(tid(t) for t in ("<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
                                             "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>")),
          think=think if None not in think else None)
      self.eos_id = tid("<｜end▁of▁sentence｜>")
    elif tid("[INST]") is not None and tid("[/INST]") is not None:  # Mistral
      self.chat = MistralFormat(self, bos=tid("<s>"), eos=tid("</s>"), inst=tid("[INST]"),
                                inst_end=tid("[/INST]"))
      self.eos_id = tid("</s>")
    elif None not in (tid("<|user|>"), tid("<|assistant|>"), tid("<|end|>")):
      # Phi-3 / 3.5 / Phi-4-mini: "<|role|>" + content + "<|end|>", a newline after each
      # in Phi-3 and 3.5's templates, none in Phi-4-mini's; a conversation without a
      # generation prompt closes with the eos token.
      template = _chat_template(file, cfg)
      newline = self.encode("\n") if ("<|assistant|>\n'" in template
                                       or "<|assistant|>\\n'" in template) else []
      end, eos = tid("<|end|>"), tid(config_token(cfg, "eos_token") or "<|endoftext|>")
      headers = {r: [tid(f"<|{r}|>")] + newline for r in ROLES}
      for r in ("system", "tool"):
        # Phi-3's templates have no tool turns (nor, without <|system|>, system ones):
        # they are user turns. Phi-4-mini's render any role as "<|role|>".
        if headers[r][0] is None or (newline and r == "tool"):
          headers[r] = headers["user"]
      self.chat = ChatFormat(self, headers, [end], after_end=newline, name="Phi",
                             closing=[eos] if eos is not None else [])
      self.eos_id = end
      self.extra_stop_ids = [eos] if eos is not None else []
    elif tid("<|start_header_id|>") is not None:  # Llama 3.
      start, end = tid("<|start_header_id|>"), tid("<|end_header_id|>")
      headers = {r: [start] + self.encode(r) + [end] + self.encode("\n\n") for r in ROLES}
      headers["tool"] = [start] + self.encode("ipython") + [end] + self.encode("\n\n")
      eot = tid("<|eot_id|>")
      bos = [tid("<|begin_of_text|>")] if tid("<|begin_of_text|>") is not None else []
      template = _chat_template(file, cfg)
      self.chat = Llama3Format(self, headers, [eot], bos=bos,
                               dated="Cutting Knowledge Date" in template,
                               json_tools="tojson" in template)
      self.eos_id = eot
    elif tid("<|im_start|>") is not None and tid("<|im_sep|>") is not None:
      # Phi-4: ChatML whose role and content <|im_sep|> separates, with no newlines; no
      # tool turns (tool messages are user turns).
      start, end, sep = tid("<|im_start|>"), tid("<|im_end|>"), tid("<|im_sep|>")
      headers = {r: [start] + self.encode(r) + [sep] for r in ("system", "user", "assistant")}
      headers["tool"] = headers["user"]
      self.chat = ChatFormat(self, headers, [end], name="Phi-4")
      self.eos_id = end
      self.extra_stop_ids = [tid("<|endoftext|>")] if tid("<|endoftext|>") is not None else []
    elif tid("<|im_start|>") is not None:  # ChatML: Qwen.
      template = _chat_template(file, cfg)
      if "<function=" in template and "<parameter=" in template:
        # Qwen3.5, Qwen3-Coder: tool calls in an XML syntax that ChatMLFormat (Qwen3's
        # JSON calls and tools prompt) does not write; their own template does.
        self._template_format(file, cfg)
      else:
        start, end = tid("<|im_start|>"), tid("<|im_end|>")
        headers = {r: [start] + self.encode(r + "\n") for r in ROLES}
        think = (tid(reasoning_lib.THINK_OPEN), tid(reasoning_lib.THINK_CLOSE))
        self.chat = ChatMLFormat(self, headers, [end], after_end=self.encode("\n"),
                                 think=think if None not in think else None,
                                 default_system=_default_system(template))
        self.eos_id, self.extra_stop_ids = end, []
      # Qwen's generation configs stop at <|endoftext|> too (a base model ends with it).
      if tid("<|endoftext|>") not in (None, self.eos_id, *self.extra_stop_ids):
        self.extra_stop_ids.append(tid("<|endoftext|>"))
    elif tid("<start_of_turn>") is not None:  # Gemma: the assistant is "model"; no system
      start, end = tid("<start_of_turn>"), tid("<end_of_turn>")  # or tool turns of its own.
      headers = {r: [start] + self.encode(r + "\n") for r in ("user", "system")}
      headers["assistant"] = [start] + self.encode("model\n")
      headers["tool"] = headers["user"]
      bos = [tid("<bos>")] if tid("<bos>") is not None else []
      self.chat = ChatFormat(self, headers, [end], after_end=self.encode("\n"), bos=bos,
                             fold_system=True, strip=True, name="Gemma")
      self.eos_id = end
      # Gemma's generation config stops at <eos> too.
      self.extra_stop_ids = [tid("<eos>")] if tid("<eos>") is not None else []
    elif tid("<|channel|>") is not None and tid("<|start|>") is not None:  # harmony
      self.chat = HarmonyFormat(self, start=tid("<|start|>"), message=tid("<|message|>"),
                                channel=tid("<|channel|>"), end=tid("<|end|>"),
                                ret=tid("<|return|>"), call=tid("<|call|>"))
      self.eos_id = tid("<|return|>")
      self.extra_stop_ids = [tid("<|call|>")] if tid("<|call|>") is not None else []
    elif _chat_template(file, cfg):  # any other family: its own template
      self._template_format(file, cfg)
    else:
      raise ValueError(f"{file}: no DeepSeek-R1, Mistral, Phi, Llama 3, ChatML, Gemma or "
                       "harmony special tokens and no chat template; cannot build a chat "
                       "format")
    pad = config_token(cfg, "pad_token")
    self.pad_id = tid(pad) if pad and tid(pad) is not None else self.eos_id
    # The model folder's generation_config.json names the tokens generation stops at (Llama
    # 3.1: <|eot_id|>, <|eom_id|>, <|end_of_text|>): they stop a rollout's turn too.
    gen_file = os.path.join(os.path.dirname(file), "generation_config.json")
    if os.path.exists(gen_file):
      with open(gen_file, encoding="utf-8") as f:
        eos = json.load(f).get("eos_token_id")
      eos = eos if isinstance(eos, list) else [eos]
      self.extra_stop_ids = list(getattr(self, "extra_stop_ids", [])) + [
          int(i) for i in eos if isinstance(i, int) and not isinstance(i, bool)
          and 0 <= i < self.vocab_size]

  def _template_format(self, file: str, cfg: dict) -> None:
    from posttrain.data.templates import TemplateFormat
    self.chat = TemplateFormat(self, _chat_template(file, cfg), cfg)
    if not self.chat.end_of_turn:
      raise ValueError(f"{file}: the chat template writes no special token after an "
                       "assistant turn and the tokenizer names no eos_token; cannot tell "
                       "where the model's turn ends")
    self.eos_id = self.chat.end_of_turn[0]
    eos = config_token(cfg, "eos_token")
    eos = None if eos is None else self._tok.token_to_id(eos)
    self.extra_stop_ids = [eos] if eos is not None and eos != self.eos_id else []

  @functools.cached_property
  def fingerprint(self) -> str:
    """sha256 of the tokenizer files' names and bytes (read once), and of a forced
    template chat format."""
    digest = hashlib.sha256(type(self).__name__.encode())
    if self._forced_template:
      digest.update(b"chat_format=template\0")
    for file in self._files:
      digest.update(os.path.basename(file).encode() + b"\0")
      with open(file, "rb") as f:
        digest.update(hashlib.sha256(f.read()).digest())
    return digest.hexdigest()

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Sequence[int]) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

  def save(self, directory: str) -> list[str]:
    os.makedirs(directory, exist_ok=True)
    written = []
    for index, src in enumerate(self._files):
      dst = os.path.join(directory, "tokenizer.json" if index == 0 else os.path.basename(src))
      if os.path.abspath(src) != os.path.abspath(dst):
        shutil.copyfile(src, dst)
      written.append(dst)
    return written


def config_token(cfg: dict, key: str) -> str | None:
  """A special token tokenizer_config.json names (a string, or {"content": ...})."""
  value = cfg.get(key)
  value = value.get("content") if isinstance(value, dict) else value
  return value if isinstance(value, str) and value else None


def _chat_template(file: str, cfg: dict) -> str:
  """The tokenizer's Jinja chat template ("" when it has none): chat_template.jinja beside
  tokenizer.json, else tokenizer_config.json's chat_template (the default of a list)."""
  jinja = os.path.join(os.path.dirname(file), "chat_template.jinja")
  if os.path.exists(jinja):
    with open(jinja, encoding="utf-8") as f:
      return f.read()
  template = cfg.get("chat_template") or ""
  if isinstance(template, list):
    named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    template = named.get("default") or ""
  return template if isinstance(template, str) else ""


# A ChatML template's default system turn: a whole literal '<|im_start|>system\n...' turn.
_DEFAULT_SYSTEM = re.compile(r"\{\{-?\s*'<\|im_start\|>system\\n"
                             r"([^'+{}]*)<\|im_end\|>\\n'\s*-?\}\}")


def _default_system(template: str) -> str | None:
  """The system message a ChatML template writes when a conversation has none, or None."""
  found = _DEFAULT_SYSTEM.search(template)
  if not found:
    return None
  return found.group(1).replace("\\n", "\n").replace("\\'", "'")


class _Thinking(Tokenizer):
  """A tokenizer whose conversations take a reasoning switch unless told otherwise."""

  def __init__(self, tok: Tokenizer, thinking: bool | str):
    tok.chat.check_thinking(thinking)
    self._inner, self._thinking = tok, thinking

  def __getattr__(self, name):
    return getattr(self._inner, name)

  def encode(self, text: str) -> list[int]:
    return self._inner.encode(text)

  def decode(self, ids: Sequence[int]) -> str:
    return self._inner.decode(ids)

  def encode_chat(self, messages, add_generation_prompt=False, thinking=None, tools=None):
    return self._inner.encode_chat(messages, add_generation_prompt,
                                   self._thinking if thinking is None else thinking, tools)

  @property
  def fingerprint(self) -> str | None:
    inner = self._inner.fingerprint
    return None if inner is None else f"{inner}|thinking={self._thinking!r}"

  @property
  def stop_ids(self) -> tuple[int, ...]:
    return self._inner.stop_ids

  def save(self, directory: str) -> list[str]:
    return self._inner.save(directory)


def with_thinking(tok: Tokenizer, thinking: bool | str | None) -> Tokenizer:
  """`tok`, its conversations under the reasoning switch `thinking` (harmony's effort in
  the system message, say) where no call says otherwise; `tok` itself for None. Its
  fingerprint (the tokenized-data cache's key) tells the switch apart."""
  return tok if thinking is None else _Thinking(tok, thinking)


def load_tokenizer(spec: str) -> Tokenizer:
  """'byte' for the built-in tokenizer, else a folder or tokenizer.json path; prefixed
  'template:' the tokenizer's own chat template renders its conversations whatever its
  special tokens (`posttrain.data.templates`)."""
  if spec in ("byte", "", None):
    return ByteTokenizer()
  if str(spec).startswith(TEMPLATE_PREFIX):
    return HFTokenizer(str(spec)[len(TEMPLATE_PREFIX):], chat_format="template")
  return HFTokenizer(spec)
