"""gpt-oss's harmony with tools: function schemas, calls and their answers rendered as
gpt-oss's own chat template (tests/data/gpt_oss_template.jinja, verbatim) renders them
through transformers, and calls read back out of what the model writes."""

import json
import pathlib
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.data.tokenizer import harmony_system
from posttrain.tasks.families.tools import NATIVE_TOOLS
from tests.data.test_reasoning import HARMONY_CONVOS, _hf, _own, _text

transformers = pytest.importorskip("transformers")

GPT_OSS_TEMPLATE = (pathlib.Path(__file__).parent / "gpt_oss_template.jinja").read_text(
    encoding="utf-8")
# The template writes today's date into the system message; the harmony format leaves that
# line out, so that a prompt's ids do not change from day to day.
_DATE = re.compile(r"Current date: \d{4}-\d{2}-\d{2}\n")

CALC, PYTHON = NATIVE_TOOLS["calculator"], NATIVE_TOOLS["python"]
# Every construct the template's render_typescript_type handles, and its defaults.
RICH = {"type": "function", "function": {
    "name": "plan_trip", "description": "Plans a trip.",
    "parameters": {"type": "object", "required": ["city", "when"], "properties": {
        "city": {"type": "string", "description": "Where to."},
        "when": {"type": "object", "required": ["date"], "properties": {
            "date": {"type": "string"}, "hour": {"type": "integer"}}},
        "mode": {"type": "string", "enum": ["train", "car"], "default": "train",
                 "description": "How."},
        "nights": {"type": "integer", "default": 2},
        "budget": {"type": "number", "default": 99.5},
        "pets": {"type": "boolean", "default": False},
        "stops": {"type": "array", "items": {"type": "string"}},
        "days": {"type": "array", "items": {"type": "integer"}, "nullable": True},
        "flags": {"type": "array", "items": {"type": "boolean"}},
        "legs": {"type": "array", "items": {"type": "object", "properties": {
            "to": {"type": "string"}}}},
        "grid": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
        "wide": {"type": "array", "items": {"type": "object", "required": ["a_long_name"],
                                            "properties": {"a_long_name": {"type": "string"},
                                                           "another": {"type": "string"}}}},
        "anything": {"type": "array"},
        "note": {"type": "string", "nullable": True},
        "id": {"oneOf": [{"type": "string", "description": "a name"},
                         {"type": "integer", "default": 0}], "default": "me"},
        "either": {"oneOf": [{"type": "object"}, {"type": "string"}]},
        "one": {"oneOf": [{"type": "object", "properties": {"x": {"type": "number"}}}]},
        "union": {"type": ["string", "null"]},
        "single": {"type": ["number"]},
        "extra": {"type": "object"},
        "loose": {},
        "odd": {"type": "null", "default": None}}}}}
NOARGS = {"type": "function", "function": {"name": "ping", "description": "Is it up?"}}
TOOL_SETS = {"calculator": [CALC], "both": [CALC, PYTHON], "rich": [RICH, NOARGS]}


def _template(tok, messages, **kw):
  """The template's rendering, its date line left out (there once, as the template
  writes it)."""
  text = _hf(tok).apply_chat_template(messages, chat_template=GPT_OSS_TEMPLATE,
                                      tokenize=False, **kw)
  assert len(_DATE.findall(text)) == 1, text[:300]
  return _DATE.sub("", text)


def _as_given_to_the_template(convo):
  """Null content as the empty string the template sees (it would write "None"), and
  reasoning under the one name the template reads, "thinking"."""
  return [{("thinking" if k == "reasoning_content" else k): ("" if k == "content" and v is None
                                                              else v)
           for k, v in m.items()} for m in convo]


def _same(tok, ids, want):
  """The ids are the template's text, and the ids its text tokenizes to."""
  assert _text(tok, ids) == want
  assert ids == _hf(tok)(want, add_special_tokens=False)["input_ids"]


