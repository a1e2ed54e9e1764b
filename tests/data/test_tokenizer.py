import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.data import ByteTokenizer, HFTokenizer, load_tokenizer

CONVO = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "<answer>4</answer>"},
         {"role": "tool", "content": "ok"}, {"role": "assistant", "content": "done"}]


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_tokenizer_round_trips_any_text(text):
  tok = ByteTokenizer()
  ids = tok.encode(text)
  assert all(0 <= i < 256 for i in ids)
  assert tok.decode(ids) == text.encode("utf-8", "replace").decode("utf-8", "replace")


def test_chat_mask_marks_exactly_the_assistant_tokens():
  tok = ByteTokenizer()
  ids, mask = tok.encode_chat(CONVO, add_generation_prompt=True)
  assert len(ids) == len(mask)
  own = [i for i, m in zip(ids, mask) if m]
  end = tok.special_ids["<|end|>"]
  assert own == tok.encode("<answer>4</answer>") + [end] + tok.encode("done") + [end]
  assert ids[-1] == tok.special_ids["<|assistant|>"] and mask[-1] == 0
  assert end in tok.stop_ids and tok.vocab_size == 272


def test_unknown_role_is_an_error():
  with pytest.raises(ValueError, match="unknown chat role 'robot'"):
    ByteTokenizer().encode_chat([{"role": "robot", "content": "x"}])


def _write_hf_tokenizer(tmp_path, specials):
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE(unk_token=None))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(["hello world", "user assistant system tool", "2+2=4"] * 20, trainer)
  from tokenizers import decoders
  tok.decoder = decoders.ByteLevel()
  tok.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"pad_token": specials[-1]}))


@pytest.mark.parametrize("layout", ["chatml", "llama3"])
def test_hf_tokenizer_chat_formats(tmp_path, layout):
  if layout == "chatml":
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
  else:
    specials = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                "<|finetune_right_pad_id|>"]
  _write_hf_tokenizer(tmp_path, specials)
  tok = load_tokenizer(str(tmp_path))
  assert isinstance(tok, HFTokenizer)
  ids, mask = tok.encode_chat(CONVO[1:3])
  own = [i for i, m in zip(ids, mask) if m]
  eot = "<|im_end|>" if layout == "chatml" else "<|eot_id|>"
  assert tok.decode(own[:-1]) == "<answer>4</answer>"
  assert own[-1] == tok.eos_id == tok._tok.token_to_id(eot)
  assert tok.pad_id == tok._tok.token_to_id(specials[-1])
  text = tok._tok.decode(ids, skip_special_tokens=False)
  if layout == "chatml":
    assert text.startswith("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")
  else:
    assert text.startswith("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n2+2?")


# Gemma's chat template, as its tokenizer_config.json carries it (text content only).
GEMMA_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")


def test_gemma_chat_format_renders_as_its_template(tmp_path):
  """Gemma: the assistant's turns are "model" turns, a system message opens the first user
  turn, contents are trimmed; the model's own tokens are its content and <end_of_turn>,
  and <eos> stops a turn too."""
  transformers = pytest.importorskip("transformers")
  specials = ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<pad>"]
  _write_hf_tokenizer(tmp_path, specials)
  tok = load_tokenizer(str(tmp_path))
  convo = [{"role": "system", "content": "be brief"}, {"role": "user", "content": " 2+2? "},
           {"role": "assistant", "content": "<answer>4</answer>\n"},
           {"role": "user", "content": "ok"}]
  ids, mask = tok.encode_chat(convo, add_generation_prompt=True)
  hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"),
                                            bos_token="<bos>")
  want = hf.apply_chat_template(convo, chat_template=GEMMA_TEMPLATE, tokenize=False,
                                add_generation_prompt=True)
  assert tok._tok.decode(ids, skip_special_tokens=False) == want
  assert want.startswith("<bos><start_of_turn>user\nbe brief\n\n2+2?<end_of_turn>\n"
                         "<start_of_turn>model\n<answer>4</answer><end_of_turn>\n")
  own = [i for i, m in zip(ids, mask) if m]
  end = tok._tok.token_to_id("<end_of_turn>")
  assert tok.decode(own[:-1]) == "<answer>4</answer>" and own[-1] == end == tok.eos_id
  assert tok.stop_ids == tuple(sorted((end, tok._tok.token_to_id("<eos>"))))
  assert tok.pad_id == tok._tok.token_to_id("<pad>")


def test_hf_tokenizer_saves_what_loads_it_back(tmp_path):
  """An exported model folder gets the tokenizer's files: loaded from there it encodes
  and formats chats as the original does. The byte tokenizer is built in: nothing."""
  src = tmp_path / "src"
  src.mkdir()
  _write_hf_tokenizer(src, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
  tok = load_tokenizer(str(src))
  written = tok.save(str(tmp_path / "export"))
  assert sorted(os.path.basename(f) for f in written) == ["tokenizer.json",
                                                          "tokenizer_config.json"]
  again = load_tokenizer(str(tmp_path / "export"))
  assert again.encode_chat(CONVO) == tok.encode_chat(CONVO)
  assert (again.pad_id, again.eos_id, again.vocab_size) == (tok.pad_id, tok.eos_id,
                                                            tok.vocab_size)
  assert load_tokenizer("byte").save(str(tmp_path / "none")) == []
  assert not (tmp_path / "none").exists()


def test_fingerprints_change_with_what_changes_the_ids(tmp_path):
  """The tokenized-data cache's key: equal for tokenizers that encode alike, different
  otherwise."""
  assert ByteTokenizer().fingerprint == ByteTokenizer().fingerprint
  assert type("Other", (ByteTokenizer,), {})().fingerprint != ByteTokenizer().fingerprint
  for name in ("a", "b"):
    (tmp_path / name).mkdir()
    _write_hf_tokenizer(tmp_path / name, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
  a, b = load_tokenizer(str(tmp_path / "a")), load_tokenizer(str(tmp_path / "b"))
  assert a.fingerprint == b.fingerprint != ByteTokenizer().fingerprint
  (tmp_path / "b" / "tokenizer_config.json").write_text(json.dumps({"pad_token": "<|im_end|>"}))
  assert b.fingerprint == a.fingerprint  # read once, when first asked
  assert load_tokenizer(str(tmp_path / "b")).fingerprint != a.fingerprint
