"""Structured tool calls (OpenAI's and TRL's `tool_calls`, a row's `tools`) rendered as
the models' templates render them, in conversations, SFT files and preference files."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import transformers

from posttrain.data import ByteTokenizer
from posttrain.data.preference import PreferenceData
from posttrain.data.sft import SFTData, encode_conversation
from posttrain.tasks.families.tools import NATIVE_TOOLS
from tests.data.test_reasoning import (
    LLAMA31_TOOLS_TEMPLATE,
    QWEN3_TOOLS_TEMPLATE,
    _hf,
    _own,
    _text,
    llama31_tokenizer,
)

TOOLS = [NATIVE_TOOLS["calculator"]]


def _call(name, arguments, wrapped=True):
  inner = {"name": name, "arguments": arguments}
  return {"type": "function", "function": inner} if wrapped else inner


QWEN_CONVOS = [
    # A turn that only calls (null content, as OpenAI's format has it), two calls: one's
    # arguments an object, the other's their JSON text; two tool answers; the answer.
    [{"role": "user", "content": "27*58 and 1+2?"},
     {"role": "assistant", "content": None, "tool_calls": [
         _call("calculator", {"expression": "27*58"}),
         _call("calculator", '{"expression": "1+2"}')]},
     {"role": "tool", "content": "1566"}, {"role": "tool", "content": "3"},
     {"role": "assistant", "content": "<answer>1566 and 3</answer>"}],
    # Content before a call; the call given without the "function" wrapper.
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2**10?"},
     {"role": "assistant", "content": "Let me compute.",
      "tool_calls": [_call("calculator", {"expression": "2**10"}, wrapped=False)]},
     {"role": "tool", "content": "1024"},
     {"role": "assistant", "content": "<answer>1024</answer>"}],
]


def _openai(convo):
  """The conversation as the template is given it: null content as the empty string the
  template sees (Jinja renders None as "None" where the template concatenates)."""
  return [dict(m, content=m["content"] or "") for m in convo]


@pytest.mark.parametrize("convo", QWEN_CONVOS)
def test_qwen_renders_structured_calls_as_its_template(qwen3, convo):
  ids, mask = qwen3.encode_chat(convo, tools=TOOLS)
  want = _hf(qwen3).apply_chat_template(_openai(convo), tools=TOOLS, tokenize=False,
                                        chat_template=QWEN3_TOOLS_TEMPLATE)
  assert _text(qwen3, ids) == want
  # The calls are the model's own tokens: every assistant turn, whole, is trained on.
  turns = want.split("<|im_start|>assistant\n")[1:]
  assert _own(qwen3, ids, mask) == "".join(t[:t.index("<|im_end|>") + 10] for t in turns)
  # And what the model writes reads back as the calls it was given.
  first = next(m for m in convo if m.get("tool_calls"))
  calls = qwen3.chat.read_tool_calls(_own(qwen3, ids, mask))
  assert [c[2] for c in calls] == ["calculator"] * len(first["tool_calls"])


def test_llama31_renders_one_structured_call_as_its_template(tmp_path):
  tok = llama31_tokenizer(tmp_path)
  hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok._tok,
                                            bos_token="<|begin_of_text|>")
  convo = [{"role": "user", "content": "1+2?"},
           {"role": "assistant", "tool_calls": [_call("calculator", {"expression": "1+2"})]},
           {"role": "tool", "content": "3"}, {"role": "assistant", "content": "3"}]
  ids, mask = tok.encode_chat(convo, tools=TOOLS)
  want = hf.apply_chat_template(convo, tools=TOOLS, chat_template=LLAMA31_TOOLS_TEMPLATE,
                                tokenize=False, date_string="26 Jul 2024")
  assert _text(tok, ids) == want
  assert '{"name": "calculator", "parameters": {"expression": "1+2"}}' in _own(tok, ids, mask)
  two = [convo[0], dict(convo[1], tool_calls=convo[1]["tool_calls"] * 2)]
  with pytest.raises(ValueError, match="one tool call per turn, got 2"):
    tok.encode_chat(two, tools=TOOLS)
  with pytest.raises(ValueError, match="would drop its content"):
    tok.encode_chat([convo[0], dict(convo[1], content="Calling.")], tools=TOOLS)


@pytest.mark.parametrize("message, error", [
    ({"role": "assistant", "content": "", "tool_calls": []}, "non-empty list"),
    ({"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": {}}}]},
     "needs a function name"),
    ({"role": "assistant", "content": "", "tool_calls": [_call("f", 3)]},
     "arguments must be an object or its JSON text"),
    ({"role": "assistant", "content": "", "tool_calls": ["f(1)"]}, "with a 'function'"),
    ({"role": "user", "content": "", "tool_calls": [_call("f", {})]}, "only an assistant"),
])
def test_malformed_calls_fail_in_one_line(qwen3, message, error):
  with pytest.raises(ValueError, match=error) as e:
    qwen3.encode_chat([{"role": "user", "content": "q"}, message])
  assert "\n" not in str(e.value)


def test_formats_without_calls_of_their_own_refuse_them():
  convo = QWEN_CONVOS[0]
  with pytest.raises(ValueError, match="has no tool calls of its own here"):
    ByteTokenizer().encode_chat(convo)


def _parquet(path, rows):
  pq.write_table(pa.Table.from_struct_array(pa.array(rows)), path)
  return str(path)


def test_sft_rows_with_tools_and_calls_train_on_the_calls(qwen3, tmp_path):
  """A TRL tool-calling dataset as Parquet: its schemas column (here as JSON text), calls
  with null content, tool answers with their call ids; rows without calls beside them."""
  convo = json.loads(json.dumps(QWEN_CONVOS[0]))
  convo[1]["tool_calls"][0]["function"]["arguments"] = '{"expression": "27*58"}'
  rows = [{"messages": convo, "tools": json.dumps(TOOLS)},
          {"messages": [{"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "hello"}], "tools": None}]
  convo[2]["tool_call_id"] = "call_0"
  data = SFTData.from_files(_parquet(tmp_path / "tools.parquet", rows), qwen3, row_len=2048)
  want = encode_conversation(convo, qwen3, TOOLS)
  got = data.example(0)
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)
  assert "# Tools" in _text(qwen3, got["prompt_tokens"])
  trained = _text(qwen3, got["response_tokens"][got["response_mask"] != 0])
  assert trained.count("<tool_call>") == 2 and "1566 and 3" in trained
  bad = tmp_path / "bad.jsonl"
  bad.write_text(json.dumps({"messages": QWEN_CONVOS[0], "tools": "[{"}) + "\n")
  with pytest.raises(ValueError, match=r"bad\.jsonl:1: 'tools' is not valid JSON"):
    SFTData.from_files(str(bad), qwen3, row_len=512)


def test_preference_answers_may_call_tools(qwen3, tmp_path):
  prompt = [{"role": "user", "content": "27*58?"}]
  call = {"role": "assistant", "content": None,
          "tool_calls": [_call("calculator", {"expression": "27*58"})]}
  row = {"prompt": prompt, "chosen": [call], "rejected": [{"role": "assistant",
                                                           "content": "<answer>1500</answer>"}]}
  path = tmp_path / "pairs.jsonl"
  path.write_text(json.dumps(row) + "\n")
  pair = PreferenceData.from_files(str(path), qwen3, row_len=256).example(0)
  chosen = _text(qwen3, pair["chosen_tokens"][pair["chosen_mask"] != 0])
  assert chosen == ('<think>\n\n</think>\n\n<tool_call>\n{"name": "calculator", "arguments": '
                    '{"expression": "27*58"}}\n</tool_call><|im_end|>')


def test_a_tool_messages_name_reaches_the_chat_format():
  from posttrain.data.sft import parse_row
  row = {"messages": [{"role": "user", "content": "q"},
                      {"role": "assistant", "content": None,
                       "tool_calls": [_call("calculator", {"expression": "1"})]},
                      {"role": "tool", "name": "calculator", "content": "1"},
                      {"role": "assistant", "content": "1"}]}
  messages = parse_row(row, "f:1")
  assert messages[2]["name"] == "calculator" and "name" not in messages[3]
