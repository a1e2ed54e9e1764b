"""A learned reward model that scores rollouts on the devices.

    rm = TransformerRewardModel.from_pretrained("rm_folder", mesh=mesh, rules=rules)
    scores = rm.score_texts(prompts, completions)      # list[float], raw (unsquashed)

The model is a value-head `Transformer` (a Hugging Face `*ForSequenceClassification`
folder with one label). Each (prompt, completion) is the conversation

    [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]

encoded with `tok.encode_chat` up to its last trained token (the assistant turn's end), the
layout `posttrain.data.preference.encode_pair` gives a pair's answer: the score is the
value head's output there, where a Bradley-Terry reward model trained on pairs reads it.
Rows are sorted by length and run in buckets (lengths: powers of two and their midpoints
up to `max_len`; batch sizes: powers of two up to `batch_size`, multiples of the mesh's
batch devices), one compiled program per bucket shape. A conversation longer than
`max_len` keeps its first `max_len` tokens and is counted in `last_stats["truncated"]`.

With several processes every process must call `score_texts` with the same texts at the
same point (the rollout worker gives every process every sample's text): the programs
span every process's devices.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from posttrain import distributed, models
from posttrain.data.tokenizer import Tokenizer, load_tokenizer
from posttrain.sampling.sampler import default_length_bucket


def conversation_tokens(tok: Tokenizer, prompt: str | Sequence[dict], completion: str
                        ) -> list[int]:
  """The token ids a reward model scores: the conversation (a prompt string is one user
  turn; a list is the chat messages before the answer) and the completion as the
  assistant's turn, up to and including its last trained token (what `encode_pair` keeps
  of a pair's answer)."""
  context = ([{"role": "user", "content": prompt}] if isinstance(prompt, str)
             else [dict(m) for m in prompt])
  ids, mask = tok.encode_chat(context + [{"role": "assistant", "content": completion}])
  last = max(i for i, m in enumerate(mask) if m)  # the assistant turn's end-of-turn token
  return ids[:last + 1]


def reward_model_config(path: str) -> models.ModelConfig:
  """The ModelConfig of a reward-model folder, read from its config.json alone.

  Raises:
    ValueError: naming `path`, when it has no config.json, an architecture that cannot be
      read, or a model without a value head.
  """
  cfg, hf_cfg = models.hf.folder_config(path, f"reward model {path!r}")
  if not cfg.value_head:
    raise ValueError(f"reward model {path!r} has no value head "
                     f"(architectures {hf_cfg.get('architectures')}); expected a "
                     "*ForSequenceClassification folder with one label")
  return cfg


def folder_tokenizer(path: str) -> str | None:
  """The tokenizer a model folder holds (its path for `load_tokenizer`), or None."""
  return str(path) if os.path.exists(os.path.join(str(path), "tokenizer.json")) else None


