"""Reasoning models: Qwen3's ChatML and gpt-oss's harmony render reasoning as their chat
templates do (checked against the templates through transformers), and completions split
back into content and reasoning (checked against transformers' `parse_response`)."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.data import ByteTokenizer, load_tokenizer, reasoning
from posttrain.data.tokenizer import HARMONY_SYSTEM, harmony_system

transformers = pytest.importorskip("transformers")

# Qwen3's chat template as its tokenizer_config.json carries it, without its tools block
# (no tools are declared here) and with its longest lines broken inside the tags.
QWEN3_TEMPLATE = r"""{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string
           and not(message.content.startswith('<tool_response>')
                   and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n')
                                            .split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n'
                    + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

# gpt-oss's chat template, its text-conversation part (no tools, no tool calls), with the
# "Current date" line left out as the harmony format leaves it out.
GPT_OSS_TEMPLATE = r"""{%- macro build_system_message() -%}
    {%- if model_identity is not defined %}
        {%- set model_identity = "You are ChatGPT, a large language model trained by OpenAI." %}
    {%- endif %}
    {{- model_identity + "\n" }}
    {{- "Knowledge cutoff: 2024-06\n\n" }}
    {%- if reasoning_effort is not defined %}
        {%- set reasoning_effort = "medium" %}
    {%- endif %}
    {{- "Reasoning: " + reasoning_effort + "\n\n" }}
    {{- "# Valid channels: analysis, commentary, final. "
        + "Channel must be included for every message." }}
{%- endmacro -%}
{{- "<|start|>system<|message|>" }}
{{- build_system_message() }}
{{- "<|end|>" }}
{%- if messages[0].role == "developer" or messages[0].role == "system" %}
    {%- set developer_message = messages[0].content %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set developer_message = "" %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if developer_message %}
    {{- "<|start|>developer<|message|>" }}
    {{- "# Instructions\n\n" }}
    {{- developer_message }}
    {{- "\n\n" }}
    {{- "<|end|>" }}
{%- endif %}
{%- for message in loop_messages -%}
    {%- if message.role == 'assistant' -%}
        {%- if loop.last and not add_generation_prompt %}
            {%- if "thinking" in message %}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking
                    + "<|end|>" }}
            {%- endif %}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|return|>" }}
        {%- else %}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}
        {%- endif %}
    {%- elif message.role == 'user' -%}
        {{- "<|start|>user<|message|>" + message.content + "<|end|>" }}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|start|>assistant
{%- endif -%}"""

QWEN3_SPECIALS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|endoftext|>"]
HARMONY_SPECIALS = ["<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>",
                    "<|call|>", "<|endoftext|>"]


def _write_tokenizer(path, specials):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE(unk_token=None))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(["hello world", "user assistant system tool", "2+2=4",
                           "final analysis commentary", "let me think"] * 20, trainer)
  tok.decoder = decoders.ByteLevel()
  tok.save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps({"pad_token": specials[-1]}))
  return load_tokenizer(str(path))


def _hf(tok):
  return transformers.PreTrainedTokenizerFast(tokenizer_object=tok._tok)


def _text(tok, ids):
  return tok._tok.decode(ids, skip_special_tokens=False)


def _own(tok, ids, mask):
  return _text(tok, [i for i, m in zip(ids, mask) if m])


QWEN3_CONVOS = [
    # SFT: the last assistant message with its reasoning, given or inline.
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "reasoning_content": "\nadd them\n", "content": "\n4"}],
    [{"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"}],
    # The last message without reasoning still gets an (empty) block.
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
    # An earlier turn loses its reasoning; a later system message is a turn of its own.
    [{"role": "user", "content": "2+2?"},
     {"role": "assistant", "reasoning_content": "add", "content": "4"},
     {"role": "system", "content": "now briefer"}, {"role": "user", "content": "3+3?"},
     {"role": "assistant", "reasoning_content": "add again", "content": "6"}],
    # A tool run after the last query keeps every turn's reasoning; consecutive tool
    # answers share one user turn; a turn without reasoning gets no block.
    [{"role": "user", "content": "use the tool"},
     {"role": "assistant", "reasoning_content": "call it", "content": "<tool>1+1</tool>"},
     {"role": "tool", "content": "2"}, {"role": "tool", "content": "ok"},
     {"role": "assistant", "content": "<tool>2+2</tool>"}, {"role": "tool", "content": "4"},
     {"role": "assistant", "reasoning_content": "done", "content": "4"}],
]


