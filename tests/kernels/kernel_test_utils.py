"""Shared inputs, an independent numpy oracle and tolerances for the kernel tests."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

# Errors are measured relative to max(1, max|expected|) of each output.
TOLERANCES = {
    # dtype: (forward, gradients)
    jnp.float32: (2e-5, 1e-4),
    jnp.bfloat16: (3e-2, 6e-2),
}


@dataclasses.dataclass(frozen=True)
class Case:
  """One attention configuration: shapes plus mask options."""
  name: str
  batch: int = 2
  q_len: int = 256
  kv_len: int = 256
  heads: int = 4
  kv_heads: int = 2
  head_dim: int = 32
  causal: bool = True
  segments: bool = False
  logits_soft_cap: float | None = None
  sliding_window: int | None = None

  def mask_kwargs(self, inputs):
    kw = dict(causal=self.causal, logits_soft_cap=self.logits_soft_cap,
              sliding_window=self.sliding_window)
    if self.segments:
      kw.update(q_segment_ids=inputs["q_seg"], kv_segment_ids=inputs["kv_seg"])
    return kw


def segment_ids(batch, q_len, kv_len, rng):
  """Hostile packing: several segments per row, padding (0) at the ends, and one row
  whose queries are all padding. Queries are the last q_len keys, as in the contract."""
  kv = np.zeros((batch, kv_len), np.int32)
  for row in range(batch):
    cuts = np.sort(rng.choice(np.arange(1, kv_len - 1), size=3, replace=False))
    kv[row, :cuts[0]] = 1
    kv[row, cuts[0]:cuts[1]] = 2
    kv[row, cuts[1]:cuts[2]] = 3
    # kv[row, cuts[2]:] stays 0: trailing padding.
  kv[0, :5] = 0  # leading padding too
  q = kv[:, kv_len - q_len:].copy()
  q[-1, :] = 0  # a row with no valid query at all
  q[0, :7] = 0  # padding queries inside an otherwise valid row
  return jnp.asarray(q), jnp.asarray(kv)


def make_inputs(case: Case, dtype=jnp.float32, seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  b, tq, tk, h, kvh, d = (case.batch, case.q_len, case.kv_len, case.heads, case.kv_heads,
                          case.head_dim)
  q_seg, kv_seg = segment_ids(b, tq, tk, np.random.default_rng(seed))
  return dict(
      q=jax.random.normal(ks[0], (b, tq, h, d), jnp.float32).astype(dtype),
      k=jax.random.normal(ks[1], (b, tk, kvh, d), jnp.float32).astype(dtype),
      v=jax.random.normal(ks[2], (b, tk, kvh, d), jnp.float32).astype(dtype),
      dout=jax.random.normal(ks[3], (b, tq, h, d), jnp.float32).astype(dtype),
      q_seg=q_seg, kv_seg=kv_seg)


def numpy_attention(q, k, v, *, causal=True, q_segment_ids=None, kv_segment_ids=None,
                    sm_scale=None, logits_soft_cap=None, sliding_window=None, sinks=None,
                    local_chunk=None, alibi_slopes=None):
  """Straightforward float64 numpy attention, independent of kernels/. `sinks` [heads]:
  one more softmax column per head, of that logit, whose value is dropped; `local_chunk`
  c: a query sees only keys whose position // c is its own; `alibi_slopes` [heads]: each
  logit of head h gains -slopes[h] * |query position - key position| after the cap."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, tq, h, d = q.shape
  tk, kvh = k.shape[1], k.shape[2]
  k = np.repeat(k, h // kvh, axis=2)
  v = np.repeat(v, h // kvh, axis=2)
  scale = 1 / np.sqrt(d) if sm_scale is None else sm_scale
  s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
  if logits_soft_cap is not None:
    s = logits_soft_cap * np.tanh(s / logits_soft_cap)
  qp = np.arange(tq)[:, None] + tk - tq
  kp = np.arange(tk)[None, :]
  if alibi_slopes is not None:
    slopes = np.asarray(alibi_slopes, np.float64).reshape(1, h, 1, 1)
    s = s - slopes * np.abs(qp - kp).astype(np.float64)
  mask = np.ones((b, 1, tq, tk), bool)
  if causal:
    mask &= qp >= kp
  if sliding_window is not None:
    mask &= qp - kp < sliding_window
    if not causal:
      mask &= kp - qp < sliding_window
  if local_chunk is not None:
    mask &= qp // local_chunk == kp // local_chunk
  if q_segment_ids is not None:
    qs = np.asarray(q_segment_ids)[:, None, :, None]
    ks_ = np.asarray(kv_segment_ids)[:, None, None, :]
    mask &= (qs == ks_) & (ks_ != 0)
  s = np.where(mask, s, -np.inf)
  if sinks is not None:
    column = np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None, None],
                             (*s.shape[:3], 1))
    s = np.concatenate([s, column], axis=-1)
  m = s.max(-1, keepdims=True)
  m = np.where(np.isfinite(m), m, 0)
  p = np.exp(s - m)
  l = p.sum(-1, keepdims=True)
  p = p / np.where(l == 0, 1, l)
  out = np.einsum("bhqk,bkhd->bqhd", p[..., :tk], v)
  return out


