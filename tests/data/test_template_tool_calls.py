"""Tool calls in the syntax a chat template renders (`posttrain.data.templates`): a Qwen3.5
style template (ChatML, Qwen3's <think> blocks, XML tool schemas and <function=NAME> calls)
picks the template format, renders tools and calls as transformers' apply_chat_template
does, and reads back the calls it writes; JSON calls in <tool_call> tags read too; a
template without calls refuses tools; a native-tool rollout and SFT demonstration are the
template's rendering."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.data import load_tokenizer
from posttrain.data.templates import CallSyntax, TemplateFormat
from posttrain.data.tokenizer import ChatMLFormat
from posttrain.rollout import worker as worker_lib
from posttrain.tasks import registry
from posttrain.tasks.families.tools import NATIVE_TOOLS, native_call_text
from tests.data.test_reasoning import (QWEN3_SPECIALS, QWEN3_TEMPLATE, QWEN3_TOOLS_TEMPLATE,
                                       _hf, _own, _text, _write_tokenizer)
from tests.rollout.test_reasoning_rollout import TOOL_PAIRS, _rollout, _Scripted, _task

transformers = pytest.importorskip("transformers")

# Qwen3's template with Qwen3.5's tool parts (the schemas as XML in the system turn, calls
# as <function=NAME> blocks in <tool_call> tags), the longest lines broken inside the tags.
QWEN35_TEMPLATE = QWEN3_TEMPLATE.replace(
    r"""{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
""", r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou have access to the following functions:\n\n<tools>" }}
    {%- for tool in tools %}
        {%- if tool.function is defined %}
            {%- set tool = tool.function %}
        {%- endif %}
        {{- '\n<function>\n<name>' ~ tool.name ~ '</name>' }}
        {%- if tool.description is defined %}
            {{- '\n<description>' ~ (tool.description | trim) ~ '</description>' }}
        {%- endif %}
        {{- '\n<parameters>' }}
        {%- for param_name, param_fields in tool.parameters.properties|items %}
            {{- '\n<parameter>\n<name>' ~ param_name ~ '</name>' }}
            {%- if param_fields.type is defined %}
                {{- '\n<type>' ~ (param_fields.type | string) ~ '</type>' }}
            {%- endif %}
            {%- if param_fields.description is defined %}
                {{- '\n<description>' ~ (param_fields.description | trim) ~ '</description>' }}
            {%- endif %}
            {{- '\n</parameter>' }}
        {%- endfor %}
        {{- '\n</parameters>\n</function>' }}
    {%- endfor %}
    {{- "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format "
        + "with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n"
        + "<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
        + "<parameter=example_parameter_2>\nThis is the value for the second parameter\n"
        + "that can span\nmultiple lines\n</parameter>\n</function>\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
""").replace(r"""        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}""", r"""        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function is defined %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {%- if not loop.first %}
                    {{- '\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
                {%- elif content | trim %}
                    {{- '\n\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
                {%- else %}
                    {{- '<tool_call>\n<function=' + tool_call.name + '>\n' }}
                {%- endif %}
                {%- for name, value in tool_call.arguments | items %}
                    {{- '<parameter=' + name + '>\n' }}
                    {%- if value is mapping or (value is sequence and value is not string) %}
                        {{- value | tojson | safe }}
                    {%- else %}
                        {{- value | string }}
                    {%- endif %}
                    {{- '\n</parameter>\n' }}
                {%- endfor %}
                {{- '</function>\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}""")
assert QWEN35_TEMPLATE.count("<function=") == 4 and "tool_call.arguments" in QWEN35_TEMPLATE
# Its generation prompt as Qwen3.5's: the <think> block opened unless thinking is off.
QWEN35_OPEN_TEMPLATE = QWEN35_TEMPLATE.replace(r"""        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}""", r"""        {{- '<think>\n\n</think>\n\n' }}
    {%- else %}
        {{- '<think>\n' }}
    {%- endif %}
{%- endif %}""")
assert QWEN35_OPEN_TEMPLATE.endswith("{{- '<think>\\n' }}\n    {%- endif %}\n{%- endif %}")

TOOLS = list(NATIVE_TOOLS.values())


