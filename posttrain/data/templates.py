r"""Chat formats rendered by the model's own Jinja chat template.

The hand-written formats in `posttrain.data.tokenizer` (Llama 3, ChatML, DeepSeek-R1,
Mistral, Gemma, Phi, harmony) know their families' reasoning, tool calls and stop tokens.
Any other tokenizer that ships a chat template (OLMo 2's Tülu turns, OLMo 3's ChatML with
its default system message, SmolLM3, Granite, ...) gets `TemplateFormat`, which renders
conversations with that template exactly as `transformers`' apply_chat_template does (a
sandboxed Jinja environment with its filters and globals), and `load_tokenizer
("template:PATH")` forces it on a tokenizer that a hand-written format would take.

The loss mask is read off the rendering: assistant message i spans from the end of the
conversation before it with a generation prompt (what the model saw when it began
writing; where the prompt also opens a <think> block the finished turn does not show,
from the end of the last of the prompt's tokens they share) to the end of its content
(of its tool calls, where it has them: the token that closes the turn), plus the
end-of-turn token written right after it; tokens are assigned by their character
offsets in the one tokenization of the whole text, so the ids are the template's to the
token. A template that renders an earlier
message differently once later ones follow (so that the conversation up to message i
is no prefix of the whole) raises a ValueError naming the message.

The end of a turn is the special token the template writes right after an assistant
message's content (found by rendering a probe conversation), else the tokenizer's eos;
either one right after an assistant's content is the model's own.
A vocabulary with <think> and </think>, or a template that writes them, has reasoning:
completions are split at </think> (`reasoning.split_think`; a generation prompt that ends
in <think>, as OLMo 3 Think's, opens the block), and an SFT message's reasoning_content
goes to the template as it is. A vocabulary with Gemma 4's <|channel> and <channel|> has
its thought channel instead (`reasoning.split_channel`: "<|channel>thought\n...<channel|>"
is the reasoning). `thinking` True / False is the template's
enable_thinking (Qwen3's and SmolLM3's switch).

Tool schemas in data are passed to the template, and an assistant message's structured
tool_calls are the template's to render. The calls a model writes are read back (so
rollout.tool_format=native works) in the syntax the template renders a probe call in:
  * XML (Qwen3.5, Qwen3-Coder): "<function=NAME>" then "<parameter=K>\nV\n</parameter>"
    for each argument, then "</function>", inside a wrapper tag ("<tool_call>" ...
    "</tool_call>") where the template writes one. A value loses exactly the text the
    template puts on each side of it (one newline); one that parses as a JSON object or
    array is that object, anything else (numbers included: the template writes them as
    text) a string. A "<function=" with no "</function>" before the next "<function="
    or the end of the text is no call; a closed block that does not parse (a name that
    is empty or spans lines, text between the parameters, a parameter without its
    "</parameter>" or named twice) is a call with no name and no arguments, as ChatML's
    unparseable JSON is.
  * JSON in a wrapper tag (Qwen3, SmolLM3, Hermes): {"name": ..., "arguments": ...} between
    "<tool_call>" and "</tool_call>" (the tag and the arguments' key as the template
    writes them), read as the ChatML format reads them.
  * Gemma 4's: "<|tool_call>call:NAME{key:value,...}<tool_call|>", the values JSON's but
    for strings between <|"|> marks and bare keys (transformers' response schema for
    Gemma 4); a block that does not read so is a call with no name and no arguments.
A template that renders calls in any other way (or not at all) refuses tools in
`check_tools`: such a model is given tools in the text protocol.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import json
import re
from datetime import datetime
from typing import Any, Sequence

from posttrain.data import reasoning as reasoning_lib
from posttrain.data.tokenizer import ROLES, ChatFormat, config_token, read_wrapped_json_calls

_PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
# The structured call rendered to find the template's tool-call syntax.
_PROBE_CALL = ("probe_fn", {"probe_arg": "probe value"})
_FUNCTION, _FUNCTION_END = "<function=", "</function>"
_PARAMETER, _PARAMETER_END = "<parameter=", "</parameter>"
# Gemma 4's calls: <|tool_call>call:NAME{key:value,...}<tool_call|>, its strings between
# <|"|> marks and its keys bare (transformers' response schema for gemma4).
_CALL_OPEN, _CALL_CLOSE, _CALL_PREFIX, _QUOTE = "<|tool_call>", "<tool_call|>", "call:", '<|"|>'
_BARE = re.compile(r"[A-Za-z_][\w.-]*")
_TAG = re.compile(r"<([A-Za-z_][\w.-]*)>")
_TAG_BEFORE = re.compile(r"<([A-Za-z_][\w.-]*)>\s*$")


@dataclasses.dataclass(frozen=True)
class CallSyntax:
  """How a template writes a tool call (see the module docstring).

  kind: "xml" (<function=NAME> with <parameter=K> blocks), "json" (an object in a
  wrapper) or "gemma" (Gemma 4's call:NAME{...} with bare keys and <|"|> strings). wrapper: the (opening, closing) tags around a call, None for XML calls
  written bare. pad: what the template writes before and after an XML parameter's value.
  arguments_key: the JSON object's key for the arguments.
  """

  kind: str
  wrapper: tuple[str, str] | None
  pad: tuple[str, str] = ("", "")
  arguments_key: str = "arguments"


def _call_message(name: str, arguments: Any) -> dict:
  return {"role": "assistant", "content": "", "tool_calls": [
      {"type": "function", "function": {"name": name, "arguments": arguments}}]}


def call_syntax(rendered: str) -> CallSyntax | None:
  """The syntax of the probe call (`_PROBE_CALL`) in `rendered`, an assistant message's
  rendering; None where it is neither XML nor JSON in a wrapper tag."""
  name, arguments = _PROBE_CALL
  [(key, value)] = arguments.items()
  gemma = rendered.find(f"{_CALL_OPEN}{_CALL_PREFIX}{name}")
  if gemma >= 0 and rendered.find(_CALL_CLOSE, gemma) >= 0:
    [(_, _, got_name, got)] = read_gemma_calls(rendered[gemma:])
    if (got_name, got) == (name, arguments):
      return CallSyntax("gemma", (_CALL_OPEN, _CALL_CLOSE))
  start = rendered.find(f"{_FUNCTION}{name}>")
  param = rendered.find(f"{_PARAMETER}{key}>", start) if start >= 0 else -1
  if param >= 0:
    at = rendered.find(value, param)
    close = rendered.find(_PARAMETER_END, at) if at >= 0 else -1
    end = rendered.find(_FUNCTION_END, close) if close >= 0 else -1
    pad = (rendered[param + len(f"{_PARAMETER}{key}>"):at], rendered[at + len(value):close])
    if end < 0 or pad[0].strip() or pad[1].strip():
      return None
    wrapper = None
    before = _TAG_BEFORE.search(rendered, 0, start)
    if before:
      closer = f"</{before.group(1)}>"
      if rendered[end + len(_FUNCTION_END):].lstrip().startswith(closer):
        wrapper = (before.group(0).rstrip(), closer)
    return CallSyntax("xml", wrapper, pad)
  for tag in _TAG.finditer(rendered):
    closer = f"</{tag.group(1)}>"
    end = rendered.find(closer, tag.end())
    try:
      call = json.loads(rendered[tag.end():end]) if end >= 0 else None
    except ValueError:
      continue
    if isinstance(call, dict) and call.get("name") == name:
      keys = [k for k, v in call.items() if v == arguments]
      if keys:
        return CallSyntax("json", (tag.group(0), closer), arguments_key=keys[0])
  return None


def _xml_value(raw: str, pad: tuple[str, str]) -> Any:
  """A parameter's value: `raw` less the template's padding, a JSON object or array
  parsed, anything else as it is."""
  raw = raw.removeprefix(pad[0])
  if pad[1] and raw.endswith(pad[1]):
    raw = raw[:-len(pad[1])]
  if raw[:1] in ("{", "["):
    try:
      value = json.loads(raw)
    except ValueError:
      return raw
    if isinstance(value, (dict, list)):
      return value
  return raw


def _xml_call(body: str, pad: tuple[str, str]) -> tuple[str | None, dict | None]:
  """(name, arguments) of a call block's body ("NAME>" and its parameters); (None, None)
  where it does not parse."""
  name, sep, rest = body.partition(">")
  if not sep or not name or name != name.strip() or "\n" in name:
    return None, None
  arguments = {}
  while rest.strip():
    rest = rest.lstrip()
    if not rest.startswith(_PARAMETER):
      return None, None  # text between the parameters
    key, sep, rest = rest[len(_PARAMETER):].partition(">")
    close = rest.find(_PARAMETER_END)
    if (not sep or not key or "\n" in key or key in arguments or close < 0
        or _PARAMETER in rest[:close]):  # no </parameter> before the next parameter
      return None, None
    arguments[key] = _xml_value(rest[:close], pad)
    rest = rest[close + len(_PARAMETER_END):]
  return name, arguments


def read_xml_calls(text: str, syntax: CallSyntax) -> list[tuple[int, int, Any, Any]]:
  """(start, end, name, arguments) of the XML calls in `text` (the module docstring's
  rules); a span holds the call's wrapper where the template writes one and the text
  has both its tags around the call."""
  calls, pos = [], 0
  while True:
    start = text.find(_FUNCTION, pos)
    end = text.find(_FUNCTION_END, start) if start >= 0 else -1
    if end < 0:
      return calls
    inner = text.find(_FUNCTION, start + len(_FUNCTION), end)
    if inner >= 0:  # a block opened before this one closed: this one is not a call
      pos = inner
      continue
    name, arguments = _xml_call(text[start + len(_FUNCTION):end], syntax.pad)
    end += len(_FUNCTION_END)
    if syntax.wrapper:
      opener, closer = syntax.wrapper
      lead, trail = text.rfind(opener, pos, start), text.find(closer, end)
      if (lead >= 0 and not text[lead + len(opener):start].strip() and trail >= 0
          and not text[end:trail].strip()):
        start, end = lead, trail + len(closer)
    calls.append((start, end, name, arguments))
    pos = end


def read_gemma_calls(text: str) -> list[tuple[int, int, Any, Any]]:
  """(start, end, name, arguments) of Gemma 4's calls in `text`:
  <|tool_call>call:NAME{key:value,...}<tool_call|>, values as JSON's but for strings
  between <|"|> marks and bare keys. A block that does not read so is a call with no name
  and no arguments; one never closed is none."""
  calls, pos = [], 0
  while True:
    start = text.find(_CALL_OPEN, pos)
    end = text.find(_CALL_CLOSE, start + len(_CALL_OPEN)) if start >= 0 else -1
    if end < 0:
      return calls
    body, pos = text[start + len(_CALL_OPEN):end], end + len(_CALL_CLOSE)
    name, arguments = None, None
    match = re.fullmatch(r"call:([A-Za-z_][\w.-]*)(\{.*\})", body.strip(), re.S)
    if match:
      try:
        arguments = json.loads(_gemma_json(match.group(2)))
        name = match.group(1)
      except ValueError:
        arguments = None
      if not isinstance(arguments, dict):
        name, arguments = None, None
    calls.append((start, pos, name, arguments))


def _gemma_json(text: str) -> str:
  """Gemma 4's argument object as JSON: each <|"|>...<|"|> string quoted, each bare key
  (a name before a colon, outside a string) quoted; the rest as it is. Raises ValueError
  for a string never closed."""
  out, i = [], 0
  while i < len(text):
    if text.startswith(_QUOTE, i):
      close = text.find(_QUOTE, i + len(_QUOTE))
      if close < 0:
        raise ValueError("a string with no closing mark")
      out.append(json.dumps(text[i + len(_QUOTE):close]))
      i = close + len(_QUOTE)
      continue
    bare = _BARE.match(text, i)
    if bare and text[bare.end():].lstrip().startswith(":") and (
        "".join(out).rstrip()[-1:] in ("{", ",")):
      out.append(json.dumps(bare.group(0)))
      i = bare.end()
      continue
    if bare:  # a literal (true, false, null) or part of a number
      out.append(bare.group(0))
      i = bare.end()
      continue
    out.append(text[i])
    i += 1
  return "".join(out)


def read_json_calls(text: str, syntax: CallSyntax) -> list[tuple[int, int, Any, Any]]:
  """(start, end, name, arguments) of the JSON calls in `text`, each an object in the
  wrapper tags; a block whose JSON does not parse to an object is a call with no name."""
  return read_wrapped_json_calls(text, *syntax.wrapper, syntax.arguments_key)


def _environment():
  import jinja2
  from jinja2.ext import Extension, loopcontrols
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  class Generation(Extension):
    """transformers' {% generation %} ... {% endgeneration %}: renders its body."""
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
          lineno)

    def _body(self, caller):
      return caller()

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[Generation, loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
  return env


class TemplateFormat(ChatFormat):
  """A tokenizer's own Jinja chat template as a chat format (see the module docstring)."""

  name = "template"

  def __init__(self, tok, template: str, cfg: dict[str, Any]):
    import jinja2
    if not template:
      raise ValueError("the tokenizer has no chat template to render conversations with")
    try:
      self._template = _environment().from_string(template)
    except jinja2.exceptions.TemplateError as e:
      raise ValueError(f"the tokenizer's chat template does not compile: {e}") from None
    self._tokens = {key: text for key in ("bos_token", "eos_token", "pad_token", "unk_token")
                    if (text := config_token(cfg, key)) is not None}
    super().__init__(tok, {r: [] for r in ROLES}, [], name="template")
    end = self._end_after_content()
    eos_text = self._tokens.get("eos_token")
    eos = None if eos_text is None else tok._tok.token_to_id(eos_text)
    self.end_of_turn = [end] if end is not None else [] if eos is None else [eos]
    # What may close the model's turn in data: the end-of-turn token, or eos (OLMo 3's
    # template ends the conversation's last assistant turn with it instead).
    self._closers = set(self.end_of_turn) | ({eos} if eos is not None else set())
    self._headers: dict[Any, list[int]] = {}
    self.generation_header = self.generation_prompt()
    # <think> blocks: a vocabulary with both tags, or a template that writes them; a
    # generation prompt ending in <think> opens the block (OLMo 3 Think).
    vocab = tok._tok.get_vocab(with_added_tokens=True)
    ids = (vocab.get(reasoning_lib.THINK_OPEN), vocab.get(reasoning_lib.THINK_CLOSE))
    self.think_ids = ids if None not in ids else None
    prompt_text = tok._tok.decode(self.generation_header, skip_special_tokens=False)
    self.opens_reasoning = prompt_text.rstrip().endswith(reasoning_lib.THINK_OPEN)
    if self.think_ids or self.opens_reasoning or reasoning_lib.THINK_CLOSE in template:
      self.reasoning = "think"
    # Gemma 4's thought channel: a vocabulary with both of its tags.
    ids = (vocab.get(reasoning_lib.CHANNEL_OPEN), vocab.get(reasoning_lib.CHANNEL_CLOSE))
    if self.reasoning is None and None not in ids:
      self.reasoning, self.think_ids = "channel", ids
      self.opens_reasoning = prompt_text.rstrip().endswith(
          reasoning_lib.CHANNEL_OPEN + reasoning_lib.CHANNEL_THOUGHT)

  # --- rendering ------------------------------------------------------------------------

  def render(self, messages: Sequence[dict], add_generation_prompt: bool = False,
             tools: Sequence[dict] | None = None, thinking: bool | None = None) -> str:
    """The template's text of `messages` (transformers' apply_chat_template, untokenized;
    `thinking` given is its enable_thinking)."""
    import jinja2
    extra = {} if thinking is None else {"enable_thinking": bool(thinking)}
    try:
      return self._template.render(messages=list(messages), tools=list(tools) if tools else None,
                                   add_generation_prompt=add_generation_prompt,
                                   **self._tokens, **extra)
    except jinja2.exceptions.TemplateError as e:
      raise ValueError(f"the chat template refused the conversation: {e}") from None

  def _encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """(ids, character offsets) of `text`, special tokens in it recognised."""
    enc = self.tok._tok.encode(text, add_special_tokens=False)
    return list(enc.ids), list(enc.offsets)

  def _after_probe(self, text: str, thinking=None) -> int:
    """Where the probe's assistant content ends in `text`, a rendering of the probe
    conversation and what follows it (-1: the template does not show the content)."""
    content = _PROBE[1]["content"]
    at = text.find(content, len(self.render(_PROBE[:1], thinking=thinking)))
    return -1 if at < 0 else at + len(content)

  def _end_after_content(self) -> int | None:
    """The special token the template writes right after an assistant's content."""
    text = self.render(_PROBE + [{"role": "user", "content": "Hi"}])
    after = self._after_probe(text)
    if after < 0:
      return None
    ids, offsets = self._encode(text)
    special = {int(i) for i, t in self.tok._tok.get_added_tokens_decoder().items()
               if t.special}
    for i, (start, _) in enumerate(offsets):
      if start >= after:
        return ids[i] if ids[i] in special else None
    return None

  def check_thinking(self, thinking) -> None:
    """None, or True / False: the template's enable_thinking (Qwen3's, SmolLM3's)."""
    if thinking is not None and not isinstance(thinking, bool):
      raise ValueError(f"thinking must be None, True or False (the chat template's "
                       f"enable_thinking), got {thinking!r}")

  def encode(self, messages, add_generation_prompt=False, thinking=None, tools=None):
    self.check_thinking(thinking)
    messages = [dict(m) for m in messages]
    for m in messages:  # a call-only message's content may be None (OpenAI's), as rendered
      self._message(m if m.get("content") is not None or not m.get("tool_calls")
                    else {**m, "content": ""})
    text = self.render(messages, add_generation_prompt, tools, thinking)
    ids, offsets = self._encode(text)
    spans = []
    for i, m in enumerate(messages):
      if m["role"] != "assistant" or not m.get("weight", 1):
        continue
      base = self.render(messages[:i], False, tools, thinking)
      if not text.startswith(base):
        raise ValueError(f"message {i}: the chat template renders the conversation before "
                         "it differently once it follows; cannot mark the model's tokens")
      # The turn starts where the generation prompt and the rendered turn part: after
      # the whole prompt, or (a prompt that also opens <think>, which the template does
      # not write for a finished turn) after the header they share.
      prompt = self.render(messages[:i], True, tools, thinking)[len(base):]
      rest = text[len(base):]
      shared = next((j for j, (a, b) in enumerate(zip(prompt, rest)) if a != b),
                    min(len(prompt), len(rest)))
      if shared < len(prompt):  # they part inside a token of the prompt's ("<t" of
        # <think> and <tool_call>): the turn starts where that token does.
        shared = max([hi for _, hi in self._encode(prompt)[1] if hi <= shared], default=0)
      start = len(base) + shared
      content = m.get("content") or ""
      at = text.find(content, start) if content else start
      if at < 0:
        upto = self.render(messages[:i + 1], False, tools, thinking)
        if not text.startswith(upto):
          raise ValueError(f"message {i}: the chat template does not render the "
                           "assistant's content as given; cannot mark the model's tokens")
        at, content = len(upto), ""
      end = at + len(content)
      if m.get("tool_calls"):
        # The calls the template writes after the content are the model's too: up to the
        # token that closes the turn, or else to the end of the message.
        upto = self.render(messages[:i + 1], False, tools, thinking)
        limit = len(upto) if text.startswith(upto) else len(text)
        end = next((lo for t, (lo, _) in enumerate(offsets)
                    if end <= lo < limit and ids[t] in self._closers), limit)
      spans.append((start, end))
    mask = [0] * len(ids)
    starts = [lo for lo, _ in offsets]
    for start, end in spans:
      for t in range(bisect.bisect_left(starts, start), len(ids)):
        lo, hi = offsets[t]
        if hi <= end and hi > lo:
          mask[t] = 1
        elif lo >= end:
          if ids[t] in self._closers:
            mask[t] = 1
          break
    return ids, mask

  def generation_prompt(self, thinking=None) -> list[int]:
    """What the template adds to open the model's turn (after a one-message probe)."""
    self.check_thinking(thinking)
    if thinking not in self._headers:
      with_prompt = self.render(_PROBE[:1], True, thinking=thinking)
      without = self.render(_PROBE[:1], thinking=thinking)
      if not with_prompt.startswith(without):
        raise ValueError("the chat template's generation prompt does not follow the "
                         "conversation it is added to; cannot use it as a chat format")
      self._headers[thinking] = self._encode(with_prompt[len(without):])[0]
    return list(self._headers[thinking])

  def continuation(self, messages, *, ended=True, thinking=None):
    """What follows a model turn: rendered after a probe conversation, from the end of
    its assistant content (the end-of-turn token the model wrote dropped)."""
    self.check_thinking(thinking)
    text = self.render(list(_PROBE) + list(messages), True, thinking=thinking)
    after = self._after_probe(text, thinking)
    if after < 0:
      raise ValueError("the chat template does not show an assistant's content; cannot "
                       "continue a conversation after a model turn")
    ids = self._encode(text[after:])[0]
    if ids[:len(self.end_of_turn)] == self.end_of_turn:
      ids = ids[len(self.end_of_turn):]
    return ([] if ended else list(self.end_of_turn)) + ids

  def split_response(self, ids, prompt=None):
    """The content after a <think> block (Gemma 4's thought channel) where the format has
    them (the block opened by the generation prompt where it ends in <think>, as after the
    prompt or with no prompt given); otherwise all of it."""
    if self.reasoning is None:
      return super().split_response(ids)
    header = self.generation_header
    opened = self.opens_reasoning and (prompt is None or list(prompt[-len(header):]) == header)
    open_id, close_id = self.think_ids or (None, None)
    split = (reasoning_lib.split_channel if self.reasoning == "channel" else
             reasoning_lib.split_think)
    return split(self.tok, ids, open_id=open_id, close_id=close_id, opened=opened)

  # --- tool calls -----------------------------------------------------------------------

  def _call_text(self, name: str, arguments: Any) -> str:
    """The rendering of an assistant message holding one call and no content, after a
    one-message conversation (from the end of that conversation's rendering)."""
    base = self.render(_PROBE[:1])
    text = self.render(_PROBE[:1] + [_call_message(name, arguments)])
    if not text.startswith(base):
      raise ValueError("the chat template renders the conversation before a tool call "
                       "differently once the call follows")
    return text[len(base):]

  @functools.cached_property
  def call_syntax(self) -> CallSyntax | None:
    """How the template writes a tool call (found by rendering a probe call); None where
    it has no syntax read here, or refuses the probe."""
    try:
      return call_syntax(self._call_text(*_PROBE_CALL))
    except Exception:  # a template that fails on a structured call: none read here
      return None

  def check_tools(self, tools) -> None:
    if tools and self.call_syntax is None:
      raise ValueError("the chat template does not write tool calls as <function=NAME> XML, "
                       "as JSON in a wrapper tag or as Gemma 4's call:NAME{...}, so a model's "
                       "calls cannot be read: use rollout.tool_format=text")

  def read_tool_calls(self, text):
    """The calls in `text`, in the template's syntax (see the module docstring)."""
    if self.call_syntax is None:
      return []
    if self.call_syntax.kind == "xml":
      return read_xml_calls(text, self.call_syntax)
    if self.call_syntax.kind == "gemma":
      return read_gemma_calls(text)
    return read_json_calls(text, self.call_syntax)

  def write_tool_call(self, name, arguments):
    """The text the template renders for this one call: its wrapper's tags (or, bare,
    its <function=...> block) and what lies between them."""
    self.check_tools([{}])
    text = self._call_text(name, arguments)
    opener, closer = self.call_syntax.wrapper or (_FUNCTION, _FUNCTION_END)
    start, end = text.find(opener), text.rfind(closer)
    if start < 0 or end < start:
      raise ValueError(f"the chat template does not render a call of {name!r} as its probe "
                       "call; cannot write it")
    return text[start:end + len(closer)]

  def fold_tool_calls(self, messages):
    return list(messages)  # the template renders structured tool_calls itself