def _model_tokens(text):
  """What the model writes in a rendered conversation: each run of assistant messages
  after the "<|start|>assistant" that opens it, through its <|call|> or <|return|>, but a
  final message's <|end|>, which the template writes in place of the <|return|>."""
  own, previous = [], None
  for m in text.split("<|start|>")[1:]:
    role = re.split(r"<\|channel\|>|<\|message\|>| ", m)[0]
    if role == "assistant":
      if "<|channel|>final" in m and m.endswith("<|end|>"):
        m = m[:-len("<|end|>")]
      own.append(m[len("assistant"):] if previous != "assistant" else "<|start|>" + m)
    previous = role
  return "".join(own)


def _call(name, arguments, wrapped=True):
  inner = {"name": name, "arguments": arguments}
  return {"type": "function", "function": inner} if wrapped else inner


@pytest.mark.parametrize("tools", list(TOOL_SETS))
@pytest.mark.parametrize("system", [None, "be brief"])
@pytest.mark.parametrize("effort", [None, "low", "medium", "high"])
def test_schemas_are_declared_as_the_template_declares_them(harmony, tools, system, effort):
  """The system message says where calls go; the developer message (there without a
  system message too) holds the instructions, then the functions' TypeScript namespace."""
  convo = ([{"role": "system", "content": system}] if system else []) + [
      {"role": "user", "content": "2+2?"}]
  kw = {} if effort is None else {"reasoning_effort": effort}
  ids, mask = harmony.encode_chat(convo, add_generation_prompt=True, thinking=effort,
                                  tools=TOOL_SETS[tools])
  want = _template(harmony, convo, tools=TOOL_SETS[tools], add_generation_prompt=True, **kw)
  _same(harmony, ids, want)
  assert not any(mask)
  assert want.startswith(f"<|start|>system<|message|>"
                         f"{harmony_system(effort or 'medium', tools=True)}<|end|>"
                         "<|start|>developer<|message|>"
                         + (f"# Instructions\n\n{system}\n\n" if system else "")
                         + "# Tools\n\n## functions\n\nnamespace functions {\n\n")


def test_the_rich_schema_renders_each_construct(harmony):
  """Spot checks of the oracle-matched rendering, so a change in either is read here."""
  ids, _ = harmony.encode_chat([{"role": "user", "content": "go"}], tools=[RICH])
  text = _text(harmony, ids)
  for line in ['// How.\nmode?: "train" | "car", // default: train,\n',
               "nights?: number, // default: 2,\n", "pets?: boolean, // default: false,\n",
               "when: {\ndate: \n                string, hour?: \n                number},\n",
               "legs?: {\nto?: \n                string}[],\n", "wide?: any[],\n",
               "days?: number[] | null,\n", "note?: string | null,\n",
               "id?: string// a name | \nnumber                    // default: 0// default: me,\n",
               "either?: object | \nstring,\n",  # the template's "any" never comes
               "one?: {\nx?: \n                number},\n", "grid?: number[][],\n",
               "union?: string | null,\n", "single?: number,\n", "loose?: any,\n",
               "odd?: any, // default: null,\n"]:
    assert line in text, line


@pytest.mark.parametrize("convo", HARMONY_CONVOS)
def test_without_tools_the_full_template_agrees(harmony, convo):
  """Text conversations render as before: the full template agrees with the trimmed one
  the reasoning tests use; empty tools are no tools."""
  ids, _ = harmony.encode_chat(convo, tools=[])
  _same(harmony, ids, _template(harmony, convo))


