"""gated_linear_attention (chunked) and its per-token reference against a numpy oracle,
transformers' torch Mamba2 SSD and each other."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_test_utils import assert_close
from linear_test_utils import (Case, assert_bad_argument_raises,
                               check_packing_and_padding, cotangents, hostile_segments,
                               take_rows)

import kernels

# Errors are relative to max(1, max|expected|) (`assert_close`).
F32_TOL = 1e-5
GRAD_TOL = 1e-4
# bf16 inputs are computed in f32; the output is rounded to bf16 once (2^-8 relative).
BF16_OUT_TOL = 1e-2

chunked = jax.jit(functools.partial(kernels.gated_linear_attention,
                                    return_final_state=True),
                  static_argnames=("chunk_size", "scale"))
reference = jax.jit(functools.partial(kernels.gated_linear_attention_reference,
                                      return_final_state=True),
                    static_argnames=("scale",))


CASES = [
    Case("shorter_than_chunk", length=11, key_heads=3, value_heads=3, dk=5, dv=7,
         initial_state=False),
    Case("ragged_gqa"),  # 37 = 2 * 16 + 5, two value heads per key head
    Case("packed", chunk_size=8, segments=True),
    Case("one_token", length=1),
]
CASE = {c.name: c for c in CASES}


def make_inputs(case: Case, dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  b, t, hk, hv, dk, dv = (case.batch, case.length, case.key_heads, case.value_heads,
                          case.dk, case.dv)
  x = dict(
      q=rng.normal(size=(b, t, hk, dk)), k=rng.normal(size=(b, t, hk, dk)),
      v=rng.normal(size=(b, t, hv, dv)),
      # Mamba2's g = dt * A: mostly mild, some strong.
      g=-rng.exponential(0.3, size=(b, t, hv)))
  x = {n: jnp.asarray(a, dtype) for n, a in x.items()}
  x["initial_state"] = (jnp.asarray(rng.normal(size=(b, hv, dk, dv)), jnp.float32)
                        if case.initial_state else None)
  x["segment_ids"] = jnp.asarray(hostile_segments(b, t)) if case.segments else None
  return x


def args(x):
  return (x["q"], x["k"], x["v"], x["g"])


def kwargs(x):
  return dict(segment_ids=x["segment_ids"], initial_state=x["initial_state"])


def np_gated_linear_attention(q, k, v, g, segment_ids=None, initial_state=None,
                              scale=1.0):
  """Token by token in float64, straight from the contract."""
  q, k, v, g = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (q, k, v, g))
  b, t, hk, dk = q.shape
  hv, dv = v.shape[2:]
  q = np.repeat(q, hv // hk, axis=2) * scale
  k = np.repeat(k, hv // hk, axis=2)
  seg = np.ones((b, t), int) if segment_ids is None else np.asarray(segment_ids)
  out = np.zeros((b, t, hv, dv))
  final = np.zeros((b, hv, dk, dv))
  for row in range(b):
    s = (np.zeros((hv, dk, dv)) if initial_state is None
         else np.asarray(initial_state[row], np.float64))
    previous = None
    for i in range(t):
      if seg[row, i] == 0:
        continue
      if previous is not None and seg[row, i] != previous:
        s = np.zeros_like(s)
      previous = seg[row, i]
      s = s * np.exp(g[row, i])[:, None, None] + np.einsum("hd,he->hde", k[row, i],
                                                          v[row, i])
      out[row, i] = np.einsum("hd,hde->he", q[row, i], s)
    final[row] = s
  return out, final


@pytest.mark.parametrize("name", ["ragged_gqa", "packed", "one_token"])
def test_matches_numpy_oracle(name):
  case = CASE[name]
  x = make_inputs(case)
  want_out, want_state = np_gated_linear_attention(*args(x), **kwargs(x))
  for fn in (functools.partial(chunked, chunk_size=case.chunk_size), reference):
    out, state = fn(*args(x), **kwargs(x))
    assert_close(out, want_out, F32_TOL, "out")
    assert_close(state, want_state, F32_TOL, "final state")
  if case.segments:
    assert np.all(np.asarray(out)[np.asarray(x["segment_ids"]) == 0] == 0)


@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: c.name)
def test_chunked_matches_reference(case):
  x = make_inputs(case)
  out, state = chunked(*args(x), **kwargs(x), chunk_size=case.chunk_size)
  want_out, want_state = reference(*args(x), **kwargs(x))
  assert out.dtype == jnp.float32 and state.dtype == jnp.float32
  assert out.shape == (case.batch, case.length, case.value_heads, case.dv)
  assert state.shape == (case.batch, case.value_heads, case.dk, case.dv)
  assert_close(out, want_out, F32_TOL, "out")
  assert_close(state, want_state, F32_TOL, "final state")


def test_scale_multiplies_the_queries():
  case = CASE["shorter_than_chunk"]
  x = make_inputs(case)
  want_out, want_state = np_gated_linear_attention(*args(x), **kwargs(x), scale=0.3)
  out, state = chunked(*args(x), **kwargs(x), chunk_size=case.chunk_size, scale=0.3)
  assert_close(out, want_out, F32_TOL, "out")
  assert_close(state, want_state, F32_TOL, "final state")
  unscaled, _ = np_gated_linear_attention(*args(x), **kwargs(x))
  assert float(np.max(np.abs(unscaled - want_out))) > 1e-2  # the option matters


def test_matches_transformers_mamba2():
  torch = pytest.importorskip("torch")
  granite = pytest.importorskip(
      "transformers.models.granitemoehybrid.modeling_granitemoehybrid")
  # Mamba2 names: x [b, T, heads, P], dt [b, T, heads], A [heads], B, C [b, T, groups, N].
  case = CASE["ragged_gqa"]
  b, t, groups, heads, n, p = (case.batch, case.length, case.key_heads,
                               case.value_heads, case.dk, case.dv)
  rng = np.random.default_rng(4)
  f32 = functools.partial(np.asarray, dtype=np.float32)
  x = f32(rng.normal(size=(b, t, heads, p)))
  dt = f32(np.log1p(np.exp(rng.normal(-2.0, 1.0, size=(b, t, heads)))))  # softplus'd
  a = f32(-np.exp(rng.uniform(0.0, np.log(16.0), size=heads)))
  b_in = f32(rng.normal(size=(b, t, groups, n)))
  c_in = f32(rng.normal(size=(b, t, groups, n)))
  d = f32(rng.normal(size=heads))
  s0_bxhxpxn = f32(rng.normal(size=(b, heads, p, n)))

  want_y, want_state = granite.mamba2_chunk_scan(
      *(torch.from_numpy(z) for z in (x, dt, a, b_in, c_in)), case.chunk_size,
      D=torch.from_numpy(d), dt_bias=None, initial_states=torch.from_numpy(s0_bxhxpxn),
      dt_softplus=False, return_final_states=True)
  mapped = (jnp.asarray(c_in), jnp.asarray(b_in), jnp.asarray(x * dt[..., None]),
            jnp.asarray(dt * a))
  s0 = jnp.asarray(s0_bxhxpxn.transpose(0, 1, 3, 2))  # torch's [b, h, P, N]; ours N first
  for fn in (functools.partial(chunked, chunk_size=case.chunk_size), reference):
    o, state = fn(*mapped, initial_state=s0)
    assert_close(o + d[:, None] * x, want_y.numpy(), F32_TOL, "y = o + D x")
    assert_close(state, want_state.numpy().transpose(0, 1, 3, 2), F32_TOL, "final state")


@pytest.mark.parametrize("implementation", ["chunked", "reference"])
def test_packing_and_padding_are_transparent(implementation):
  fn = (functools.partial(chunked, chunk_size=8) if implementation == "chunked"
        else reference)
  case = Case("pad", batch=2, length=24)
  x = make_inputs(case, seed=1)
  check_packing_and_padding(fn, x, ("q", "k", "v", "g"), {"g": -30.0, "v": 100.0}, F32_TOL)


def _loss_and_grads(fn, chunk_size=None):
  kw = {} if chunk_size is None else dict(chunk_size=chunk_size)

  def loss(q, k, v, g, initial_state, segment_ids, ct_out, ct_state):
    out, state = fn(q, k, v, g, segment_ids=segment_ids, initial_state=initial_state,
                    return_final_state=True, **kw)
    return jnp.sum(out * ct_out) + jnp.sum(state * ct_state)

  return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(5))))


chunked_grads = _loss_and_grads(kernels.gated_linear_attention, chunk_size=8)
reference_grads = _loss_and_grads(kernels.gated_linear_attention_reference)
GRAD_NAMES = ("q", "k", "v", "g", "initial_state")


def _grad_inputs(x):
  return (*args(x), x["initial_state"], x["segment_ids"])


def test_gradients_match_reference():
  case = CASE["packed"]
  x = make_inputs(case)
  cts = cotangents(case)
  loss, grads = chunked_grads(*_grad_inputs(x), *cts)
  want_loss, want_grads = reference_grads(*_grad_inputs(x), *cts)
  assert_close(loss, want_loss, F32_TOL, "loss")
  for name, got, want in zip(GRAD_NAMES, grads, want_grads):
    assert float(np.max(np.abs(np.asarray(want)))) > 0, name
    assert_close(got, want, GRAD_TOL, f"d{name}")
  # Padding tokens take no part: their inputs get no gradient.
  pad = np.asarray(x["segment_ids"]) == 0
  for got in grads[:4]:
    assert np.all(np.asarray(got)[pad] == 0)


def test_strong_decay_stays_finite():
  # exp(-1000) underflows to 0; masking before exp keeps inf - inf and 0 * inf away.
  case = CASE["packed"]
  x = make_inputs(case)
  g = np.asarray(x["g"]).copy()
  g[:, 5::6] = -50.0
  g[0, 23:26] = -1000.0
  x["g"] = jnp.asarray(g)
  cts = cotangents(case)
  loss, grads = chunked_grads(*_grad_inputs(x), *cts)
  want_loss, want_grads = reference_grads(*_grad_inputs(x), *cts)
  assert_close(loss, want_loss, 1e-4, "loss")
  for name, got, want in zip(GRAD_NAMES, grads, want_grads):
    assert_close(got, want, 1e-3, f"d{name}")


def test_bf16_inputs():
  case = CASE["ragged_gqa"]
  x = make_inputs(case, jnp.bfloat16)
  out, state = chunked(*args(x), **kwargs(x), chunk_size=case.chunk_size)
  assert out.dtype == jnp.bfloat16 and state.dtype == jnp.float32
  x32 = {n: (a.astype(jnp.float32) if n in ("q", "k", "v", "g") else a)
         for n, a in x.items()}
  want_out, want_state = reference(*args(x32), **kwargs(x32))
  assert_close(out, want_out, BF16_OUT_TOL, "bf16 out")
  assert_close(state, want_state, F32_TOL, "final state from bf16 inputs")


def test_prefill_then_decode_matches_full_run():
  case = CASE["ragged_gqa"]
  x = make_inputs(case)
  want_out, want_state = chunked(*args(x), **kwargs(x), chunk_size=case.chunk_size)
  prefill = 34
  head = take_rows(x, ("q", "k", "v", "g"), np.arange(prefill))
  outs, state = chunked(*args(head), initial_state=x["initial_state"],
                        chunk_size=case.chunk_size)
  outs = [outs]
  for t in range(prefill, case.length):
    # T == 1 takes the per-token path.
    token = take_rows(x, ("q", "k", "v", "g"), np.arange(t, t + 1))
    out, state = chunked(*args(token), initial_state=state, chunk_size=case.chunk_size)
    outs.append(out)
  assert_close(jnp.concatenate(outs, axis=1), want_out, F32_TOL, "out")
  assert_close(state, want_state, F32_TOL, "final state")


def test_backward_saves_no_chunk_matrices():
  # With the chunk body rematerialised, the residuals are the inputs (a few copies) and
  # one carried state per chunk, never a [chunk, chunk] matrix per chunk and head.
  b, t, hk, hv, dk, dv, chunk = 2, 256, 2, 4, 8, 8, 16
  shapes = [(b, t, hk, dk), (b, t, hk, dk), (b, t, hv, dv), (b, t, hv)]
  inputs = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
  fn = functools.partial(kernels.gated_linear_attention, chunk_size=chunk)
  residuals = jax.tree.leaves(jax.eval_shape(lambda *a: jax.vjp(fn, *a)[1], *inputs))
  assert not [r.shape for r in residuals if r.shape[-2:] == (chunk, chunk)]
  input_size = sum(np.prod(s) for s in shapes)
  states = (t // chunk + 1) * b * hv * dk * dv
  assert sum(np.prod(r.shape) for r in residuals) <= 4 * input_size + states


# Argument checks: a user's shape mistake is a ValueError naming the argument.

B, T, HK, HV, DK, DV = 2, 5, 2, 4, 3, 7
GOOD = dict(q=(B, T, HK, DK), k=(B, T, HK, DK), v=(B, T, HV, DV), g=(B, T, HV))
BAD = [
    ("q", dict(q=(B, T, DK))),
    ("k", dict(k=(B, T, HK))),
    ("k", dict(k=(B, T + 1, HK, DK))),
    ("k", dict(k=(B, T, HK, DK + 1))),
    ("v", dict(v=(B, T, HV * DV))),
    ("v", dict(v=(B + 1, T, HV, DV))),
    ("v", dict(v=(B, T, 3, DV))),
    ("g", dict(g=(B, T, HK))),
    ("g", dict(g=(B, T, HV, 1))),
    ("segment_ids", dict(segment_ids=(B, T + 1))),
    ("initial_state", dict(initial_state=(B, HV, DV, DK))),
    ("scale", dict(scale=0.0)),
    ("chunk_size", dict(chunk_size=0)),
]


@pytest.mark.parametrize("name,change", BAD,
                         ids=[f"{n}{i}" for i, (n, _) in enumerate(BAD)])
def test_bad_arguments_raise(name, change):
  assert_bad_argument_raises(kernels.gated_linear_attention,
                             kernels.gated_linear_attention_reference, GOOD, name, change)
