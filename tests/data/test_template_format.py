"""Chat formats rendered by the tokenizer's own template (`posttrain.data.templates`):
the ids are transformers' apply_chat_template's, the mask holds each assistant turn's
content and the token that closes it, a rollout's continuation is what the template puts
after a model turn, and templates or tokenizers it cannot use give one-line errors.
Templates: OLMo 2's (Tülu turns in plain text, closed by eos) and OLMo 3.1 Instruct's
(ChatML with a default system message, the last assistant turn closed by eos), forced
with the "template:" prefix over the ChatML format its tokens would pick."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.data import load_tokenizer
from posttrain.data.templates import TemplateFormat
from tests.data.bpe import write_folder

transformers = pytest.importorskip("transformers")

OLMO2 = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}"
         "{{ '<|system|>\n' + message['content'] + '\n' }}"
         "{% elif message['role'] == 'user' %}{{ '<|user|>\n' + message['content'] + '\n' }}"
         "{% elif message['role'] == 'assistant' %}{% if not loop.last %}"
         "{{ '<|assistant|>\n'  + message['content'] + eos_token + '\n' }}{% else %}"
         "{{ '<|assistant|>\n'  + message['content'] + eos_token }}{% endif %}{% endif %}"
         "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
         "{% endfor %}")
OLMO3 = (
    "{%- set has_system = messages|selectattr('role', 'equalto', 'system')|list|length > 0 -%}"
    "{%- if not has_system -%}{{- '<|im_start|>system\nYou are Olmo, a helpful AI assistant "
    "built by Ai2. ' -}}{%- if tools is none or (tools | length) == 0 -%}{{- 'You do not "
    "currently have access to any functions. <functions></functions><|im_end|>\n' -}}"
    "{%- else -%}{{- 'You are provided with function signatures within <functions>"
    "</functions> XML tags.' -}}{{- '<functions>' -}}{{- tools | tojson -}}"
    "{{- '</functions><|im_end|>\n' -}}{%- endif -%}{%- endif -%}"
    "{%- for message in messages -%}{%- if message['role'] == 'system' -%}"
    "{{- '<|im_start|>system\n' + message['content'] -}}{%- if tools is not none -%}"
    "{{- '<functions>' -}}{{- tools | tojson -}}{{- '</functions>' -}}{%- endif -%}"
    "{{- '<|im_end|>\n' -}}{%- elif message['role'] == 'user' -%}"
    "{{- '<|im_start|>user\n' + message['content'] + '<|im_end|>\n' -}}"
    "{%- elif message['role'] == 'assistant' -%}{{- '<|im_start|>assistant\n' -}}"
    "{%- if message.get('content', none) is not none -%}{{- message['content'] -}}{%- endif -%}"
    "{%- if not loop.last -%}{{- '<|im_end|>' + '\n' -}}{%- else -%}{{- eos_token -}}"
    "{%- endif -%}{%- elif message['role'] == 'tool' -%}"
    "{{- '<|im_start|>environment\n' + message['content'] + '<|im_end|>\n' -}}{%- endif -%}"
    "{%- if loop.last and add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}"
    "{%- endif -%}{%- endfor -%}")
CONVO = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "It is 4."},
         {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6!"}]


def _folder(path, specials, template, bos="<|endoftext|>", eos="<|endoftext|>"):
  write_folder(path, specials, ["<|user|>\n<|assistant|>\n<|system|>\n", "It is 4. And 3+3? 6!",
                                "You are Olmo, a helpful AI assistant built by Ai2."],
               {"chat_template": template, "bos_token": bos, "eos_token": eos, "pad_token": eos})
  return transformers.PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"),
                                              bos_token=bos, eos_token=eos)


def _theirs(hf, template, convo, prompt):
  out = hf.apply_chat_template(convo, chat_template=template, tokenize=True,
                               add_generation_prompt=prompt)
  return list(out["input_ids"] if hasattr(out, "keys") else out)


def _own_text(tok, ids, mask):
  return tok._tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)


def test_olmo2_tulu_template_is_rendered_by_the_template(tmp_path):
  """No chat special tokens but a template: the template renders it, id for id; each
  assistant turn's content and its closing eos are the model's own, the text headers
  and the newline after eos are not."""
  hf = _folder(tmp_path, ["<|endoftext|>", "<|pad|>"], OLMO2)
  tok = load_tokenizer(str(tmp_path))
  assert isinstance(tok.chat, TemplateFormat)
  for prompt in (True, False):
    convo = CONVO[:4] if prompt else CONVO
    ids, mask = tok.encode_chat(convo, add_generation_prompt=prompt)
    assert ids == _theirs(hf, OLMO2, convo, prompt)
  assert _own_text(tok, ids, mask) == "It is 4.<|endoftext|>6!<|endoftext|>"
  eos = tok._tok.token_to_id("<|endoftext|>")
  assert tok.eos_id == eos and tok.chat.end_of_turn == [eos]
  assert tok._tok.decode(tok.chat.generation_prompt()) == "<|assistant|>\n"
  # A rollout's next turn after the model's: the newline the template puts after its eos,
  # the user turn and the generation prompt; eos first when the model did not write it.
  more = tok.chat.continuation([{"role": "user", "content": "ok"}])
  assert tok._tok.decode(more, skip_special_tokens=False) == \
      "\n<|user|>\nok\n<|assistant|>\n"
  cut = tok.chat.continuation([{"role": "user", "content": "ok"}], ended=False)
  assert cut == [eos] + more


def test_olmo3_template_forced_over_chatml(tmp_path):
  """OLMo 3's tokens would pick Qwen's ChatML; "template:" renders its own template: a
  default system message, tool results as "environment" turns, and the last assistant
  turn closed by eos instead of <|im_end|>, both the model's own."""
  specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
  hf = _folder(tmp_path, specials, OLMO3)
  assert load_tokenizer(str(tmp_path)).chat.name == "ChatML"
  tok = load_tokenizer(f"template:{tmp_path}")
  assert tok.chat.name == "template"
  convo = CONVO[1:3] + [{"role": "tool", "content": "4"}, {"role": "user", "content": "ok"},
                        {"role": "assistant", "content": "Done."}]
  for prompt, messages in ((True, convo[:-1]), (False, convo)):
    ids, mask = tok.encode_chat(messages, add_generation_prompt=prompt)
    assert ids == _theirs(hf, OLMO3, messages, prompt)
  text = tok._tok.decode(ids, skip_special_tokens=False)
  assert text.startswith("<|im_start|>system\nYou are Olmo")
  assert "<|im_start|>environment\n4<|im_end|>" in text
  assert _own_text(tok, ids, mask) == "It is 4.<|im_end|>Done.<|endoftext|>"
  end = tok._tok.token_to_id("<|im_end|>")
  assert tok.eos_id == end and tok._tok.token_to_id("<|endoftext|>") in tok.stop_ids
  # A turn given weight 0 is context.
  quiet = [dict(m, weight=0) if m["role"] == "assistant" else m for m in convo]
  assert sum(tok.encode_chat(quiet)[1]) == 0
  # The forced format is part of the tokenized-data cache's key.
  assert tok.fingerprint != load_tokenizer(str(tmp_path)).fingerprint