@pytest.mark.parametrize("convo", QWEN3_CONVOS)
def test_qwen3_renders_reasoning_as_its_template(qwen3, convo):
  hf = _hf(qwen3)
  ids, mask = qwen3.encode_chat(convo)
  want = hf.apply_chat_template(convo, chat_template=QWEN3_TEMPLATE, tokenize=False)
  assert _text(qwen3, ids) == want
  assert ids == hf(want, add_special_tokens=False)["input_ids"]
  # The model's own tokens: each assistant turn from its think block (when rendered) to
  # its <|im_end|>; nothing of the user, system or tool turns.
  turns = want.split("<|im_start|>assistant\n")[1:]
  assert _own(qwen3, ids, mask) == "".join(t[:t.index("<|im_end|>") + 10] for t in turns)


@pytest.mark.parametrize("thinking", [None, True, False])
def test_qwen3_generation_prompt_switch(qwen3, thinking):
  convo = QWEN3_CONVOS[3][:4]
  ids, mask = qwen3.encode_chat(convo, add_generation_prompt=True, thinking=thinking)
  kw = {} if thinking is None else {"enable_thinking": thinking}
  want = _hf(qwen3).apply_chat_template(convo, chat_template=QWEN3_TEMPLATE, tokenize=False,
                                        add_generation_prompt=True, **kw)
  assert _text(qwen3, ids) == want and not any(mask[-8:])
  assert want.endswith("assistant\n<think>\n\n</think>\n\n" if thinking is False
                       else "assistant\n")


HARMONY_CONVOS = [
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "thinking": "add them", "content": "4"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
    # Earlier turns end with <|end|> and lose their reasoning.
    [{"role": "user", "content": "2+2?"},
     {"role": "assistant", "thinking": "add", "content": "4"},
     {"role": "user", "content": "3+3?"},
     {"role": "assistant", "thinking": "add again", "content": "6"}],
]


@pytest.mark.parametrize("convo", HARMONY_CONVOS)
@pytest.mark.parametrize("effort", [None, "high"])
def test_harmony_renders_reasoning_as_gpt_oss_template(harmony, convo, effort):
  ids, mask = harmony.encode_chat(convo, thinking=effort)
  kw = {} if effort is None else {"reasoning_effort": effort}
  want = _hf(harmony).apply_chat_template(convo, chat_template=GPT_OSS_TEMPLATE,
                                          tokenize=False, **kw)
  assert _text(harmony, ids) == want
  assert want.startswith(f"<|start|>system<|message|>{harmony_system(effort or 'medium')}")
  # The model writes everything after "<|start|>assistant" (channels, analysis, the final
  # message and its <|return|>) but an earlier turn's <|end|>, which the template writes
  # in place of the model's <|return|>.
  turns = want.split("<|start|>user<|message|>")[1:]
  own = []
  for t in turns:
    t = t[t.index("<|end|><|start|>assistant") + len("<|end|><|start|>assistant"):]
    own.append(t[:-len("<|end|>")] if t.endswith("<|end|>") else t)
  assert _own(harmony, ids, mask) == "".join(own)


def test_harmony_generation_prompt_and_stops(harmony):
  convo = HARMONY_CONVOS[2][:3]
  ids, mask = harmony.encode_chat(convo, add_generation_prompt=True, thinking="low")
  want = _hf(harmony).apply_chat_template(convo, chat_template=GPT_OSS_TEMPLATE, tokenize=False,
                                          add_generation_prompt=True, reasoning_effort="low")
  assert _text(harmony, ids) == want and want.endswith("<|start|>assistant")
  assert HARMONY_SYSTEM == harmony_system("medium")
  ret, call, end = (harmony._tok.token_to_id(t) for t in ("<|return|>", "<|call|>", "<|end|>"))
  assert harmony.stop_ids == tuple(sorted((ret, call))) and end not in harmony.stop_ids
  assert harmony.eos_id == ret and harmony.pad_id == harmony._tok.token_to_id("<|endoftext|>")


# --- reading completions ------------------------------------------------------------------

QWEN3_SCHEMA = {  # transformers' response schema for Qwen3 (its serving fallback)
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {"open": "<think>", "close": "</think>", "content": "text"},
        "content": {"close_pattern": r"\s*(?:<\|im_end\|>|<\|endoftext\|>)",
                    "content": "text"},
    },
}

# Text without tags: letters, digits, punctuation, spaces and newlines.
_plain = st.text(st.sampled_from("ab xy 09+=.\n\t"), max_size=12)


@settings(max_examples=80, deadline=None)
@given(lead=st.sampled_from(["", "\n", "  "]), thought=_plain, answer=_plain,
       shape=st.sampled_from(["closed", "unclosed", "none"]), stop=st.booleans())