class TransformerRewardModel:
  """Scores (prompt, completion) texts with a value-head Transformer (module docstring).

  Args:
    model: a Transformer with a value head (cfg.value_head).
    tok: encodes the conversations; its ids must fit the model's vocabulary.
    mesh: the devices to score on (the rollout mesh); rows split over the batch axes,
      parameters placed by `rules`. None: the model where it is.
    rules: logical-axis rules (default `models.DEFAULT_RULES`).
    max_len: tokens of a conversation scored (at most the model's
      max_position_embeddings); longer ones keep their head.
    batch_size: most rows one program call scores (rounded up to a multiple of the
      mesh's batch devices).
  """

  def __init__(self, model: models.Transformer, tok: Tokenizer, *, mesh=None, rules=None,
               max_len: int = 2048, batch_size: int = 32):
    cfg = model.cfg
    if not cfg.value_head:
      raise ValueError("the reward model has no value head; build it with value_head=True")
    if tok.vocab_size > cfg.vocab_size:
      raise ValueError(f"the tokenizer's {tok.vocab_size} ids do not fit the reward model's "
                       f"vocabulary of {cfg.vocab_size}")
    if int(max_len) < 1 or int(batch_size) < 1:
      raise ValueError(f"max_len={max_len} and batch_size={batch_size} must be >= 1")
    self.cfg, self.tok, self.mesh = cfg, tok, mesh
    self.rules = models.rules_from_config(rules)
    self.max_len = min(int(max_len), cfg.max_position_embeddings)
    if mesh is not None:
      model = models.shard_model(model, mesh, self.rules)
    self._graphdef, self._state = nnx.split(model)
    self._ctx = models.ShardingContext(mesh, self.rules)
    self._batch_multiple = 1
    if mesh is not None:
      axes = dict(self.rules).get("batch", ())
      self._batch_multiple = int(np.prod([mesh.shape.get(a, 1) for a in axes]))
    self.batch_size = -(-int(batch_size) // self._batch_multiple) * self._batch_multiple
    self._programs: dict[tuple[int, int], Any] = {}
    self.last_stats: dict[str, float] = {}

  @classmethod
  def from_pretrained(cls, path: str, tok: Tokenizer | None = None, *, mesh=None, rules=None,
                      dtype: str | None = None, max_len: int = 2048,
                      batch_size: int = 32) -> "TransformerRewardModel":
    """Loads a Hugging Face reward-model folder onto `mesh`.

    Args:
      path: a `*ForSequenceClassification` folder (config.json, *.safetensors).
      tok: the tokenizer; None: the folder's own (tokenizer.json).
      dtype: parameter and compute dtype (default: the checkpoint's).

    Raises:
      ValueError: naming `path`: not a reward model (see `reward_model_config`), or no
        tokenizer given and none in the folder.
    """
    reward_model_config(path)  # refuse before reading any weights
    if tok is None:
      spec = folder_tokenizer(path)
      if spec is None:
        raise ValueError(f"reward model {path!r} holds no tokenizer.json; pass a tokenizer")
      tok = load_tokenizer(spec)
    model = models.from_pretrained(str(path), mesh=mesh, rules=models.rules_from_config(rules),
                                   dtype=dtype)
    return cls(model, tok, mesh=mesh, rules=rules, max_len=max_len, batch_size=batch_size)

  @classmethod
  def from_config(cls, rm_config, *, tokenizer: Tokenizer, mesh=None, rules=None,
                  default_max_len: int = 2048) -> "TransformerRewardModel":
    """The reward model of a run config's `reward_model` section.

    `rm_config.tokenizer`: "" takes the folder's own tokenizer when it holds one, else
    `tokenizer` (the run's); otherwise a `load_tokenizer` spec ("byte", a folder, a
    tokenizer.json). `rm_config.max_len` 0 means `default_max_len`.
    """
    path = str(rm_config.path)
    spec = str(rm_config.get("tokenizer", "") or "")
    if spec:
      tok = load_tokenizer(spec)
    else:
      own = folder_tokenizer(path)
      tok = load_tokenizer(own) if own else tokenizer
    return cls.from_pretrained(path, tok, mesh=mesh, rules=rules,
                               max_len=int(rm_config.get("max_len", 0) or 0) or default_max_len,
                               batch_size=int(rm_config.get("batch_size", 32)))

  @property
  def num_compiles(self) -> int:
    """Programs compiled so far (one per bucket shape)."""
    return len(self._programs)

  def score_texts(self, prompts: Sequence[str | Sequence[dict]], completions: Sequence[str]
                  ) -> list[float]:
    """The reward model's raw score of each (prompt, completion), in input order; a prompt
    is a string (one user turn) or the chat messages before the completion."""
    if len(prompts) != len(completions):
      raise ValueError(f"got {len(prompts)} prompts but {len(completions)} completions")
    rows = [conversation_tokens(self.tok, p, c) for p, c in zip(prompts, completions)]
    return self.score_tokens(rows)

  def score_tokens(self, rows: Sequence[Sequence[int]]) -> list[float]:
    """The score at the last token of each token list (its first `max_len` tokens)."""
    truncated = sum(len(r) > self.max_len for r in rows)
    rows = [list(r[:self.max_len]) for r in rows]
    if any(not r for r in rows):
      raise ValueError("cannot score an empty token list")
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    scores = np.zeros(len(rows), np.float32)
    real = padded = 0
    pending = []
    for start in range(0, len(order), self.batch_size):
      idx = order[start:start + self.batch_size]
      length = default_length_bucket(max(len(rows[i]) for i in idx), self.max_len)
      batch = min(1 << (len(idx) - 1).bit_length(), self.batch_size)
      batch = -(-batch // self._batch_multiple) * self._batch_multiple
      tokens_BxT = np.zeros((batch, length), np.int32)
      lengths_B = np.ones((batch,), np.int32)  # padding rows: one token, score discarded
      for k, i in enumerate(idx):
        tokens_BxT[k, :len(rows[i])] = rows[i]
        lengths_B[k] = len(rows[i])
      real += int(lengths_B[:len(idx)].sum())
      padded += batch * length
      # Dispatch every bucket before fetching any: the host encodes while devices run.
      pending.append((idx, self._run(tokens_BxT, lengths_B)))
    for idx, out in pending:
      scores[idx] = self._fetch(out)[:len(idx)]
    self.last_stats = {"rows": float(len(rows)), "truncated": float(truncated),
                       "padding_fraction": 1.0 - real / padded if padded else 0.0}
    return [float(s) for s in scores]

  def _run(self, tokens_BxT: np.ndarray, lengths_B: np.ndarray) -> jax.Array:
    tokens = self._put(tokens_BxT, ("batch", None))
    lengths = self._put(lengths_B, ("batch",))
    key = tokens_BxT.shape
    if key not in self._programs:
      graphdef, ctx = self._graphdef, self._ctx

      def score(state, tokens_BxT, lengths_B):
        model = nnx.merge(graphdef, state)
        positions_BxT = jnp.broadcast_to(jnp.arange(tokens_BxT.shape[1], dtype=jnp.int32),
                                         tokens_BxT.shape)
        segment_ids_BxT = (positions_BxT < lengths_B[:, None]).astype(jnp.int32)
        return model.scores(tokens_BxT, segment_ids_BxT, positions_BxT, ctx=ctx)

      out = None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())
      jitted = jax.jit(score) if out is None else jax.jit(score, out_shardings=out)
      self._programs[key] = jitted.lower(self._state, tokens, lengths).compile()
    return self._programs[key](self._state, tokens, lengths)

  def _put(self, x: np.ndarray, names: tuple):
    if self.mesh is None:
      return jax.device_put(x)
    return distributed.put(x, self._ctx.sharding(names, x.shape))

  @staticmethod
  def _fetch(out: jax.Array) -> np.ndarray:
    # Replicated on every device: each process reads its own copy, no collective.
    return np.asarray(out.addressable_data(0))