def _with_template(path, template):
  """A small BPE tokenizer with Qwen3's tokens and `template` as its chat template."""
  _write_tokenizer(path, QWEN3_SPECIALS)
  cfg = json.loads((path / "tokenizer_config.json").read_text())
  cfg["chat_template"] = template
  (path / "tokenizer_config.json").write_text(json.dumps(cfg))
  return str(path)


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
  return load_tokenizer(_with_template(tmp_path_factory.mktemp("qwen35"), QWEN35_TEMPLATE))


@pytest.fixture(scope="module")
def qwen35_open(tmp_path_factory):
  """The XML template whose generation prompt opens <think>."""
  return load_tokenizer(_with_template(tmp_path_factory.mktemp("qwen35_open"),
                                       QWEN35_OPEN_TEMPLATE))


def _variant(request, opens):
  """(tokenizer, template) of the XML template, its generation prompt opening <think>
  or not."""
  if opens:
    return request.getfixturevalue("qwen35_open"), QWEN35_OPEN_TEMPLATE
  return request.getfixturevalue("qwen35"), QWEN35_TEMPLATE


def _call(name, arguments):
  return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _read(value):
  """An argument as the XML reader gives it back: objects and arrays as they are, strings
  that parse as one as that, any other value as the template's text of it."""
  if isinstance(value, str):
    try:
      parsed = json.loads(value)
    except ValueError:
      return value
    return parsed if isinstance(parsed, (dict, list)) and value[:1] in "{[" else value
  return value if isinstance(value, (dict, list)) else str(value)


def test_xml_template_picks_its_own_format_with_chatmls_stops(qwen35, qwen3, tmp_path):
  """<|im_start|> and a template that writes <function=...> calls: the template format,
  with the ChatML branch's eos and stops; Qwen3's ChatML (JSON calls) keeps its format; the
  thinking switch is the template's enable_thinking."""
  assert isinstance(qwen35.chat, TemplateFormat)
  assert qwen35.chat.call_syntax == CallSyntax("xml", ("<tool_call>", "</tool_call>"),
                                               ("\n", "\n"))
  end, text_end = (qwen35._tok.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>"))
  assert qwen35.eos_id == end and qwen35.chat.end_of_turn == [end]
  assert qwen35.extra_stop_ids == [text_end] and qwen35.stop_ids == tuple(sorted({end,
                                                                                  text_end}))
  assert isinstance(qwen3.chat, ChatMLFormat)
  assert qwen3.stop_ids == qwen35.stop_ids
  (tmp_path / "qwen3").mkdir()
  tok = load_tokenizer(_with_template(tmp_path / "qwen3", QWEN3_TOOLS_TEMPLATE))
  assert isinstance(tok.chat, ChatMLFormat)
  convo = [{"role": "user", "content": "2+2?"}]
  for thinking in (None, True, False):
    ids, _ = qwen35.encode_chat(convo, add_generation_prompt=True, thinking=thinking,
                                tools=TOOLS)
    extra = {} if thinking is None else {"enable_thinking": thinking}
    want = _hf(qwen35).apply_chat_template(convo, tools=TOOLS, chat_template=QWEN35_TEMPLATE,
                                           tokenize=False, add_generation_prompt=True, **extra)
    assert _text(qwen35, ids) == want
    assert ids == _hf(qwen35)(want, add_special_tokens=False)["input_ids"]
  assert want.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


CALL_CONVOS = [
    # One call, no content, after the conversation's own system message.
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+2?"},
     {"role": "assistant", "content": "", "tool_calls": [_call("calculator",
                                                               {"expression": "1+2"})]},
     {"role": "tool", "content": "3"}, {"role": "assistant", "content": "It is 3."}],
    # Reasoning and content before two calls (a multi-line program, then an object, a list
    # and a number); two tool answers in one user turn.
    [{"role": "user", "content": "run both"},
     {"role": "assistant", "reasoning_content": "two tools", "content": "Running them.",
      "tool_calls": [_call("python", {"code": "x = 1\n\nprint(x)\n"}),
                     _call("search", {"query": "cats", "filters": {"year": 2020},
                                      "tags": ["a", "b"], "limit": 3})]},
     {"role": "tool", "content": "1"}, {"role": "tool", "content": "[]"},
     {"role": "assistant", "reasoning_content": "done", "content": "1, none."}],
]