def test_think_split_matches_transformers_parse_response(qwen3, lead, thought, answer,
                                                         shape, stop):
  text = {"closed": f"{lead}<think>{thought}</think>{answer}",
          "unclosed": f"{lead}<think>{thought}", "none": answer}[shape]
  ids = qwen3.encode(text) + ([qwen3.eos_id] if stop else [])
  hf = _hf(qwen3)
  want = hf.parse_response(_text(qwen3, ids), schema=QWEN3_SCHEMA,
                           prefix="<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n")
  got = qwen3.split_response(ids)
  assert got.content == want.get("content", "")
  # A turn that stopped inside its block: transformers keeps the stop token's text in the
  # reasoning; the stop is not reasoning.
  assert got.reasoning == want.get("reasoning_content", "").removesuffix("<|im_end|>").strip()
  assert got.closed == (shape != "unclosed")
  close = qwen3._tok.token_to_id("</think>")
  assert got.reasoning_tokens == {"closed": ids.index(close) + 1 if close in ids else 0,
                                  "unclosed": len(ids) - stop, "none": 0}[shape]


@settings(max_examples=40, deadline=None)
@given(thought=_plain, answer=_plain)
def test_think_split_reads_back_what_the_format_renders(qwen3, thought, answer):
  """A rendered assistant turn, read as a completion, gives back its content and
  reasoning; with text tags in a byte tokenizer too."""
  convo = [{"role": "user", "content": "q"},
           {"role": "assistant", "reasoning_content": thought, "content": answer}]
  ids, mask = qwen3.encode_chat(convo)
  first = mask.index(1)
  got = qwen3.split_response(ids[first:])
  assert (got.content, got.reasoning, got.closed) == (answer.strip(), thought.strip(), True)
  byte = ByteTokenizer()
  ids = byte.encode(f"<think>\n{thought}\n</think>\n\n{answer}") + [byte.eos_id]
  got = reasoning.split_think(byte, ids)
  assert (got.content, got.reasoning, got.closed) == (answer.strip(), thought.strip(), True)
  assert byte.decode(ids[:got.reasoning_tokens]).endswith("</think>")
  assert "</think>" not in byte.decode(ids[:got.reasoning_tokens - 1])


def test_think_split_of_hostile_completions(qwen3):
  byte = ByteTokenizer()
  cases = {  # text -> (content, reasoning, closed)
      "": ("", "", True),
      "</think>": ("", "", True),
      "no tags at all": ("no tags at all", "", True),
      "opened by the prompt</think>answer": ("answer", "opened by the prompt", True),
      "<think>a</think>b</think>c": ("b</think>c", "a", True),
      "<think>still thinking <think> deeper": ("", "still thinking <think> deeper", False),
      "x <think>a</think> y": ("y", "a", True),
  }
  for text, want in cases.items():
    for tok in (qwen3, byte):
      got = (qwen3.split_response(qwen3.encode(text)) if tok is qwen3
             else reasoning.split_think(byte, byte.encode(text)))
      expect = want
      if tok is qwen3:  # this vocabulary's tags are special: decoding drops stray ones
        expect = tuple(x.replace("<think>", "").replace("</think>", "") if isinstance(x, str)
                       else x for x in want)
      assert (got.content, got.reasoning, got.closed) == expect, (tok, text)


def _harmony_ids(tok, *parts):
  """Encodes text with harmony's special tokens in it, special tokens as their ids."""
  return tok.encode("".join(parts))


def test_harmony_split_reads_channels(harmony):
  tok = harmony
  full = _harmony_ids(tok, "<|channel|>analysis<|message|>add them<|end|>",
                      "<|start|>assistant<|channel|>final<|message|>4<|return|>")
  got = tok.split_response(full)
  analysis = len(_harmony_ids(tok, "<|channel|>analysis<|message|>add them<|end|>"))
  assert (got.content, got.reasoning, got.reasoning_tokens, got.closed) == (
      "4", "add them", analysis, True)
  # Cut off while thinking: no content, not closed.
  got = tok.split_response(_harmony_ids(tok, "<|channel|>analysis<|message|>add th"))
  assert (got.content, got.reasoning, got.closed) == ("", "add th", False)
  # Analysis ended but the final message never began (its header cut off).
  got = tok.split_response(_harmony_ids(tok, "<|channel|>analysis<|message|>x<|end|>",
                                         "<|start|>assistant<|channel|>fin"))
  assert (got.content, got.reasoning, got.closed) == ("", "x", False)
  # A preamble on the commentary channel is content; a message to functions.add is a call,
  # not content.
  got = tok.split_response(_harmony_ids(
      tok, "<|channel|>analysis<|message|>plan<|end|>",
      "<|start|>assistant<|channel|>commentary<|message|>checking<|end|>",
      "<|start|>assistant to=functions.add<|channel|>commentary json<|message|>{}<|call|>"))
  assert (got.content, got.reasoning, got.closed) == ("checking", "plan", True)
  assert got.calls == (("add", "{}"),)
  # A final answer with no analysis; and text with no message at all is all content.
  got = tok.split_response(_harmony_ids(tok, "<|channel|>final<|message|>4<|return|>"))
  assert (got.content, got.reasoning, got.reasoning_tokens) == ("4", "", 0)
  assert tok.split_response(tok.encode("just text")).content == "just text"


