"""Tokenizers and chat templates that return a loss mask with the token ids.

Two tokenizers share one interface:
  * `ByteTokenizer`: no files; ids 0..255 are bytes, specials follow (roles, pad, eos).
    The embedded default and the tests use it.
  * `HFTokenizer`: a Hugging Face `tokenizer.json` through the `tokenizers` package, with the
    Llama 3, ChatML (Qwen), Gemma or harmony (gpt-oss) chat format picked from the
    vocabulary.

`encode_chat(messages)` returns (ids, mask) where mask[i] = 1 exactly for tokens the model
itself produced (assistant content and its end-of-turn token): the SFT and RL loss mask. An
assistant message with `"weight": 0` (the OpenAI fine-tuning format's flag) is context,
masked like a user turn.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from typing import Sequence

Message = dict  # {"role": "system"|"user"|"assistant"|"tool", "content": str}

# Harmony (gpt-oss): the system message its chat template always opens with (without the
# current date, so that a prompt's ids do not change from day to day). A conversation's
# own system message becomes a developer message, "# Instructions\n\n" + its content.
# The model's turn opens with "<|start|>assistant" and the model picks its channels
# (analysis, then final); a given assistant message is a final-channel message. Every
# assistant message ends with <|return|>, as the model ends its turn (harmony's template
# rewrites an earlier turn's as <|end|>); <|return|> and <|call|> stop a turn.
HARMONY_SYSTEM = ("You are ChatGPT, a large language model trained by OpenAI.\n"
                  "Knowledge cutoff: 2024-06\n\nReasoning: medium\n\n"
                  "# Valid channels: analysis, commentary, final. Channel must be included "
                  "for every message.")
ROLES = ("system", "user", "assistant", "tool")


class ChatFormat:
  """A chat layout: per-role header tokens, an end-of-turn token, and plain-text glue.

  `fold_system` (Gemma, whose template has no system turn): a leading system message
  becomes the start of the first user turn, "<system>\n\n<user>". `strip`: contents are
  stripped of surrounding whitespace, as Gemma's template trims them. `ends`: end-of-turn
  tokens of particular roles (harmony's assistant ends with <|return|>);
  `generation_header`: what opens the turn the model writes, when it is not the
  assistant's header (harmony's leaves the channel to the model).
  """

  def __init__(self, tok: "Tokenizer", headers: dict[str, list[int]], end_of_turn: list[int],
               after_end: list[int] = (), bos: list[int] = (), fold_system: bool = False,
               strip: bool = False, ends: dict[str, list[int]] | None = None,
               generation_header: list[int] | None = None):
    self.tok, self.headers, self.end_of_turn = tok, headers, list(end_of_turn)
    self.after_end, self.bos = list(after_end), list(bos)
    self.fold_system, self.strip = fold_system, strip
    self.ends = {role: list(end) for role, end in (ends or {}).items()}
    self.generation_header = list(headers["assistant"] if generation_header is None
                                  else generation_header)

  def encode(self, messages: Sequence[Message], add_generation_prompt: bool = False
             ) -> tuple[list[int], list[int]]:
    ids, mask = list(self.bos), [0] * len(self.bos)
    prefix = ""
    if (self.fold_system and len(messages) > 1 and messages[0].get("role") == "system"
        and messages[1].get("role") == "user" and isinstance(messages[0].get("content"), str)):
      prefix, messages = messages[0]["content"] + "\n\n", messages[1:]
    for m in messages:
      role, content = m.get("role"), m.get("content", "")
      if role not in self.headers:
        raise ValueError(f"unknown chat role {role!r}; expected one of {ROLES}")
      if not isinstance(content, str):
        raise ValueError(f"message content must be a string, got {type(content).__name__}")
      if self.strip:
        content = content.strip()
      body = self.tok.encode(prefix + content) + self.ends.get(role, self.end_of_turn)
      prefix = ""
      own = 1 if role == "assistant" and m.get("weight", 1) else 0
      ids += self.headers[role] + body + self.after_end
      mask += [0] * len(self.headers[role]) + [own] * len(body) + [0] * len(self.after_end)
    if add_generation_prompt:
      ids += self.generation_header
      mask += [0] * len(self.generation_header)
    return ids, mask


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

  def encode_chat(self, messages: Sequence[Message], add_generation_prompt: bool = False
                  ) -> tuple[list[int], list[int]]:
    """Token ids and the model-token mask of a conversation."""
    return self.chat.encode(messages, add_generation_prompt)

  @property
  def fingerprint(self) -> str | None:
    """A string that changes whenever this tokenizer's ids for some text could change; it
    keys the tokenized-data cache (`posttrain.data.sft`). None: unknown, data it tokenizes
    is not cached."""
    return None

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """Tokens that end an assistant turn."""
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
  """A `tokenizer.json` (Hugging Face `tokenizers`) with the Llama 3, ChatML, Gemma or
  harmony (gpt-oss) format."""

  def __init__(self, path: str):
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

    if tid("<|start_header_id|>") is not None:  # Llama 3.
      start, end = tid("<|start_header_id|>"), tid("<|end_header_id|>")
      headers = {r: [start] + self.encode(r) + [end] + self.encode("\n\n") for r in ROLES}
      headers["tool"] = [start] + self.encode("ipython") + [end] + self.encode("\n\n")
      eot = tid("<|eot_id|>")
      bos = [tid("<|begin_of_text|>")] if tid("<|begin_of_text|>") is not None else []
      self.chat = ChatFormat(self, headers, [eot], bos=bos)
      self.eos_id = eot
    elif tid("<|im_start|>") is not None:  # ChatML: Qwen.
      start, end = tid("<|im_start|>"), tid("<|im_end|>")
      headers = {r: [start] + self.encode(r + "\n") for r in ROLES}
      self.chat = ChatFormat(self, headers, [end], after_end=self.encode("\n"))
      self.eos_id = end
    elif tid("<start_of_turn>") is not None:  # Gemma: the assistant is "model"; no system
      start, end = tid("<start_of_turn>"), tid("<end_of_turn>")  # or tool turns of its own.
      headers = {r: [start] + self.encode(r + "\n") for r in ("user", "system")}
      headers["assistant"] = [start] + self.encode("model\n")
      headers["tool"] = headers["user"]
      bos = [tid("<bos>")] if tid("<bos>") is not None else []
      self.chat = ChatFormat(self, headers, [end], after_end=self.encode("\n"), bos=bos,
                             fold_system=True, strip=True)
      self.eos_id = end
      # Gemma's generation config stops at <eos> too.
      self.extra_stop_ids = [tid("<eos>")] if tid("<eos>") is not None else []
    elif tid("<|channel|>") is not None and tid("<|start|>") is not None:  # harmony
      start, message, end = tid("<|start|>"), tid("<|message|>"), tid("<|end|>")
      ret, call = tid("<|return|>"), tid("<|call|>")
      channel = tid("<|channel|>")
      headers = {
          "system": [start] + self.encode("developer") + [message]
          + self.encode("# Instructions\n\n"),
          "user": [start] + self.encode("user") + [message],
          "assistant": [start] + self.encode("assistant") + [channel] + self.encode("final")
          + [message],
          "tool": [start] + self.encode("functions to=assistant") + [channel]
          + self.encode("commentary") + [message]}
      system = [start] + self.encode("system") + [message] + self.encode(HARMONY_SYSTEM) + [end]
      self.chat = ChatFormat(self, headers, [end], bos=system, ends={"assistant": [ret]},
                             generation_header=[start] + self.encode("assistant"))
      self.eos_id = ret
      self.extra_stop_ids = [call] if call is not None else []
    else:
      raise ValueError(f"{file}: no Llama 3, ChatML, Gemma or harmony special tokens; cannot "
                       "build a chat format")
    pad = cfg.get("pad_token")
    pad = pad.get("content") if isinstance(pad, dict) else pad
    self.pad_id = tid(pad) if pad and tid(pad) is not None else self.eos_id

  @functools.cached_property
  def fingerprint(self) -> str:
    """sha256 of the tokenizer files' names and bytes (read once)."""
    digest = hashlib.sha256(type(self).__name__.encode())
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


def load_tokenizer(spec: str) -> Tokenizer:
  """'byte' for the built-in tokenizer, else a folder or tokenizer.json path."""
  if spec in ("byte", "", None):
    return ByteTokenizer()
  return HFTokenizer(spec)