def _conversations(arguments):
  """(name, messages, add_generation_prompt) of tool-calling conversations."""
  call = [_call("calculator", arguments)]
  user = {"role": "user", "content": "What is 27*58?"}
  return [
      # A call, its answer, the final answer: the call's analysis is dropped (a final
      # answer follows it), the final answer's kept (training: no generation prompt).
      ("answered", [{"role": "system", "content": "be exact"}, user,
                    {"role": "assistant", "content": None, "thinking": "need a tool",
                     "tool_calls": call},
                    {"role": "tool", "content": "1566"},
                    {"role": "assistant", "thinking": "got it",
                     "content": "<answer>1566</answer>"}], False),
      # Mid-run (generation prompt): the call's reasoning is kept, as the model wrote it.
      ("pending", [user, {"role": "assistant", "content": "", "reasoning_content": "hmm",
                          "tool_calls": call}, {"role": "tool", "content": "1566"}], True),
      # The call's content is its analysis; the call given without the wrapper.
      ("content", [user, {"role": "assistant", "content": "Let me compute.",
                          "tool_calls": [_call("calculator", arguments, wrapped=False)]},
                   {"role": "tool", "content": 'say "1566"\nok'}], True),
      # Two calls, a final answer, a new question: the second call's answer names its
      # own function, and the final answer ends the run.
      ("two", [user, {"role": "assistant", "content": "", "tool_calls": call},
               {"role": "tool", "content": "1566"},
               {"role": "assistant", "content": "", "thinking": "check",
                "tool_calls": [_call("python", {"code": "print(27*58)"})]},
               {"role": "tool", "content": "1566"},
               {"role": "assistant", "content": "<answer>1566</answer>"},
               {"role": "user", "content": "And 2+2?"}], True),
      # A training conversation that ends with the call: it ends with <|call|>.
      ("ends_calling", [user, {"role": "assistant", "content": "", "thinking": "a tool",
                               "tool_calls": call}], False),
  ]


@pytest.mark.parametrize("arguments", [{"expression": "27*58"}, '{"expression": "27*58"}'],
                         ids=["object", "text"])
@pytest.mark.parametrize("case", range(5))
def test_calls_and_answers_are_the_templates(harmony, arguments, case):
  name, convo, prompt = _conversations(arguments)[case]
  ids, mask = harmony.encode_chat(convo, add_generation_prompt=prompt, tools=[CALC, PYTHON])
  want = _template(harmony, _as_given_to_the_template(convo), tools=[CALC, PYTHON],
                   add_generation_prompt=prompt)
  _same(harmony, ids, want)
  assert _own(harmony, ids, mask) == _model_tokens(want), name
  # The template's tojson: an object's JSON, or text as a JSON string.
  assert (f"<|start|>assistant to=functions.calculator<|channel|>commentary json<|message|>"
          f"{json.dumps(arguments)}<|call|>") in want
  if name in ("pending", "ends_calling"):
    assert "<|channel|>analysis" in _own(harmony, ids, mask)
  if name == "answered":
    assert "need a tool" not in want and want.endswith("<answer>1566</answer><|return|>")


def test_continuation_after_a_call_is_the_templates(harmony):
  """A rollout's tool answer: after the model's call turn (which stopped at <|call|>), the
  tool message naming the called function and the generation prompt, exactly as the
  template renders the conversation continued."""
  convo = _conversations({"expression": "27*58"})[1][1]
  prompt, _ = harmony.encode_chat(convo[:1], add_generation_prompt=True, tools=[CALC])
  turn, _ = harmony.encode_chat(convo[:2], tools=[CALC])
  assert turn[:len(prompt)] == prompt and turn[-1] in harmony.stop_ids
  tool = dict(convo[2], name="calculator")
  whole = turn + harmony.chat.continuation([tool])
  _same(harmony, whole, _template(harmony, _as_given_to_the_template(convo), tools=[CALC],
                                  add_generation_prompt=True))
  assert _text(harmony, harmony.chat.continuation([tool])) == (
      '<|start|>functions.calculator to=assistant<|channel|>commentary<|message|>"1566"'
      "<|end|><|start|>assistant")
  # A tool turn that answers no call keeps its bare header (text-protocol tool use).
  assert _text(harmony, harmony.chat.continuation([convo[2]])).startswith(
      "<|start|>functions to=assistant<|channel|>commentary<|message|>1566<|end|>")