@settings(max_examples=30, deadline=None)
@given(thought=_plain, answer=_plain)
def test_harmony_split_reads_back_what_the_format_renders(harmony, thought, answer):
  convo = [{"role": "user", "content": "q"},
           {"role": "assistant", "thinking": thought, "content": answer}]
  ids, _ = harmony.encode_chat(convo)
  prompt, _ = harmony.encode_chat(convo[:1], add_generation_prompt=True)
  assert ids[:len(prompt)] == prompt
  got = harmony.split_response(ids[len(prompt):])
  assert (got.content, got.reasoning, got.closed) == (answer.strip(), thought.strip(), True)


def test_reasoning_and_switch_errors(qwen3, harmony, tmp_path):
  llama = _write_tokenizer(tmp_path, ["<|begin_of_text|>", "<|start_header_id|>",
                                      "<|end_header_id|>", "<|eot_id|>", "<|pad|>"])
  qwen25 = _write_tokenizer(tmp_path, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
  thought = [{"role": "user", "content": "q"},
             {"role": "assistant", "reasoning_content": "r", "content": "a"}]
  for tok in (llama, qwen25, ByteTokenizer()):
    with pytest.raises(ValueError, match="has no reasoning: move"):
      tok.encode_chat(thought)
    with pytest.raises(ValueError, match="no reasoning switch"):
      tok.encode_chat(thought[:1], add_generation_prompt=True, thinking=False)
  with pytest.raises(ValueError, match="a user message has no reasoning"):
    qwen3.encode_chat([{"role": "user", "content": "q", "thinking": "r"}])
  with pytest.raises(ValueError, match="None, True or False"):
    qwen3.encode_chat(thought[:1], add_generation_prompt=True, thinking="high")
  with pytest.raises(ValueError, match="gpt-oss always reasons"):
    harmony.encode_chat(thought[:1], add_generation_prompt=True, thinking=False)
  with pytest.raises(ValueError, match="channel tags"):
    harmony.encode_chat([{"role": "user", "content": "q"}, {
        "role": "assistant", "content": "<|channel|>final<|message|>4"}])
  with pytest.raises(ValueError, match="reasoning must be a string"):
    qwen3.encode_chat([{"role": "assistant", "content": "a", "reasoning_content": 3}])


@pytest.mark.parametrize("layout", ["qwen3", "llama3", "gemma", "byte"])
def test_continuation_extends_a_transcript_as_the_template_renders_it(layout, tmp_path):
  """After a model turn that ended at its stop token, a tool's answer and the next
  generation prompt are exactly what the whole conversation renders to; no second bos."""
  specials = {"qwen3": QWEN3_SPECIALS,
              "llama3": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                         "<|eot_id|>", "<|pad|>"],
              "gemma": ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<pad>"]}
  tok = ByteTokenizer() if layout == "byte" else _write_tokenizer(tmp_path, specials[layout])
  user = [{"role": "user", "content": "use the tool"}]
  said = {"role": "assistant", "content": "<tool>1+1</tool>"}
  tools = [{"role": "tool", "content": "2"}, {"role": "tool", "content": "ok"}]
  prompt, _ = tok.encode_chat(user, add_generation_prompt=True)
  whole, whole_mask = tok.encode_chat(user + [said] + tools, add_generation_prompt=True)
  model = [i for i, m in zip(whole, whole_mask) if m]
  assert model[-1] in tok.stop_ids
  assert prompt + model + tok.chat.continuation(tools) == whole
  # A turn cut off by the token limit is closed first.
  cut = tok.chat.continuation(tools, ended=False)
  assert cut == tok.chat.end_of_turn + tok.chat.continuation(tools)


def test_harmony_continuation_has_no_second_system_message(harmony):
  ids = harmony.chat.continuation([{"role": "tool", "content": "2"}])
  assert _text(harmony, ids) == ("<|start|>functions to=assistant<|channel|>commentary"
                                 "<|message|>2<|end|><|start|>assistant")


# Qwen 2.5's chat template (text conversations; its tools block and tool calls left out).
QWEN25_TEMPLATE = (r"""{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. """
    r"""You are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first)
           or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}""")


@pytest.mark.parametrize("where", ["config", "config_list", "jinja"])
def test_qwen25_default_system_message_from_its_template(tmp_path, where):
  """A ChatML template with a default system turn (Qwen 2 / 2.5) gets it in every
  conversation without a system message of its own; tool answers share a user turn."""
  tok = _write_tokenizer(tmp_path, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
  cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
  if where == "jinja":
    (tmp_path / "chat_template.jinja").write_text(QWEN25_TEMPLATE)
  else:
    cfg["chat_template"] = (QWEN25_TEMPLATE if where == "config" else
                            [{"name": "tool_use", "template": "x"},
                             {"name": "default", "template": QWEN25_TEMPLATE}])
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
  assert tok.chat.default_system is None  # read when the tokenizer loads
  tok = load_tokenizer(str(tmp_path))
  hf = _hf(tok)
  for convo in ([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
                [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}],
                [{"role": "user", "content": "use it"}, {"role": "assistant", "content": "<t>"},
                 {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}]):
    for gen in (False, True):
      ids, _ = tok.encode_chat(convo, add_generation_prompt=gen)
      want = hf.apply_chat_template(convo, chat_template=QWEN25_TEMPLATE, tokenize=False,
                                    add_generation_prompt=gen)
      assert _text(tok, ids) == want
  assert tok.chat.default_system.startswith("You are Qwen, created by Alibaba Cloud.")
  # Tool answers that carry a transcript on get no second system turn.
  assert "system" not in _text(tok, tok.chat.continuation([{"role": "tool", "content": "1"}]))


# Llama 3.1's chat template, its text-conversation part (no tool definitions or calls).
LLAMA31_TEMPLATE = r"""{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'
            + message['content'] | trim + '<|eot_id|>' }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}"""


def test_llama31_dated_system_turn_trimmed_contents_and_json_tool_answers(tmp_path):
  tok = _write_tokenizer(tmp_path, ["<|begin_of_text|>", "<|start_header_id|>",
                                    "<|end_header_id|>", "<|eot_id|>", "<|pad|>"])
  cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
  cfg["chat_template"] = LLAMA31_TEMPLATE
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
  tok = load_tokenizer(str(tmp_path))
  hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok._tok,
                                            bos_token="<|begin_of_text|>")
  for convo in ([{"role": "user", "content": " 2+2? "}, {"role": "assistant", "content": "4\n"}],
                [{"role": "system", "content": " be brief "},
                 {"role": "user", "content": "use it"},
                 {"role": "assistant", "content": "<tool>1+1</tool>"},
                 {"role": "tool", "content": ' say "2"\n'}]):
    for gen in (False, True):
      ids, mask = tok.encode_chat(convo, add_generation_prompt=gen)
      want = hf.apply_chat_template(convo, chat_template=LLAMA31_TEMPLATE, tokenize=False,
                                    add_generation_prompt=gen, date_string="26 Jul 2024")
      assert _text(tok, ids) == want
      turns = want.split("assistant<|end_header_id|>\n\n")[1:]
      assert _own(tok, ids, mask) == "".join(t[:t.index("<|eot_id|>") + 10] for t in turns
                                             if "<|eot_id|>" in t)
  # The system turn opens the conversation only: a tool answer goes on without it.
  assert "Cutting" not in _text(tok, tok.chat.continuation([{"role": "tool", "content": "1"}]))


def test_generation_config_and_base_model_stops(tmp_path):
  """A turn stops where the model's generation config says (Llama 3.1's <|eom_id|> and
  <|end_of_text|>), and ChatML's at <|endoftext|> too (how a Qwen base model ends)."""
  specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
              "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|pad|>"]
  tok = _write_tokenizer(tmp_path, specials)
  ids = {t: tok._tok.token_to_id(t) for t in specials}
  assert tok.stop_ids == (ids["<|eot_id|>"],)
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [
      ids["<|end_of_text|>"], ids["<|eom_id|>"], ids["<|eot_id|>"], 10 ** 9, True]}))
  tok = load_tokenizer(str(tmp_path))
  assert tok.stop_ids == tuple(sorted(ids[t] for t in ("<|end_of_text|>", "<|eom_id|>",
                                                       "<|eot_id|>")))
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
  assert 3 in load_tokenizer(str(tmp_path)).stop_ids
  (tmp_path / "q").mkdir()
  qwen = _write_tokenizer(tmp_path / "q", ["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
  assert qwen.stop_ids == tuple(sorted(qwen._tok.token_to_id(t)
                                       for t in ("<|im_end|>", "<|endoftext|>")))


def test_with_thinking_sets_data_files_reasoning_switch(harmony, tmp_path):
  """SFT and preference files get the rollouts' reasoning switch (gpt-oss's effort in the
  system message), and their tokenized cache tells the switch apart."""
  from posttrain.data.sft import SFTData
  from posttrain.data.tokenizer import with_thinking
  high = with_thinking(harmony, "high")
  assert with_thinking(harmony, None) is harmony
  convo = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
  assert high.encode_chat(convo) == harmony.encode_chat(convo, thinking="high")
  assert high.encode_chat(convo, thinking="low") == harmony.encode_chat(convo, thinking="low")
  assert high.fingerprint != harmony.fingerprint and high.stop_ids == harmony.stop_ids
  assert (high.vocab_size, high.eos_id) == (harmony.vocab_size, harmony.eos_id)
  path = tmp_path / "sft.jsonl"
  path.write_text(json.dumps({"messages": convo}) + "\n")
  cache = str(tmp_path / "cache")
  for tok, effort in ((harmony, "medium"), (high, "high")):
    data = SFTData.from_files(str(path), tok, row_len=256, cache_dir=cache)
    assert f"Reasoning: {effort}" in _text(harmony, data.examples[0]["prompt_tokens"].tolist())
  assert len(list((tmp_path / "cache").iterdir())) == 2
  with pytest.raises(ValueError, match="gpt-oss always reasons"):
    with_thinking(harmony, False)


# DeepSeek-R1's chat template (its Qwen and Llama distills), as tokenizer_config.json
# carries it: one line, split here between Jinja tags.
DEEPSEEK_R1_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}"
    "{% endif %}{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, "
    "system_prompt='') %}{%- for message in messages %}{%- if message['role'] == 'system' %}"
    "{% set ns.system_prompt = message['content'] %}{%- endif %}{%- endfor %}{{bos_token}}"
    "{{ns.system_prompt}}{%- for message in messages %}{%- if message['role'] == 'user' %}"
    "{%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and message['content'] is none %}"
    "{%- set ns.is_tool = false -%}{%- for tool in message['tool_calls']%}"
    "{%- if not ns.is_first %}{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + "
    "tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + "
    "tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}"
    "{%- set ns.is_first = true -%}{%- else %}{{'\\n' + '<｜tool▁call▁begin｜>' + tool['type'] + "
    "'<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + "
    "tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}"
    "{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}{%- endfor %}{%- endif %}"
    "{%- if message['role'] == 'assistant' and message['content'] is not none %}"
    "{%- if ns.is_tool %}{{'<｜tool▁outputs▁end｜>' + message['content'] + "
    "'<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}{%- else %}"
    "{% set content = message['content'] %}{% if '</think>' in content %}"
    "{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}"
    "{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}"
    "{%- if ns.is_output_first %}{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + "
    "message['content'] + '<｜tool▁output▁end｜>'}}{%- set ns.is_output_first = false %}"
    "{%- else %}{{'\\n<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}"
    "{%- endif %}{%- endif %}{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}"
    "{% endif %}{% if add_generation_prompt and not ns.is_tool %}"
    "{{'<｜Assistant｜><think>\\n'}}{% endif %}")