def test_what_the_template_format_refuses(tmp_path):
  hf_dir = tmp_path / "a"
  hf_dir.mkdir()
  _folder(hf_dir, ["<|endoftext|>"], "{{ raise_exception('only user turns') }}")
  with pytest.raises(ValueError, match="the chat template refused the conversation: only "
                                       "user turns"):
    load_tokenizer(str(hf_dir))
  bad = tmp_path / "b"
  bad.mkdir()
  _folder(bad, ["<|endoftext|>"], "{% for m in messages %}{{ m['content'] ")
  with pytest.raises(ValueError, match="chat template does not compile"):
    load_tokenizer(str(bad))
  none = tmp_path / "c"
  none.mkdir()
  _folder(none, ["<|endoftext|>"], "")
  with pytest.raises(ValueError, match="no chat template; cannot build a chat format"):
    load_tokenizer(str(none))
  ok = tmp_path / "d"
  ok.mkdir()
  _folder(ok, ["<|endoftext|>"], OLMO2)
  tok = load_tokenizer(str(ok))
  with pytest.raises(ValueError, match="use rollout.tool_format=text"):
    tok.chat.check_tools([{}])
  with pytest.raises(ValueError, match="unknown chat role 'robot'"):
    tok.encode_chat([{"role": "robot", "content": "x"}])
  with pytest.raises(ValueError, match="thinking must be None, True or False"):
    tok.encode_chat(CONVO[:2], add_generation_prompt=True, thinking="high")


# OLMo 3 Think's layout: ChatML whose generation prompt opens the reasoning block.
THINK = ("{%- for message in messages -%}{{- '<|im_start|>' + message['role'] + '\n' + "
         "message['content'] + '<|im_end|>\n' -}}{%- endfor -%}"
         "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n<think>' -}}{%- endif -%}")