@pytest.mark.parametrize("opens", [False, True])
@pytest.mark.parametrize("convo", CALL_CONVOS)
def test_tools_and_calls_render_as_the_template(request, convo, opens):
  """encode(messages, tools=...) is apply_chat_template's, token for token, with or without
  a generation prompt; the mask holds each assistant turn, its calls and <|im_end|> (less
  the <think> a generation prompt opens, which is the prompt's)."""
  tok, template = _variant(request, opens)
  hf = _hf(tok)
  for prompt, messages in ((True, convo[:-1]), (False, convo)):
    ids, mask = tok.encode_chat(messages, add_generation_prompt=prompt, tools=TOOLS)
    want = hf.apply_chat_template(messages, tools=TOOLS, chat_template=template,
                                  tokenize=False, add_generation_prompt=prompt)
    assert _text(tok, ids) == want
    assert ids == hf(want, add_special_tokens=False)["input_ids"]
  assert "<name>calculator</name>" in want and "<function=" in want
  turns = [t.removeprefix("<think>\n" if opens else "")
           for t in want.split("<|im_start|>assistant\n")[1:]]
  assert _own(tok, ids, mask) == "".join(
      t[:t.index("<|im_end|>") + len("<|im_end|>")] for t in turns)


READ_CASES = [
    ("", [("calculator", {"expression": "1+2"})]),
    ("", [("calculator", {"expression": "3*4"}), ("python", {"code": "print(1)"})]),
    ("", [("python", {"code": "\nx = 1\n\n\nprint(x)\n\n"})]),
    ("", [("search", {"filters": {"year": 2020, "tags": ["a"]}, "ids": [1, 2], "limit": 3,
                      "exact": True, "query": "{not json"})]),
    ("Let me compute that.\n", [("calculator", {"expression": "27*58"})]),
]


@pytest.mark.parametrize("content,calls", READ_CASES)
def test_reads_the_calls_the_template_writes(qwen35, content, calls):
  """read_tool_calls on the template's own rendering of an assistant message: each call's
  span, name and arguments (objects and arrays parsed, other scalars as their text, each
  value less exactly the newline on each side); write_tool_call is each span's text."""
  message = {"role": "assistant", "content": content,
             "tool_calls": [_call(name, arguments) for name, arguments in calls]}
  want = _hf(qwen35).apply_chat_template([{"role": "user", "content": "go"}, message],
                                         chat_template=QWEN35_TEMPLATE, tokenize=False)
  turn = want.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
  assert turn.startswith("<think>\n\n</think>\n\n" + content.strip())
  read = qwen35.chat.read_tool_calls(turn)
  assert [(name, arguments) for _, _, name, arguments in read] == [
      (name, {k: _read(v) for k, v in arguments.items()}) for name, arguments in calls]
  assert [turn[start:end] for start, end, _, _ in read] == [
      qwen35.chat.write_tool_call(name, arguments) for name, arguments in calls]
  assert turn[read[-1][1]:] == ""  # nothing after the last call
  # The rollout's reading: a call of one string argument in the domain's text protocol.
  for (name, arguments), (_, _, *got) in zip(calls, read):
    if len(arguments) == 1:
      (value,) = arguments.values()
      assert native_call_text(*got) == f"<tool>{name}: {value}</tool>"