R1_SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
               "<think>", "</think>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
               "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
               "<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>",
               "<｜▁pad▁｜>"]

R1_CONVOS = [
    [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "add them</think>\n\n4"},
     {"role": "user", "content": "3+3?"}],
    [{"role": "user", "content": "use the tool"}, {"role": "assistant", "content": "<t>1</t>"},
     {"role": "tool", "content": "2"}, {"role": "tool", "content": "ok"},
     {"role": "assistant", "content": "done"}],
    [{"role": "user", "content": "use it"}, {"role": "assistant", "content": "<t>1</t>"},
     {"role": "tool", "content": "2"}],
]


@pytest.mark.parametrize("convo", R1_CONVOS)
@pytest.mark.parametrize("gen", [False, True])
def test_deepseek_r1_renders_as_its_template(deepseek, convo, gen):
  """DeepSeek-R1 (picked over the ChatML and Llama 3 tokens its distills' vocabularies
  also hold): bare system message, reasoning cut from history, the generation prompt
  opens <think>, tool answers as the template writes them."""
  hf = transformers.PreTrainedTokenizerFast(tokenizer_object=deepseek._tok,
                                            bos_token="<｜begin▁of▁sentence｜>")
  ids, mask = deepseek.encode_chat(convo, add_generation_prompt=gen)
  want = hf.apply_chat_template(convo, chat_template=DEEPSEEK_R1_TEMPLATE, tokenize=False,
                                add_generation_prompt=gen)
  assert _text(deepseek, ids) == want
  assert deepseek.chat.name == "DeepSeek-R1" and deepseek.stop_ids == (deepseek.eos_id,)
  own = _own(deepseek, ids, mask)
  assert own.endswith("<｜end▁of▁sentence｜>") and "<｜User｜>" not in own
  assert "tool▁output" not in own