def test_calls_read_back(harmony):
  """The model's call turn reads as its reasoning and the call (function, arguments
  text), whether the recipient is in the header's role part (the template's) or its
  channel part; the call's body is no content."""
  convo = _conversations({"expression": "27*58"})[4][1]
  prompt, _ = harmony.encode_chat(convo[:1], add_generation_prompt=True, tools=[CALC])
  turn, _ = harmony.encode_chat(convo, tools=[CALC])
  got = harmony.split_response(turn[len(prompt):])
  assert (got.content, got.reasoning, got.closed, got.calls) == (
      "", "a tool", True, (("calculator", '{"expression": "27*58"}'),))
  got = harmony.split_response(harmony.encode(
      "<|channel|>analysis<|message|>run it<|end|><|start|>assistant<|channel|>commentary "
      'to=functions.python <|constrain|>json<|message|>{"code": "print(1)"}<|call|>'))
  assert (got.content, got.reasoning, got.calls) == (
      "", "run it", (("python", '{"code": "print(1)"}'),))
  # A preamble is content; a call cut off before its <|call|> is no call, yet the model
  # left the analysis channel.
  got = harmony.split_response(harmony.encode(
      "<|channel|>analysis<|message|>plan<|end|><|start|>assistant<|channel|>commentary"
      "<|message|>checking<|end|><|start|>assistant to=functions.add<|channel|>commentary "
      'json<|message|>{"a": '))
  assert (got.content, got.reasoning, got.closed, got.calls) == ("checking", "plan", True, ())
  # Other formats' completions have no calls of their own.
  assert harmony.split_response(harmony.encode("<|channel|>final<|message|>4<|return|>")
                                ).calls == ()


_NAMES = st.from_regex(r"[a-z_][a-z0-9_]{0,11}", fullmatch=True)
_VALUES = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="<|"),
                  max_size=20)


@settings(max_examples=30, deadline=None)
@given(name=_NAMES, arguments=st.dictionaries(_NAMES, _VALUES, max_size=3),
       thought=_VALUES)
def test_any_rendered_call_reads_back(harmony, name, arguments, thought):
  convo = [{"role": "user", "content": "q"},
           {"role": "assistant", "content": "", "thinking": thought,
            "tool_calls": [_call(name, arguments)]}]
  prompt, _ = harmony.encode_chat(convo[:1], add_generation_prompt=True)
  turn, _ = harmony.encode_chat(convo)
  got = harmony.split_response(turn[len(prompt):])
  assert got.calls == ((name, json.dumps(arguments, ensure_ascii=False)),)
  assert (got.content, got.reasoning) == ("", thought.strip())


@pytest.mark.parametrize("message, tools, error", [
    ({"role": "assistant", "content": "", "tool_calls": []}, None, "non-empty list"),
    ({"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}, None,
     "needs a function name"),
    ({"role": "assistant", "content": "", "tool_calls": [_call("f", 3)]}, None,
     "arguments must be an object or its JSON text"),
    ({"role": "assistant", "content": "", "tool_calls": [_call("f", {})] * 2}, None,
     "one tool call per assistant message, got 2"),
    ({"role": "user", "content": "", "tool_calls": [_call("f", {})]}, None,
     "only an assistant"),
    ({"role": "assistant", "content": "hm", "thinking": "hm", "tool_calls": [_call("f", {})]},
     None, "from its content or its reasoning, not both"),
    ({"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": {}, "content_type": 1}}]}, None,
     "content_type must be a string"),
    ({"role": "tool", "content": "1", "name": 3}, None, "name must be a function name"),
    ({"role": "assistant", "content": "4"}, [{"function": {"name": "f"}}],
     r"tools\[0\] \(f\) needs a description"),
    ({"role": "assistant", "content": "4"}, [{"function": {"description": "d"}}],
     r"tools\[0\] needs a function name"),
    ({"role": "assistant", "content": "4"}, ["f"], "must be a function schema"),
    ({"role": "assistant", "content": "4"}, {"name": "f"}, "must be a list"),
    ({"role": "assistant", "content": "4"}, [{"function": {
        "name": "f", "description": "d", "parameters": {"properties": {"n": {
            "type": "integer", "enum": [1, 2], "default": 1}}}}}],
     "parameter n: harmony's template writes this default as text"),
])
def test_malformed_calls_and_schemas_fail_in_one_line(harmony, message, tools, error):
  with pytest.raises(ValueError, match=error) as e:
    harmony.encode_chat([{"role": "user", "content": "q"}, message], tools=tools)
  assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match="a message of its own, not as text"):
    harmony.chat.write_tool_call("f", {})