# Qwen3's switch: enable_thinking=false closes an empty block in the generation prompt.
SWITCH = ("{%- for message in messages -%}{{- '<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>\n' -}}{%- endfor -%}"
          "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}"
          "{%- if enable_thinking is defined and enable_thinking is false -%}"
          "{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}{%- endif -%}")


def test_a_prompt_that_opens_reasoning_splits_completions_after_it(tmp_path):
  """A generation prompt ending in <think>: a completion is reasoning up to </think>, the
  answer after it; one cut off before </think> has no content and is not closed."""
  specials = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|endoftext|>"]
  hf = _folder(tmp_path, specials, THINK)
  tok = load_tokenizer(f"template:{tmp_path}")
  prompt, _ = tok.encode_chat(CONVO[1:2], add_generation_prompt=True)
  assert prompt == _theirs(hf, THINK, CONVO[1:2], True)
  assert tok.chat.reasoning == "think" and tok.chat.opens_reasoning
  done = tok.split_response(tok.encode("2 and 2 make 4.</think>It is 4.") + [tok.eos_id],
                            prompt)
  assert (done.content, done.reasoning, done.closed) == ("It is 4.", "2 and 2 make 4.", True)
  cut = tok.split_response(tok.encode("2 and 2"), prompt)
  assert (cut.content, cut.reasoning, cut.closed) == ("", "2 and 2", False)
  # A finished turn shows no <think> of the prompt's: the model's tokens start after the
  # header the two share.
  ids, mask = tok.encode_chat(CONVO[1:3])
  assert ids == _theirs(hf, THINK, CONVO[1:3], False)
  assert _own_text(tok, ids, mask) == "It is 4.<|im_end|>"


def test_thinking_is_the_templates_enable_thinking(tmp_path):
  specials = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|endoftext|>"]
  hf = _folder(tmp_path, specials, SWITCH)
  tok = load_tokenizer(f"template:{tmp_path}")
  for thinking in (None, True, False):
    ids, _ = tok.encode_chat(CONVO[1:2], add_generation_prompt=True, thinking=thinking)
    extra = {} if thinking is None else {"enable_thinking": thinking}
    want = hf.apply_chat_template(CONVO[1:2], chat_template=SWITCH, tokenize=True,
                                  add_generation_prompt=True, **extra)
    assert ids == list(want["input_ids"] if hasattr(want, "keys") else want), thinking
  off = tok.chat.generation_prompt(False)
  assert tok._tok.decode(off, skip_special_tokens=False) == \
      "<|im_start|>assistant\n<think>\n\n</think>\n\n"
  assert not tok.chat.opens_reasoning and tok.chat.reasoning == "think"


# Gemma 4's turns (<|turn>ROLE ... <turn|>, the model's role "model"), a stand-in for its
# template; its vocabulary's thought-channel tags are what the format reads.
GEMMA4 = ("{{- bos_token -}}{%- for message in messages -%}{{- '<|turn>' + ('model' if "
          "message['role'] == 'assistant' else message['role']) + '\n' + message['content'] "
          "+ '<turn|>\n' -}}{%- endfor -%}"
          "{%- if add_generation_prompt -%}{{- '<|turn>model\n' -}}{%- endif -%}")


def test_gemma4s_thought_channel_is_the_reasoning(tmp_path):
  """A vocabulary with <|channel> and <channel|>: a completion's "<|channel>thought\n
  ...<channel|>" block is its reasoning (the channel's name left out), what follows it the
  content; a block never closed is all reasoning, not closed; none is all content."""
  specials = ["<bos>", "<eos>", "<|turn>", "<turn|>", "<|channel>", "<channel|>"]
  hf = _folder(tmp_path, specials, GEMMA4, bos="<bos>", eos="<eos>")
  tok = load_tokenizer(str(tmp_path))
  assert isinstance(tok.chat, TemplateFormat) and tok.chat.reasoning == "channel"
  assert not tok.chat.opens_reasoning
  prompt, _ = tok.encode_chat(CONVO[1:2], add_generation_prompt=True)
  assert prompt == _theirs(hf, GEMMA4, CONVO[1:2], True)
  end = tok.chat.end_of_turn
  assert tok._tok.decode(end, skip_special_tokens=False) == "<turn|>"
  done = tok.split_response(tok.encode("<|channel>thought\n2 and 2 make 4.<channel|>It is 4.")
                            + end, prompt)
  assert (done.content, done.reasoning, done.closed) == ("It is 4.", "2 and 2 make 4.", True)
  assert done.reasoning_tokens == len(tok.encode("<|channel>thought\n2 and 2 make 4.<channel|>"))
  cut = tok.split_response(tok.encode("<|channel>thought\n2 and"), prompt)
  assert (cut.content, cut.reasoning, cut.closed) == ("", "2 and", False)
  plain = tok.split_response(tok.encode("It is 4.") + end, prompt)
  assert (plain.content, plain.reasoning, plain.reasoning_tokens) == ("It is 4.", "", 0)