def test_deepseek_r1_trains_reasoning_and_reads_it_back(deepseek):
  """A training conversation's last message keeps its reasoning as the model writes it
  after the generation prompt; a completion without </think> is all reasoning (the prompt
  opened the block); the model has no reasoning switch."""
  hf = transformers.PreTrainedTokenizerFast(tokenizer_object=deepseek._tok,
                                            bos_token="<｜begin▁of▁sentence｜>")
  convo = [{"role": "user", "content": "2+2?"},
           {"role": "assistant", "reasoning_content": "add them", "content": "4"}]
  ids, mask = deepseek.encode_chat(convo)
  prompt = hf.apply_chat_template(convo[:1], chat_template=DEEPSEEK_R1_TEMPLATE,
                                  tokenize=False, add_generation_prompt=True)
  assert _text(deepseek, ids) == prompt + "add them\n</think>\n\n4<｜end▁of▁sentence｜>"
  first = mask.index(1)
  assert ids[:first] == deepseek.encode_chat(convo[:1], add_generation_prompt=True)[0]
  got = deepseek.split_response(ids[first:])
  assert (got.content, got.reasoning, got.closed) == ("4", "add them", True)
  got = deepseek.split_response(deepseek.encode("still adding"))
  assert (got.content, got.reasoning, got.closed) == ("", "still adding", False)
  with pytest.raises(ValueError, match="always think"):
    deepseek.encode_chat(convo[:1], add_generation_prompt=True, thinking=False)