BAD_PARAMETER = ("<function=calculator>\n<parameter=expression>\n1\n</function>")
HOSTILE = [  # text, then the (span's text, name, arguments) of each call read
    ("", []),
    ("<function=calculator>\n<parameter=expression>\n1\n</parameter>\n", []),  # unclosed
    (f"<tool_call>\n{BAD_PARAMETER}\n</tool_call>",  # a parameter without </parameter>
     [(f"<tool_call>\n{BAD_PARAMETER}\n</tool_call>", None, None)]),
    ("<function=a>\n<function=b>\n<parameter=x>\n1\n</parameter>\n</function>",
     [("<function=b>\n<parameter=x>\n1\n</parameter>\n</function>", "b", {"x": "1"})]),
    ("<function=f>\n<parameter=x>\n1\n<parameter=y>\n2\n</parameter>\n</function>",
     [("<function=f>\n<parameter=x>\n1\n<parameter=y>\n2\n</parameter>\n</function>", None,
       None)]),  # x not closed before y opens
    ("<function=f>\n<parameter=x>\n1\n</parameter>\n<parameter=x>\n2\n</parameter>\n"
     "</function>", [("<function=f>\n<parameter=x>\n1\n</parameter>\n<parameter=x>\n2\n"
                      "</parameter>\n</function>", None, None)]),  # a parameter named twice
    ("<function=f>\njunk\n<parameter=x>\n1\n</parameter>\n</function>",
     [("<function=f>\njunk\n<parameter=x>\n1\n</parameter>\n</function>", None, None)]),
    ("<function=>\n</function>", [("<function=>\n</function>", None, None)]),  # no name
    ("<function=f\n>\n</function>", [("<function=f\n>\n</function>", None, None)]),
    ("<function=f></function>", [("<function=f></function>", "f", {})]),  # no arguments
    ("<tool_call><tool_call>\n<function=f>\n</function>\n</tool_call></tool_call>",
     [("<tool_call>\n<function=f>\n</function>\n</tool_call>", "f", {})]),  # one wrapper
    ("<tool_call>\n<function=f>\n</function>", [("<function=f>\n</function>", "f", {})]),
    ("a</function><parameter=x>\n<function=f><parameter=x>{1}</parameter></function>b",
     [("<function=f><parameter=x>{1}</parameter></function>", "f", {"x": "{1}"})]),
]


@pytest.mark.parametrize("text,want", HOSTILE)
def test_hostile_text_reads_as_defined(qwen35, text, want):
  """Malformed blocks do not raise: a <function= unclosed before the next one (or the end)
  is no call, a closed block that does not parse is a call with no name and no arguments
  (which the rollout reads as a malformed call); a wrapper is the call's where both its
  tags enclose the block."""
  read = qwen35.chat.read_tool_calls(text)
  assert [(text[start:end], name, arguments) for start, end, name, arguments in read] == want
  for _, _, name, arguments in read:
    if name is None:
      assert native_call_text(name, arguments) == "<tool>malformed call</tool>"


_VALUE = st.text(alphabet=st.sampled_from(list("ab 1\n{}[]\",:")), max_size=12)
_MARKUP = st.sampled_from(["<function=", "</function>", "<parameter=", "</parameter>",
                           "<tool_call>", "</tool_call>", ">", "\n", "f", "x", "1", " "])


@settings(max_examples=80, deadline=None)
@given(calls=st.lists(st.tuples(st.from_regex(r"[a-z_]{1,6}", fullmatch=True),
                                st.dictionaries(st.from_regex(r"[a-z]{1,4}", fullmatch=True),
                                                _VALUE, max_size=3)), min_size=1, max_size=3),
       noise=st.lists(_MARKUP, max_size=12))
def test_written_calls_read_back_and_junk_reads_safely(qwen35, calls, noise):
  """Calls the template writes (values with newlines, brackets and quotes) read back to
  their names and arguments, string values that parse as JSON objects or arrays parsed;
  any markup soup yields ordered, disjoint spans that each hold a whole block."""
  text = "\n".join(qwen35.chat.write_tool_call(name, arguments) for name, arguments in calls)
  read = qwen35.chat.read_tool_calls(text)
  assert [(name, arguments) for _, _, name, arguments in read] == [
      (name, {k: _read(v) for k, v in arguments.items()}) for name, arguments in calls]
  soup = "".join(noise)
  spans = qwen35.chat.read_tool_calls(soup)
  ends = [0] + [end for _, end, _, _ in spans]
  for (start, end, _, _), last in zip(spans, ends):
    assert last <= start < end <= len(soup)
    assert "<function=" in soup[start:end] and "</function>" in soup[start:end]