def assert_close(actual, expected, tol, what=""):
  actual = np.asarray(jnp.asarray(actual, jnp.float32))
  expected = np.asarray(jnp.asarray(expected, jnp.float32))
  assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
  assert np.all(np.isfinite(actual)), f"{what}: non-finite values"
  scale = max(1.0, float(np.max(np.abs(expected))))
  err = float(np.max(np.abs(actual - expected))) / scale
  assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.3g}"


def value_and_vjp(fn, inputs, **kwargs):
  """fn's output and its (dq, dk, dv) for the case's random cotangent, in one jit."""
  arrays = {n: kwargs.pop(n) for n in ("q_segment_ids", "kv_segment_ids") if n in kwargs}

  @jax.jit
  def run(q, k, v, dout, arrays):
    out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, **arrays, **kwargs), q, k, v)
    return out, vjp(dout.astype(out.dtype))

  return run(inputs["q"], inputs["k"], inputs["v"], inputs["dout"], arrays)


def f32_reference(inputs, **kwargs):
  """The reference on the same (possibly bf16-rounded) inputs, computed in f32."""
  from kernels import reference_attention
  f32 = {n: inputs[n].astype(jnp.float32) if n in "q k v dout".split() else inputs[n]
         for n in inputs}
  return value_and_vjp(reference_attention, f32, **kwargs)


def check_against_reference(fn, case: Case, dtype, seed=0):
  """fn's forward and gradients match the f32 reference within the dtype tolerances."""
  inputs = make_inputs(case, dtype, seed)
  kw = case.mask_kwargs(inputs)
  out, grads = value_and_vjp(fn, inputs, **kw)
  ref_out, ref_grads = f32_reference(inputs, **kw)
  fwd_tol, grad_tol = TOLERANCES[dtype]
  assert out.dtype == dtype
  assert_close(out, ref_out, fwd_tol, f"{case.name} out")
  for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads):
    assert g.dtype == dtype, name
    assert_close(g, rg, grad_tol, f"{case.name} {name}")


# Shared by the chunked and flash tests. Each case combines several features so the
# suite stays small; lengths 200 / 320 are deliberately not multiples of the blocks.
CASES = (
    Case("causal_gqa_ragged", q_len=200, kv_len=200),
    Case("noncausal_mqa_segments", heads=3, kv_heads=1, head_dim=16, causal=False,
         segments=True, q_len=128, kv_len=128),
    Case("segments_q_shorter", segments=True, q_len=128, kv_len=320),
    Case("soft_cap_sliding", logits_soft_cap=2.0, sliding_window=70, q_len=200,
         kv_len=256),
    Case("sliding_noncausal", sliding_window=50, causal=False, q_len=128, kv_len=128,
         heads=5, kv_heads=5),
    Case("long_512", q_len=512, kv_len=512, batch=1, heads=2, kv_heads=1),
)
BF16_CASES = (
    Case("bf16_causal_segments", segments=True),
    Case("bf16_soft_cap", logits_soft_cap=2.0, q_len=128, kv_len=128),
)