# Mistral-7B-Instruct-v0.3's chat template, its text-conversation part (no tools).
MISTRAL_TEMPLATE = r"""{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if (message == user_messages[-1]) and system_message is defined %}
            {{- "[INST] " + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- endif %}
{%- endfor %}"""


def test_mistral_renders_as_its_template(tmp_path):
  """Mistral's [INST] layout: the system message joins the last user message, assistant
  turns are trimmed and end in </s>, no generation prompt; a tool's answer is a user
  turn, and a transcript goes on with it after the model's </s>."""
  tok = _write_tokenizer(tmp_path, ["<s>", "</s>", "[INST]", "[/INST]", "<unk>"])
  hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok._tok, bos_token="<s>",
                                            eos_token="</s>")
  for convo in ([{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
                 {"role": "assistant", "content": " 4\n"}],
                [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
                 {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"}],
                [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]):
    for gen in (False, True):
      ids, mask = tok.encode_chat(convo, add_generation_prompt=gen)
      want = hf.apply_chat_template(convo, chat_template=MISTRAL_TEMPLATE, tokenize=False,
                                    add_generation_prompt=gen)
      assert _text(tok, ids) == want
      assistants = [m["content"].strip() for m in convo if m["role"] == "assistant"]
      assert _own(tok, ids, mask) == "".join(f" {a}</s>" for a in assistants)
  assert tok.chat.name == "Mistral" and tok.stop_ids == (tok._tok.token_to_id("</s>"),)
  said = [{"role": "user", "content": "use it"}, {"role": "assistant", "content": "<t>"}]
  whole, _ = tok.encode_chat(said + [{"role": "tool", "content": "2"}])
  assert _text(tok, whole).endswith(" <t></s>[INST] 2[/INST]")
  assert tok.encode_chat(said)[0] + tok.chat.continuation(
      [{"role": "tool", "content": "2"}]) == whole


# Qwen3's template with its tools block and its assistants' tool calls (as it ships), the
# longest lines broken inside the tags.
QWEN3_TOOLS_TEMPLATE = QWEN3_TEMPLATE.replace(
    r"""{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
""", r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        + "You are provided with function signatures within <tools></tools> XML tags:\n"
        + "<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name "
        + "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        + "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
        + "</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
""").replace(r"""        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}""", r"""        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}""")
assert QWEN3_TOOLS_TEMPLATE.count("tool_call.arguments") == 3


def test_qwen_tool_schemas_render_as_the_template_writes_them(qwen3, tmp_path):
  """tools=[schemas]: Qwen's tools block in the system turn (after the conversation's own
  system message, or Qwen 2.5's default); other formats refuse them; a model's calls are
  read back from its text."""
  from posttrain.tasks.families.tools import NATIVE_TOOLS
  tools = list(NATIVE_TOOLS.values())
  convo = [{"role": "user", "content": "27*58?"}]
  for system in ([], [{"role": "system", "content": "be brief"}]):
    for gen in (False, True):
      ids, mask = qwen3.encode_chat(system + convo, add_generation_prompt=gen, tools=tools)
      want = _hf(qwen3).apply_chat_template(system + convo, tools=tools, tokenize=False,
                                            chat_template=QWEN3_TOOLS_TEMPLATE,
                                            add_generation_prompt=gen)
      assert _text(qwen3, ids) == want and not any(mask)
  qwen25 = _write_tokenizer(tmp_path, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
  cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
  cfg["chat_template"] = QWEN25_TEMPLATE
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
  qwen25 = load_tokenizer(str(tmp_path))
  text = _text(qwen25, qwen25.encode_chat(convo, add_generation_prompt=True, tools=tools)[0])
  assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are "
                         "a helpful assistant.\n\n# Tools\n\n")
  (tmp_path / "r1").mkdir()
  for tok in (ByteTokenizer(), _write_tokenizer(tmp_path / "r1", R1_SPECIALS)):
    with pytest.raises(ValueError, match="does not render tool schemas"):
      tok.encode_chat(convo, add_generation_prompt=True, tools=tools)
  calls = qwen3.chat.read_tool_calls(
      'a<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n</tool_call>'
      "b<tool_call>not json</tool_call>")
  assert [c[2:] for c in calls] == [("calculator", {"expression": "1+2"}), (None, None)]
  assert calls[0][0] == 1


# Llama 3.1's template with its tools parts (the schemas in the first user message, a call
# as a JSON answer), as it ships, the longest lines broken inside the tags.
LLAMA31_TOOLS_TEMPLATE = LLAMA31_TEMPLATE.replace(r"""{{- bos_token }}
""", r"""{{- bos_token }}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
""").replace(r"""{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
""", r"""{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
""").replace(r"""{{- "<|eot_id|>" }}
{%- for message in messages %}""", r"""{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- set first_user_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of '
        + 'argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}""").replace(
    r"""    {%- elif message.role == "tool" or message.role == "ipython" %}""",
    r"""    {%- elif 'tool_calls' in message %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}""")
assert LLAMA31_TOOLS_TEMPLATE.count("tool_call.arguments") == 1
assert LLAMA31_TOOLS_TEMPLATE.count("Environment: ipython") == 1
assert LLAMA31_TOOLS_TEMPLATE.count("Given the following functions") == 1


def llama31_tokenizer(path):
  """A small BPE tokenizer with Llama 3's tokens and Llama 3.1's template."""
  tok = _write_tokenizer(path, ["<|begin_of_text|>", "<|start_header_id|>",
                                "<|end_header_id|>", "<|eot_id|>", "<|pad|>"])
  cfg = json.loads((path / "tokenizer_config.json").read_text())
  cfg["chat_template"] = LLAMA31_TEMPLATE
  (path / "tokenizer_config.json").write_text(json.dumps(cfg))
  del tok
  return load_tokenizer(str(path))


def test_llama31_tool_schemas_and_calls_render_as_its_template(tmp_path):
  from posttrain.tasks.families.tools import NATIVE_TOOLS
  tok = llama31_tokenizer(tmp_path)
  hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok._tok,
                                            bos_token="<|begin_of_text|>")
  tools = [NATIVE_TOOLS["calculator"]]
  call = {"name": "calculator", "arguments": {"expression": "1+2"}}
  convo = [{"role": "system", "content": "be brief"}, {"role": "user", "content": " 1+2? "},
           {"role": "assistant", "content": tok.chat.write_tool_call("calculator",
                                                                     call["arguments"])},
           {"role": "tool", "content": "3"}]
  want_convo = convo[:2] + [{"role": "assistant", "tool_calls": [{"function": call}]},
                            convo[3]]
  for gen in (False, True):
    ids, _ = tok.encode_chat(convo, add_generation_prompt=gen, tools=tools)
    want = hf.apply_chat_template(want_convo, tools=tools, chat_template=LLAMA31_TOOLS_TEMPLATE,
                                  tokenize=False, add_generation_prompt=gen,
                                  date_string="26 Jul 2024")
    assert _text(tok, ids) == want
  got = tok.chat.read_tool_calls(' {"name": "calculator", "parameters": {"expression": "4"}}')
  assert [c[2:] for c in got] == [("calculator", {"expression": "4"})]
  assert tok.chat.read_tool_calls("<answer>4</answer>") == []