def test_json_calls_in_a_forced_template_and_templates_without_calls(qwen3, tmp_path):
  """Qwen3's template forced through the template format: its JSON calls in <tool_call>
  tags are read (an unparseable block: a call with no name) and written as Qwen3's ChatML
  writes them. A template that ignores tool_calls, or raises on them, refuses tools with
  one line; it still builds."""
  (tmp_path / "json").mkdir()
  tok = load_tokenizer("template:" + _with_template(tmp_path / "json", QWEN3_TOOLS_TEMPLATE))
  assert isinstance(tok.chat, TemplateFormat)
  assert tok.chat.call_syntax == CallSyntax("json", ("<tool_call>", "</tool_call>"))
  arguments = {"expression": "1+2", "note": {"a": [1]}}
  message = {"role": "assistant", "content": "ok",
             "tool_calls": [_call("calculator", arguments), _call("python", {"code": "1"})]}
  want = _hf(tok).apply_chat_template([{"role": "user", "content": "go"}, message],
                                      chat_template=QWEN3_TOOLS_TEMPLATE, tokenize=False)
  turn = want.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
  read = tok.chat.read_tool_calls(turn + "<tool_call>not json</tool_call>")
  assert [c[2:] for c in read] == [("calculator", arguments), ("python", {"code": "1"}),
                                   (None, None)]
  assert turn[read[0][0]:read[0][1]] == tok.chat.write_tool_call("calculator", arguments)
  assert tok.chat.write_tool_call("calculator", arguments) == qwen3.chat.write_tool_call(
      "calculator", arguments)
  ids, _ = tok.encode_chat([{"role": "user", "content": "go"}, message], tools=TOOLS)
  assert _text(tok, ids) == _hf(tok).apply_chat_template(
      [{"role": "user", "content": "go"}, message], tools=TOOLS,
      chat_template=QWEN3_TOOLS_TEMPLATE, tokenize=False)
  refuses = ("{%- for m in messages %}{%- if m.tool_calls %}{{ raise_exception('no calls') }}"
             "{%- endif %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}"
             "{%- endfor %}")
  for name, template in (("plain", QWEN3_TEMPLATE), ("raises", refuses)):
    (tmp_path / name).mkdir()
    tok = load_tokenizer("template:" + _with_template(tmp_path / name, template))
    assert tok.chat.call_syntax is None and tok.chat.read_tool_calls(turn) == []
    with pytest.raises(ValueError, match=r"does not write tool calls as <function=NAME> XML, "
                                         r"as JSON in a wrapper tag or as Gemma 4's "
                                         r"call:NAME.*tool_format=text"):
      tok.chat.check_tools(TOOLS)
    with pytest.raises(ValueError, match="tool_format=text"):
      tok.chat.write_tool_call("calculator", arguments)
    with pytest.raises(ValueError, match="tool_format=text"):
      worker_lib.RolloutWorker(_Scripted(tok, lambda t: []), tok, group_size=1,
                               max_new_tokens=4, process=(0, 1), tool_format="native")


@pytest.mark.parametrize("continuous,opens", [(True, False), (False, False), (True, True)])
def test_native_tool_rollout_is_the_templates_xml_calls(request, continuous, opens):
  """tool_format=native with the XML template: the prompt lists the tool as the template
  does, the model calls it in <function=...> XML and reads the bare result in a
  <tool_response>; the transcript is the template's rendering of that conversation with
  tools, and the call scores as a valid protocol call (also where the generation prompt
  opens the <think> block, the model writing on from it)."""
  qwen35, template = _variant(request, opens)
  tasks = {_task(p).metadata["call"]: _task(p) for p in TOOL_PAIRS}

  def reply(text):
    task = next(t for call, t in tasks.items() if f"What is {call}?" in text)
    assert "<tool>" not in text and "<name>calculator</name>" in text
    if "<tool_response>" not in text:
      call = qwen35.chat.write_tool_call("calculator", {"expression": task.metadata["call"]})
      return qwen35.encode(f"<think>\nneed a tool\n</think>\n\n{call}") + [qwen35.eos_id]
    return qwen35.encode(f"<think>\ngot it\n</think>\n\n<answer>{task.answer}</answer>"
                         ) + [qwen35.eos_id]

  samples, _ = _rollout(_Scripted(qwen35, reply), qwen35, pairs=TOOL_PAIRS, max_turns=3,
                        continuous=continuous, tool_format="native", new=256)
  assert len(samples) == 4
  for s in samples:
    task = next(t for call, t in tasks.items()
                if f"What is {call}?" in _text(qwen35, s.prompt_tokens))
    question = registry.get(task.domain).native_tools(task)[0]
    convo = [{"role": "user", "content": question},
             {"role": "assistant", "reasoning_content": "need a tool", "content": "",
              "tool_calls": [_call("calculator", {"expression": task.metadata["call"]})]},
             {"role": "tool", "content": task.answer},
             {"role": "assistant", "reasoning_content": "got it",
              "content": f"<answer>{task.answer}</answer>"}]
    want = _hf(qwen35).apply_chat_template(convo, tools=[NATIVE_TOOLS["calculator"]],
                                           chat_template=template, tokenize=False)
    assert _text(qwen35, s.prompt_tokens + s.response_tokens) + "\n" == want
    assert s.text.startswith(f"<tool>calculator: {task.metadata['call']}</tool>")
    assert s.reasoning == "need a tool\n\ngot it"
    assert s.reward.value == 1.0 and s.reward.components["tool_valid"] == 1.0


