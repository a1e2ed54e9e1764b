"""Cache-free references for the sampler tests: full recomputation and numpy sampling sets."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain import models

# A larger init scale than the preset makes the random model's next-token distribution peaked
# and context dependent, so greedy paths and top-k / top-p sets are informative. Decode
# attention reads the cache in blocks of 16 keys, so rows span several blocks and skip some.
CFG = models.get_preset("tiny", init_std=0.2, attention_chunk=16, decode_chunk=16)
MAX_LEN = 64
# Lengths 1 and 16 sit on bucket edges; 17 spills into the next length bucket.
PROMPTS = [[5, 9, 2, 7, 1, 3], [11], list(range(20, 36)), list(range(40, 57)), [3, 3, 3, 8]]


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, tokens_BxT):
  return nnx.merge(graphdef, state)(tokens_BxT)


@functools.partial(jax.jit, static_argnums=0)
def _token_logprobs(graphdef, state, tokens_BxT, targets_BxT):
  return nnx.merge(graphdef, state).token_logprobs(tokens_BxT, targets_BxT)


def _right_padded(seqs):
  tokens = np.zeros((len(seqs), max(len(s) for s in seqs)), np.int32)
  for i, s in enumerate(seqs):
    tokens[i, :len(s)] = s
  return tokens


def full_logits(model, seqs):
  """Logits [len, V] for each sequence from one cache-free forward pass (right padded)."""
  logits = np.asarray(_forward(*nnx.split(model), jnp.asarray(_right_padded(seqs))), np.float64)
  return [logits[i, :len(s)] for i, s in enumerate(seqs)]


def token_logprobs(model, seqs):
  """log p(seq[t] | seq[:t]) for t >= 1, via the model's own chunked log-prob head."""
  tokens = _right_padded(seqs)
  logp = np.asarray(_token_logprobs(*nnx.split(model), tokens, np.roll(tokens, -1, axis=1)))
  return [logp[i, :len(s) - 1] for i, s in enumerate(seqs)]


def greedy_by_recomputation(model, prompts, steps):
  """Argmax decoding that reruns the whole causal model on a fixed buffer every step."""
  lens = [len(p) for p in prompts]
  buf = _right_padded([list(p) + [0] * steps for p in prompts])
  graphdef, state = nnx.split(model)
  for t in range(steps):
    logits = np.asarray(_forward(graphdef, state, jnp.asarray(buf)))
    for i, n in enumerate(lens):
      buf[i, n + t] = int(np.argmax(logits[i, n + t - 1]))
  return np.stack([buf[i, n:n + steps] for i, n in enumerate(lens)])


def reference_policy(logits_V, temperature, top_k, top_p):
  """(allowed mask, log-probs) of the distribution sample_logits should draw from."""
  z = logits_V / temperature
  order = np.argsort(-z, kind="stable")
  allowed = np.zeros(z.shape, bool)
  allowed[order[:top_k or z.size]] = True
  if top_p is not None:
    p = np.exp(z[order] - z[order].max()) * allowed[order]
    p /= p.sum()
    before = np.cumsum(p) - p
    allowed[order[before >= top_p]] = False
  logz = np.log(np.sum(np.exp(z[allowed] - z[allowed].max()))) + z[allowed].max()
  return allowed, np.where(allowed, z - logz, -np.inf)


def generated_positions(prompt, length):
  """Indices into full_logits(prompt + completion) that predict each generated token."""
  return np.arange(len(prompt) - 1, len(prompt) - 1 + length)
