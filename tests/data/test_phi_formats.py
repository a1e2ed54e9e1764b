"""Phi's chat formats rendered as their templates render them (through transformers'
apply_chat_template): Phi-4's ChatML with <|im_sep|>, Phi-4-mini's "<|role|>...<|end|>"
without newlines, and Phi-3 / 3.5's with them; the loss mask holds the model's own
tokens, and a conversation without a generation prompt closes with eos as the templates
close it."""

import pytest

from posttrain.data import load_tokenizer
from tests.data.bpe import write_folder

transformers = pytest.importorskip("transformers")

# Phi-4's template (text content).
PHI4 = ("{% for message in messages %}{% if (message['role'] == 'system') %}"
        "{{'<|im_start|>system<|im_sep|>' + message['content'] + '<|im_end|>'}}"
        "{% elif (message['role'] == 'user') %}"
        "{{'<|im_start|>user<|im_sep|>' + message['content'] + '<|im_end|>'}}"
        "{% elif (message['role'] == 'assistant') %}"
        "{{'<|im_start|>assistant<|im_sep|>' + message['content'] + '<|im_end|>'}}"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant<|im_sep|>' }}{% endif %}")
# Phi-4-mini-instruct's tokenizer_config.json chat_template.
PHI4_MINI = ("{% for message in messages %}{% if message['role'] == 'system' and 'tools' in "
             "message and message['tools'] is not none %}{{ '<|' + message['role'] + '|>' + "
             "message['content'] + '<|tool|>' + message['tools'] + '<|/tool|>' + '<|end|>' }}"
             "{% else %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
             "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}"
             "{% else %}{{ eos_token }}{% endif %}")
# Phi-3.5-mini-instruct's.
PHI3_5 = ("{% for message in messages %}{% if message['role'] == 'system' and "
          "message['content'] %}{{'<|system|>\n' + message['content'] + '<|end|>\n'}}"
          "{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + "
          "'<|end|>\n'}}{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + "
          "message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}"
          "{% endif %}")
CONVO = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "<answer>4</answer>"},
         {"role": "user", "content": "and 3+3?"}]
PHI_SPECIALS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|tool|>", "<|/tool|>",
                "<|endoftext|>"]


def _tokenizer(path, specials, template, eos):
  write_folder(path, specials, ["hello world", "user assistant system tool", "2+2=4 3+3"],
               {"chat_template": template, "eos_token": eos, "pad_token": eos}, 320)
  ours = load_tokenizer(str(path))
  theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"),
                                                eos_token=eos)
  return ours, theirs


def _text(tok, ids):
  return tok._tok.decode(ids, skip_special_tokens=False)


def _check_renders_as_template(ours, theirs, template, convo):
  for prompt in (True, False):
    ids, mask = ours.encode_chat(convo, add_generation_prompt=prompt)
    want = theirs.apply_chat_template(convo, chat_template=template, tokenize=False,
                                      add_generation_prompt=prompt)
    assert _text(ours, ids) == want, prompt
    assert len(ids) == len(mask)
  return ids, mask


def test_phi4_renders_as_its_template(tmp_path):
  """ChatML whose roles <|im_sep|> ends, with no newlines (not Qwen's ChatML, which a
  vocabulary with <|im_start|> alone gets); the model's tokens are its content and
  <|im_end|>, which stops a turn."""
  ours, theirs = _tokenizer(tmp_path, ["<|im_start|>", "<|im_end|>", "<|im_sep|>",
                                       "<|endoftext|>"], PHI4, "<|endoftext|>")
  assert ours.chat.name == "Phi-4"
  ids, mask = _check_renders_as_template(ours, theirs, PHI4, CONVO)
  end = ours._tok.token_to_id("<|im_end|>")
  own = [i for i, m in zip(ids, mask) if m]
  assert ours.decode(own[:-1]) == "<answer>4</answer>" and own[-1] == end == ours.eos_id
  assert ours._tok.token_to_id("<|endoftext|>") in ours.stop_ids
  prompt, _ = ours.encode_chat(CONVO[:2], add_generation_prompt=True)
  assert _text(ours, prompt).endswith("<|im_end|><|im_start|>assistant<|im_sep|>")


def test_phi4_mini_renders_as_its_template(tmp_path):
  """"<|role|>" + content + "<|end|>" with no newlines (a tool message under <|tool|>, as
  the template renders any role); without a generation prompt the conversation closes
  with the eos token, outside the mask."""
  ours, theirs = _tokenizer(tmp_path, PHI_SPECIALS, PHI4_MINI, "<|endoftext|>")
  assert ours.chat.name == "Phi"
  convo = CONVO[:3] + [{"role": "tool", "content": "4"}, {"role": "assistant",
                                                          "content": "done"}]
  ids, mask = _check_renders_as_template(ours, theirs, PHI4_MINI, convo)
  end = ours._tok.token_to_id("<|end|>")
  own = [i for i, m in zip(ids, mask) if m]
  assert own == ours.encode("<answer>4</answer>") + [end] + ours.encode("done") + [end]
  assert ids[-1] == ours._tok.token_to_id("<|endoftext|>") and mask[-1] == 0
  assert ours.eos_id == end and ours._tok.token_to_id("<|endoftext|>") in ours.stop_ids
  # A rollout's next turn: the tool's answer and the generation prompt after <|end|>.
  more = ours.chat.continuation([{"role": "tool", "content": "ok"}])
  assert _text(ours, more) == "<|tool|>ok<|end|><|assistant|>"


def test_phi3_5_renders_as_its_template(tmp_path):
  """Phi-3 and 3.5: a newline after each role token and each <|end|>."""
  ours, theirs = _tokenizer(tmp_path, PHI_SPECIALS, PHI3_5, "<|endoftext|>")
  ids, mask = _check_renders_as_template(ours, theirs, PHI3_5, CONVO)
  own = [i for i, m in zip(ids, mask) if m]
  end = ours._tok.token_to_id("<|end|>")
  assert own == ours.encode("<answer>4</answer>") + [end]
  prompt, _ = ours.encode_chat(CONVO[:2], add_generation_prompt=True)
  assert _text(ours, prompt) == "<|system|>\nbe brief<|end|>\n<|user|>\n2+2?<|end|>\n" \
                                "<|assistant|>\n"
  # Its template has no tool turns: a tool message is a user turn.
  ids, _ = ours.encode_chat([{"role": "tool", "content": "ok"}], add_generation_prompt=True)
  assert _text(ours, ids) == "<|user|>\nok<|end|>\n<|assistant|>\n"