@pytest.mark.parametrize("opens", [False, True])
def test_native_tool_demonstration_is_the_templates(request, opens):
  """The SFT demonstration with tool_format=native starts at the rollouts' prompt, then
  the model's XML call, the tool's answer and the answer; the call and the answer are
  trained, the tool's answer is not. Rendered whole as the template renders the
  conversation with tools; where the generation prompt opens <think>, turn by turn as a
  rollout's transcript holds them (each turn as the template writes it after its
  prompt: an empty block closed, then the turn), since the template shows an earlier
  turn without the block its prompt opened."""
  from posttrain import trainer
  tok, template = _variant(request, opens)
  w = worker_lib.RolloutWorker(_Scripted(tok, lambda t: []), tok, group_size=1,
                               max_new_tokens=4, process=(0, 1), tool_format="native")
  try:
    ex = trainer._sft_example(["tools/calc_l1"], tok, 1, tool_format="native")
    task = registry.get("tools/calc_l1").sample(2)
    prompt = w.prompt_tokens(task)
  finally:
    w.close()
  assert ex["prompt_tokens"].tolist() == prompt
  question = registry.get("tools/calc_l1").native_tools(task)[0]
  arguments = {"expression": task.metadata["call"]}
  think = {"reasoning_content": ""} if opens else {}
  convo = [{"role": "user", "content": question},
           {"role": "assistant", "content": "", "tool_calls": [_call("calculator", arguments)],
            **think},
           {"role": "tool", "content": task.answer},
           {"role": "assistant", "content": f"<answer>{task.answer}</answer>", **think}]
  hf, tools = _hf(tok), [NATIVE_TOOLS["calculator"]]

  def render(messages, prompt=False):
    return hf.apply_chat_template(messages, tools=tools, chat_template=template,
                                  add_generation_prompt=prompt, tokenize=False)

  if opens:
    def turn(i):  # what the model writes after the prompt of turn i, its end included
      full, before = render(convo[:i + 1]), render(convo[:i], prompt=True)
      assert full.startswith(before) and before.endswith("<think>\n")
      return full[len(before):full.index("<|im_end|>", len(before)) + len("<|im_end|>")]

    tool = _text(tok, tok.chat.continuation([convo[2]], ended=True))
    assert tool.startswith("\n<|im_start|>user\n<tool_response>") and tool.endswith("<think>\n")
    want = render(convo[:1], prompt=True) + turn(1) + tool + turn(3)
  else:
    want = render(convo)
  assert _text(tok, ex["prompt_tokens"].tolist() + ex["response_tokens"].tolist()) == want
  trained = _text(tok, ex["response_tokens"][ex["response_mask"] != 0].tolist())
  # Each turn's block: the model's whole, or after the "<think>\n" its prompt opens (the
  # call's turn then shows one too).
  block = "\n</think>\n\n" if opens else "<think>\n\n</think>\n\n"
  assert trained == ((block if opens else "") + tok.chat.write_tool_call("calculator", arguments)
                     + f"<|im_end|>{block}<answer>{task.answer}</answer><|im_end|>")