_TEXT = st.text(alphabet=st.sampled_from(list("ab 4?!.\n")), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(turns=st.lists(st.tuples(_TEXT, _TEXT), min_size=1, max_size=3),
       system=st.one_of(st.none(), _TEXT), prompt=st.booleans())
def test_any_conversation_is_the_templates_to_the_token(tmp_path_factory, turns, system,
                                                        prompt):
  """Random text (spaces, newlines, punctuation where BPE merges across turns) in OLMo
  2's and OLMo 3's templates: the ids are transformers', and the model's own tokens are
  exactly each assistant's content and the token that closes it."""
  for name, template, specials in (
      ("olmo2", OLMO2, ["<|endoftext|>", "<|pad|>"]),
      ("olmo3", OLMO3, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"])):
    tok, hf = _TOKENIZERS.get(name) or _TOKENIZERS.setdefault(name, _load(
        tmp_path_factory.mktemp(name), template, specials))
    convo = ([{"role": "system", "content": system}] if system is not None else [])
    for user, assistant in turns:
      convo += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    if prompt:
      convo.append({"role": "user", "content": "ok"})
    ids, mask = tok.encode_chat(convo, add_generation_prompt=prompt)
    assert ids == _theirs(hf, template, convo, prompt), name
    own = [i for i, m in zip(ids, mask) if m]
    closers = [tok._tok.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>")]
    pieces, current = [], []
    for i in own:
      current.append(i)
      if i in closers:
        pieces.append(current)
        current = []
    assert not current and len(pieces) == len(turns), name
    for piece, (_, assistant) in zip(pieces, turns):
      assert tok._tok.decode(piece[:-1], skip_special_tokens=False) == assistant, name


_TOKENIZERS: dict = {}


def _load(path, template, specials):
  hf = _folder(path, specials, template)
  return load_tokenizer(f"template:{path}"), hf


def test_llama4_template_as_transformers_ships_it(tmp_path):
  """Llama 4's chat template (the one transformers' Llama4Processor ships): headers
  between <|header_start|> and <|header_end|>, each turn closed by <|eot|>. Its tokens
  name no built-in format, so the template renders it, id for id; the model's own tokens
  are each assistant turn's content and its <|eot|>; a rollout's next turn follows."""
  from transformers.models.llama4 import processing_llama4
  template = processing_llama4.chat_template
  specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|header_start|>", "<|header_end|>",
              "<|eot|>", "<|python_start|>", "<|python_end|>"]
  hf = _folder(tmp_path, specials, template, bos="<|begin_of_text|>", eos="<|eot|>")
  tok = load_tokenizer(str(tmp_path))
  assert isinstance(tok.chat, TemplateFormat)
  for prompt in (True, False):
    convo = CONVO[:4] if prompt else CONVO
    ids, mask = tok.encode_chat(convo, add_generation_prompt=prompt)
    assert ids == _theirs(hf, template, convo, prompt)
  assert tok._tok.decode(ids, skip_special_tokens=False).startswith(
      "<|begin_of_text|><|header_start|>system<|header_end|>\n\nBe brief.<|eot|>")
  assert _own_text(tok, ids, mask) == "It is 4.<|eot|>6!<|eot|>"
  eot = tok._tok.token_to_id("<|eot|>")
  assert tok.eos_id == eot and tok.chat.end_of_turn == [eot]
  assert tok._tok.decode(tok.chat.generation_prompt(), skip_special_tokens=False) == \
      "<|header_start|>assistant<|header_end|>\n\n"
  more = tok.chat.continuation([{"role": "user", "content": "ok"}])
  assert tok._tok.decode(more, skip_special_tokens=False) == (
      "<|header_start|>user<|header_end|>\n\nok<|eot|>"
      "<|header_start|>assistant<|header_end|>\n\n")