# Gemma 4's call syntax in a stand-in template: a model turn's tool_calls rendered as
# <|tool_call>call:NAME{key:value,...}<tool_call|>, strings between <|"|> marks, keys bare.
GEMMA4_CALLS = (
    "{%- macro value(v) -%}{%- if v is string -%}{{ '<|\"|>' + v + '<|\"|>' }}"
    "{%- elif v is mapping -%}{{ '{' }}{%- for k, x in v | items -%}{{ k }}:{{ value(x) }}"
    "{{ ',' if not loop.last }}{%- endfor -%}{{ '}' }}"
    "{%- elif v is sequence -%}{{ '[' }}{%- for x in v -%}{{ value(x) }}"
    "{{ ',' if not loop.last }}{%- endfor -%}{{ ']' }}"
    "{%- else -%}{{ v | tojson }}{%- endif -%}{%- endmacro -%}"
    "{{- bos_token -}}{%- for message in messages -%}"
    "{{- '<|turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' "
    "+ (message['content'] or '') -}}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{{- '<|tool_call>call:' + call['function']['name'] + value(call['function']['arguments'])"
    " + '<tool_call|>' -}}{%- endfor -%}{{- '<turn|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|turn>model\\n' -}}{%- endif -%}")


def _gemma_call(name, arguments):
  """A call as Gemma 4 writes it (keys bare, strings between <|"|> marks)."""
  def value(v):
    if isinstance(v, str):
      return '<|"|>' + v + '<|"|>'
    if isinstance(v, dict):
      return "{" + ",".join(f"{k}:{value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
      return "[" + ",".join(value(x) for x in v) + "]"
    return json.dumps(v)
  return f"<|tool_call>call:{name}{value(arguments)}<tool_call|>"


def test_gemma4_calls_are_read_and_written_as_its_template_renders_them(tmp_path):
  from tests.data.bpe import write_folder
  specials = ["<bos>", "<eos>", "<|turn>", "<turn|>", "<|tool_call>", "<tool_call|>"]
  write_folder(tmp_path, specials, ["call: probe value get_weather Paris"],
               {"chat_template": GEMMA4_CALLS, "bos_token": "<bos>", "eos_token": "<eos>"})
  tok = load_tokenizer(str(tmp_path))
  assert isinstance(tok.chat, TemplateFormat)
  assert tok.chat.call_syntax == CallSyntax("gemma", ("<|tool_call>", "<tool_call|>"))
  args = {"location": "Paris, {FR}: north", "days": 3, "opts": {"deep": True, "tags": ["a"]}}
  written = tok.chat.write_tool_call("get_weather", args)
  assert written == _gemma_call("get_weather", args)
  text = "Checking. " + written + " and " + _gemma_call("ping", {})
  assert [(n, a) for _, _, n, a in tok.chat.read_tool_calls(text)] == [
      ("get_weather", args), ("ping", {})]
  start, end, _, _ = tok.chat.read_tool_calls(text)[0]
  assert text[start:end] == written


_KEYS = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,6}", fullmatch=True)
_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6)
    | st.floats(allow_nan=False, allow_infinity=False, width=32)
    | st.text(st.characters(blacklist_characters='"|', blacklist_categories=("Cs",)),
              max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_KEYS, inner, max_size=3),
    max_leaves=8)


@settings(max_examples=150, deadline=None)
@given(name=_KEYS, arguments=st.dictionaries(_KEYS, _VALUES, max_size=4))
def test_gemma4_calls_read_back_what_was_written(name, arguments):
  from posttrain.data.templates import read_gemma_calls
  text = "a " + _gemma_call(name, arguments) + " b"
  [(start, end, got_name, got)] = read_gemma_calls(text)
  assert (got_name, got) == (name, arguments)
  assert text[start:end] == _gemma_call(name, arguments)


def test_gemma4_calls_that_do_not_read_are_calls_without_a_name():
  from posttrain.data.templates import read_gemma_calls
  calls = read_gemma_calls('<|tool_call>call:f{x:<|"|>never closed}<tool_call|>'
                           "<|tool_call>nonsense<tool_call|>"
                           "<|tool_call>call:g[1,2]<tool_call|>"
                           "<|tool_call>call:h{x:1}")  # never closed: no call
  assert [(n, a) for _, _, n, a in calls] == [(None, None)] * 3
