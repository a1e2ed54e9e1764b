"""gated_delta_rule (chunked), its per-token reference and causal_conv1d against numpy
oracles, transformers' torch implementations and each other."""
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

STATIC = ("chunk_size", "return_final_state", "qk_l2norm", "scale")
chunked = jax.jit(functools.partial(kernels.gated_delta_rule, return_final_state=True),
                  static_argnames=STATIC)
reference = jax.jit(
    functools.partial(kernels.gated_delta_rule_reference, return_final_state=True),
    static_argnames=STATIC[1:])
conv = jax.jit(functools.partial(kernels.causal_conv1d, return_final_state=True),
               static_argnames=("activation",))


CASES = [
    Case("shorter_than_chunk", length=11, key_heads=3, value_heads=3, dk=5, dv=7,
         initial_state=False),
    Case("ragged_gqa"),  # 37 = 2 * 16 + 5, two value heads per key head
    Case("packed", chunk_size=8, segments=True),
]
CASE = {c.name: c for c in CASES}


def make_inputs(case: Case, dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  b, t, hk, hv, dk, dv = (case.batch, case.length, case.key_heads, case.value_heads,
                          case.dk, case.dv)
  x = dict(
      q=rng.normal(size=(b, t, hk, dk)), k=rng.normal(size=(b, t, hk, dk)),
      v=rng.normal(size=(b, t, hv, dv)),
      # Qwen3-Next's g = -exp(A_log) * softplus(a + dt_bias): mostly mild, some strong.
      g=-rng.exponential(0.3, size=(b, t, hv)),
      beta=rng.uniform(size=(b, t, hv)))
  x = {n: jnp.asarray(a, dtype) for n, a in x.items()}
  x["initial_state"] = (jnp.asarray(rng.normal(size=(b, hv, dk, dv)), jnp.float32)
                        if case.initial_state else None)
  x["segment_ids"] = jnp.asarray(hostile_segments(b, t)) if case.segments else None
  return x


def args(x):
  return (x["q"], x["k"], x["v"], x["g"], x["beta"])


def kwargs(x):
  return dict(segment_ids=x["segment_ids"], initial_state=x["initial_state"])


def np_gated_delta_rule(q, k, v, g, beta, segment_ids=None, initial_state=None):
  """Token by token in float64, straight from the contract."""
  q, k, v, g, beta = (np.asarray(jnp.asarray(a, jnp.float32), np.float64)
                      for a in (q, k, v, g, beta))
  b, t, hk, dk = q.shape
  hv, dv = v.shape[2:]
  q = np.repeat(q, hv // hk, axis=2)
  k = np.repeat(k, hv // hk, axis=2)
  q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * dk ** -0.5
  k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
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
      s = s * np.exp(g[row, i])[:, None, None]
      kv_mem = np.einsum("hd,hde->he", k[row, i], s)
      delta = (v[row, i] - kv_mem) * beta[row, i][:, None]
      s = s + np.einsum("hd,he->hde", k[row, i], delta)
      out[row, i] = np.einsum("hd,hde->he", q[row, i], s)
    final[row] = s
  return out, final


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_chunked_matches_reference(case):
  x = make_inputs(case)
  out, state = chunked(*args(x), **kwargs(x), chunk_size=case.chunk_size)
  want_out, want_state = reference(*args(x), **kwargs(x))
  assert out.dtype == jnp.float32 and state.dtype == jnp.float32
  assert state.shape == (case.batch, case.value_heads, case.dk, case.dv)
  assert_close(out, want_out, F32_TOL, "out")
  assert_close(state, want_state, F32_TOL, "final state")


@pytest.mark.parametrize("name", ["ragged_gqa", "packed"])
def test_matches_numpy_oracle(name):
  case = CASE[name]
  x = make_inputs(case)
  want_out, want_state = np_gated_delta_rule(*args(x), **kwargs(x))
  for fn in (functools.partial(chunked, chunk_size=case.chunk_size), reference):
    out, state = fn(*args(x), **kwargs(x))
    assert_close(out, want_out, F32_TOL, "out")
    assert_close(state, want_state, F32_TOL, "final state")
  if case.segments:
    assert np.all(np.asarray(out)[np.asarray(x["segment_ids"]) == 0] == 0)


def test_matches_transformers():
  torch = pytest.importorskip("torch")
  qwen = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
  case = CASE["ragged_gqa"]
  x = make_inputs(case)
  t = [torch.from_numpy(np.array(a)) for a in (*args(x), x["initial_state"])]
  got = chunked(*args(x), **kwargs(x), chunk_size=case.chunk_size)
  want_ref = reference(*args(x), **kwargs(x))
  for torch_fn in (functools.partial(qwen.torch_chunk_gated_delta_rule,
                                     chunk_size=case.chunk_size),
                   qwen.torch_recurrent_gated_delta_rule):
    out, state = torch_fn(*t[:5], initial_state=t[5], output_final_state=True,
                          use_qk_l2norm_in_kernel=True)
    for ours in (got, want_ref):
      assert_close(ours[0], out.numpy(), F32_TOL, f"{torch_fn} out")
      assert_close(ours[1], state.numpy(), F32_TOL, f"{torch_fn} final state")


@pytest.mark.parametrize("implementation", ["chunked", "reference"])
def test_packing_and_padding_are_transparent(implementation):
  fn = (functools.partial(chunked, chunk_size=8) if implementation == "chunked"
        else reference)
  case = Case("pad", batch=2, length=24)
  x = make_inputs(case, seed=1)
  check_packing_and_padding(fn, x, ("q", "k", "v", "g", "beta"), {"g": -30.0}, F32_TOL)


def _loss_and_grads(fn, chunk_size=None):
  kw = {} if chunk_size is None else dict(chunk_size=chunk_size)

  def loss(q, k, v, g, beta, initial_state, segment_ids, ct_out, ct_state):
    out, state = fn(q, k, v, g, beta, segment_ids=segment_ids,
                    initial_state=initial_state, return_final_state=True, **kw)
    return jnp.sum(out * ct_out) + jnp.sum(state * ct_state)

  return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6))))


chunked_grads = _loss_and_grads(kernels.gated_delta_rule, chunk_size=8)
reference_grads = _loss_and_grads(kernels.gated_delta_rule_reference)


def _grad_inputs(x):
  return (*args(x), x["initial_state"], x["segment_ids"])


def test_gradients_match_reference():
  case = CASE["packed"]
  x = make_inputs(case)
  cts = cotangents(case)
  loss, grads = chunked_grads(*_grad_inputs(x), *cts)
  want_loss, want_grads = reference_grads(*_grad_inputs(x), *cts)
  assert_close(loss, want_loss, F32_TOL, "loss")
  for name, got, want in zip(("q", "k", "v", "g", "beta", "initial_state"), grads,
                             want_grads):
    assert float(np.max(np.abs(np.asarray(want)))) > 0, name
    assert_close(got, want, GRAD_TOL, f"d{name}")
  # Padding tokens take no part: their inputs get no gradient.
  pad = np.asarray(x["segment_ids"]) == 0
  for got in grads[:5]:
    assert np.all(np.asarray(got)[pad] == 0)


def test_strong_decay_stays_finite():
  # exp(-1000) underflows to 0; masking before exp keeps inf - inf and 0 * inf away.
  case = CASE["packed"]
  x = make_inputs(case)
  g = np.asarray(x["g"]).copy()
  g[:, 5::6] = -1000.0
  x["g"] = jnp.asarray(g)
  cts = cotangents(case)
  loss, grads = chunked_grads(*_grad_inputs(x), *cts)
  want_loss, want_grads = reference_grads(*_grad_inputs(x), *cts)
  assert_close(loss, want_loss, 1e-4, "loss")
  for name, got, want in zip(("q", "k", "v", "g", "beta", "initial_state"), grads,
                             want_grads):
    assert_close(got, want, 1e-3, f"d{name}")


def test_bf16_inputs():
  case = CASE["ragged_gqa"]
  x = make_inputs(case, jnp.bfloat16)
  out, state = chunked(*args(x), **kwargs(x), chunk_size=case.chunk_size)
  assert out.dtype == jnp.bfloat16 and state.dtype == jnp.float32
  x32 = {n: (a.astype(jnp.float32) if n in ("q", "k", "v", "g", "beta") else a)
         for n, a in x.items()}
  want_out, want_state = reference(*args(x32), **kwargs(x32))
  assert_close(out, want_out, BF16_OUT_TOL, "bf16 out")
  assert_close(state, want_state, F32_TOL, "final state from bf16 inputs")


def test_prefill_then_decode_matches_full_run():
  case = CASE["ragged_gqa"]
  x = make_inputs(case)
  want_out, want_state = chunked(*args(x), **kwargs(x), chunk_size=case.chunk_size)
  prefill = 34
  head = take_rows(x, ("q", "k", "v", "g", "beta"), np.arange(prefill))
  outs, state = chunked(*args(head), initial_state=x["initial_state"],
                        chunk_size=case.chunk_size)
  outs = [outs]
  for t in range(prefill, case.length):
    # T == 1 takes the per-token path.
    token = take_rows(x, ("q", "k", "v", "g", "beta"), np.arange(t, t + 1))
    out, state = chunked(*args(token), initial_state=state, chunk_size=case.chunk_size)
    outs.append(out)
  assert_close(jnp.concatenate(outs, axis=1), want_out, F32_TOL, "out")
  assert_close(state, want_state, F32_TOL, "final state")


def test_without_l2norm_and_with_scale():
  # Unnormalised keys: kept small so that beta |k|^2 < 2 and the recurrence stays stable.
  case = CASE["ragged_gqa"]
  x = make_inputs(case)
  x["k"] = x["k"] * 0.2
  options = dict(qk_l2norm=False, scale=0.3)
  out, state = chunked(*args(x), **kwargs(x), chunk_size=case.chunk_size, **options)
  want_out, want_state = reference(*args(x), **kwargs(x), **options)
  assert_close(out, want_out, F32_TOL, "out")
  assert_close(state, want_state, F32_TOL, "final state")
  normalised, _ = reference(*args(x), **kwargs(x))
  assert float(jnp.max(jnp.abs(normalised - want_out))) > 1e-2  # the options matter


def test_backward_saves_no_chunk_matrices():
  # With the chunk body rematerialised, the residuals are the inputs (a few copies) and
  # one carried state per chunk, never a [chunk, chunk] matrix per chunk and head.
  b, t, hk, hv, dk, dv, chunk = 2, 256, 2, 4, 8, 8, 16
  shapes = [(b, t, hk, dk), (b, t, hk, dk), (b, t, hv, dv), (b, t, hv), (b, t, hv)]
  inputs = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
  fn = functools.partial(kernels.gated_delta_rule, chunk_size=chunk)
  residuals = jax.tree.leaves(jax.eval_shape(lambda *a: jax.vjp(fn, *a)[1], *inputs))
  assert not [r.shape for r in residuals if r.shape[-2:] == (chunk, chunk)]
  input_size = sum(np.prod(s) for s in shapes)
  states = (t // chunk + 1) * b * hv * dk * dv
  assert sum(np.prod(r.shape) for r in residuals) <= 4 * input_size + states


# causal_conv1d.

def np_causal_conv1d(x, w, segment_ids=None, initial_state=None, activation="silu",
                     bias=None):
  """The window of each token built from the contract, one token at a time."""
  x = np.asarray(x, np.float64)
  w = np.asarray(w, np.float64)
  bias = 0.0 if bias is None else np.asarray(bias, np.float64)
  b, t, c = x.shape
  width = w.shape[1]
  seg = np.ones((b, t), int) if segment_ids is None else np.asarray(segment_ids)
  out = np.zeros((b, t, c))
  final = np.zeros((b, width - 1, c))
  for row in range(b):
    history = (list(np.zeros((width - 1, c))) if initial_state is None
               else list(np.asarray(initial_state[row], np.float64)))
    previous = None
    for i in range(t):
      if seg[row, i] == 0:
        continue
      if previous is not None and seg[row, i] != previous:
        history = list(np.zeros((width - 1, c)))
      previous = seg[row, i]
      window = np.stack(history + [x[row, i]])  # [width, c], oldest first
      y = np.einsum("jc,cj->c", window, w) + bias
      out[row, i] = y / (1 + np.exp(-y)) if activation == "silu" else y
      history = list(window[1:])
    if width > 1:
      final[row] = np.stack(history)
  return out, final


def conv_inputs(batch=2, length=37, channels=6, width=4, seed=3):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.normal(size=(batch, length, channels)), jnp.float32),
          jnp.asarray(rng.normal(size=(channels, width)), jnp.float32),
          jnp.asarray(rng.normal(size=(batch, width - 1, channels)), jnp.float32))


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("segments", [False, True])
def test_conv_matches_numpy_oracle(segments, activation):
  x, w, s0 = conv_inputs()
  seg = None
  if segments:
    seg = hostile_segments(2, 37)
    seg[1, 30] = 7  # row 1: two valid tokens, fewer than width - 1 = 3
    seg = jnp.asarray(seg)
  out, state = conv(x, w, segment_ids=seg, initial_state=s0, activation=activation)
  want_out, want_state = np_causal_conv1d(x, w, seg, s0, activation)
  assert out.dtype == x.dtype and state.shape == s0.shape
  assert_close(out, want_out, F32_TOL, "out")
  assert_close(state, want_state, F32_TOL, "final state")


@pytest.mark.parametrize("segments", [False, True])
def test_conv_bias_is_added_before_the_activation(segments):
  """Mamba2's conv1d bias: act(conv + bias) at every valid token, 0 at padding; the
  final state holds inputs, untouched by it."""
  x, w, s0 = conv_inputs()
  bias = jnp.asarray(np.random.default_rng(6).normal(size=(6,)), jnp.float32)
  seg = jnp.asarray(hostile_segments(2, 37)) if segments else None
  out, state = conv(x, w, bias=bias, segment_ids=seg, initial_state=s0)
  want_out, want_state = np_causal_conv1d(x, w, seg, s0, "silu", bias)
  assert_close(out, want_out, F32_TOL, "out")
  assert_close(state, want_state, F32_TOL, "final state")
  if segments:
    assert np.all(np.asarray(out)[np.asarray(seg) == 0] == 0)
  with pytest.raises(ValueError, match=r"^bias must be \[channels\] = \[6\]"):
    kernels.causal_conv1d(x, w, bias=bias[:5])


def test_conv_padding_is_transparent():
  x, w, s0 = conv_inputs(batch=1, length=9)
  at = np.array([2, 3, 6, 7, 8, 10, 11, 12, 13])
  padded = np.random.default_rng(4).normal(size=(1, 16, 6)).astype(np.float32)
  padded[0, at] = np.asarray(x[0])
  seg = np.zeros((1, 16), np.int32)
  seg[0, at] = 1
  out, state = conv(jnp.asarray(padded), w, segment_ids=jnp.asarray(seg), initial_state=s0)
  want_out, want_state = conv(x, w, initial_state=s0)
  assert_close(out[:, at], want_out, F32_TOL, "out")
  assert np.all(np.asarray(out)[seg == 0] == 0)
  assert_close(state, want_state, F32_TOL, "final state")


def test_conv_gradients_see_through_padding_and_sequence_starts():
  """Gradients with segment ids (the packed path) equal the plain path's (static
  shifts) on each sequence alone: padding gets none, a later sequence's window none of
  the earlier's inputs; the initial state's come from the row's first sequence."""
  x, w, s0 = conv_inputs(batch=1, length=12)
  first, second = [2, 3, 6, 7, 8], [10, 11, 12, 13, 14, 15, 17]
  padded = np.zeros((1, 20, 6), np.float32)
  padded[0, first + second] = np.asarray(x[0])
  seg = np.zeros((1, 20), np.int32)
  seg[0, first], seg[0, second] = 1, 2
  r = np.random.default_rng(5)
  cot_out = jnp.asarray(r.normal(size=(1, 20, 6)), jnp.float32)
  cot_state = jnp.asarray(r.normal(size=(1, 3, 6)), jnp.float32)

  def loss(x, w, s0, seg=None, cot=None, state_weight=1.0):
    out, state = kernels.causal_conv1d(x, w, segment_ids=seg, initial_state=s0,
                                       return_final_state=True)
    return jnp.sum(out * cot) + state_weight * jnp.sum(state * cot_state)

  got = jax.grad(loss, argnums=(0, 1, 2))(jnp.asarray(padded), w, s0, jnp.asarray(seg),
                                          cot=cot_out)
  # The same sums, a sequence at a time without segment ids (the second from zeros).
  g1 = jax.grad(loss, argnums=(0, 1, 2))(x[:, :5], w, s0, cot=cot_out[:, first],
                                         state_weight=0.0)
  g2 = jax.grad(loss, argnums=(0, 1))(x[:, 5:], w, jnp.zeros_like(s0),
                                      cot=cot_out[:, second])
  grad_x = np.zeros((1, 20, 6), np.float32)
  grad_x[0, first], grad_x[0, second] = np.asarray(g1[0][0]), np.asarray(g2[0][0])
  assert_close(got[0], grad_x, F32_TOL, "d x")
  assert_close(got[1], np.asarray(g1[1]) + np.asarray(g2[1]), F32_TOL, "d w")
  assert_close(got[2], g1[2], F32_TOL, "d initial state")


def test_conv_matches_transformers_and_decodes():
  torch = pytest.importorskip("torch")
  qwen = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
  x, w, s0 = conv_inputs(length=12)
  x_t, w_t = torch.from_numpy(np.array(x)), torch.from_numpy(np.array(w))
  # Prefill from no state: torch's conv1d over [batch, channels, T].
  out, _ = conv(x, w)
  want = qwen.causal_conv1d_fn(x_t.transpose(1, 2), w_t, activation="silu")
  assert_close(out, want.transpose(1, 2).numpy(), F32_TOL, "prefill out")
  # From a state, whole and one token at a time (torch's decode updates its state).
  out, state = conv(x, w, initial_state=s0)
  torch_state = torch.from_numpy(np.array(s0)).transpose(1, 2).contiguous()
  step_state = s0
  for t in range(x.shape[1]):
    step_out, step_state = conv(x[:, t:t + 1], w, initial_state=step_state)
    torch_out = qwen.causal_conv1d_update(x_t[:, t:t + 1].transpose(1, 2), torch_state,
                                          w_t, activation="silu")
    assert_close(step_out, out[:, t:t + 1], F32_TOL, f"decode step {t}")
    assert_close(step_out, torch_out.transpose(1, 2).numpy(), F32_TOL, f"torch step {t}")
  assert_close(step_state, state, F32_TOL, "decode state")
  assert_close(state, torch_state.transpose(1, 2).numpy(), F32_TOL, "torch state")


# Argument checks: a user's shape mistake is a ValueError naming the argument.

B, T, HK, HV, DK, DV = 2, 5, 2, 4, 3, 7
GOOD_DELTA_RULE = dict(q=(B, T, HK, DK), k=(B, T, HK, DK), v=(B, T, HV, DV), g=(B, T, HV),
                       beta=(B, T, HV))
BAD_DELTA_RULE = [
    ("q", dict(q=(B, T, DK))),
    ("k", dict(k=(B, T + 1, HK, DK))),
    ("k", dict(k=(B, T, HK, DK + 1))),
    ("v", dict(v=(B + 1, T, HV, DV))),
    ("v", dict(v=(B, T, 3, DV))),
    ("g", dict(g=(B, T, HK))),
    ("beta", dict(beta=(B, T))),
    ("segment_ids", dict(segment_ids=(B, T + 1))),
    ("initial_state", dict(initial_state=(B, HV, DV, DK))),
    ("chunk_size", dict(chunk_size=0)),
]


@pytest.mark.parametrize("name,change", BAD_DELTA_RULE,
                         ids=[f"{n}{i}" for i, (n, _) in enumerate(BAD_DELTA_RULE)])
def test_bad_delta_rule_arguments_raise(name, change):
  assert_bad_argument_raises(kernels.gated_delta_rule, kernels.gated_delta_rule_reference,
                             GOOD_DELTA_RULE, name, change)


BAD_CONV = [
    ("x", dict(x=(2, 5))),
    ("w", dict(w=(3, 4))),
    ("w", dict(w=(6, 0))),
    ("segment_ids", dict(segment_ids=(2, 4))),
    ("initial_state", dict(initial_state=(2, 4, 6))),
    ("activation", dict(activation="gelu")),
]


@pytest.mark.parametrize("name,change", BAD_CONV,
                         ids=[f"{n}{i}" for i, (n, _) in enumerate(BAD_CONV)])
def test_bad_conv_arguments_raise(name, change):
  call = {n: np.zeros(s, np.float32) if isinstance(s, tuple) else s
          for n, s in {**dict(x=(2, 5, 6), w=(6, 4)), **change}.items()}
  with pytest.raises(ValueError, match=rf"^{name} "):
    kernels.causal_conv1d(**call)


_SHARDED_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import kernels
mesh = jax.make_mesh((8,), ("b",))
r = np.random.default_rng(0)
q, k = (jnp.asarray(r.normal(size=(8, 80, 2, 16)), jnp.float32) for _ in range(2))
v = jnp.asarray(r.normal(size=(8, 80, 4, 8)), jnp.float32)
g = jnp.asarray(-np.abs(r.normal(size=(8, 80, 4))), jnp.float32)
beta = jnp.asarray(r.uniform(size=(8, 80, 4)), jnp.float32)
fn = jax.jit(lambda *a: kernels.gated_delta_rule(*a, chunk_size=32))
want = np.asarray(fn(q, k, v, g, beta))
for spec in (P("b"), P()):
  args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v, g, beta)]
  np.testing.assert_allclose(np.asarray(fn(*args)), want, atol=1e-5)
print("ok")
"""


def test_runs_on_eight_devices_at_once():
  """The chunks' solve on 8 (fake) CPU devices at once, rows split or replicated, gives
  the one-device result. Run apart, with a timeout: LAPACK's batched triangular solve,
  which waits on the host thread pool from inside it, deadlocked XLA:CPU here."""
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": root,
         "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  done = subprocess.run([sys.executable, "-c", _SHARDED_SCRIPT], env=env, cwd=root,
                        capture_output=True, text=True, timeout=240)
  assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_conv_backward_keeps_its_inputs_alone():
  """Rematerialised: the backward pass keeps x, w, the state and the segment ids, not a
  float32 copy of each shifted window and mask (a gathered window per tap with segment
  ids)."""
  b, t, c, width = 2, 64, 16, 4
  inputs = [jax.ShapeDtypeStruct((b, t, c), jnp.bfloat16),
            jax.ShapeDtypeStruct((c, width), jnp.bfloat16),
            jax.ShapeDtypeStruct((b, width - 1, c), jnp.bfloat16)]
  seg = jnp.ones((b, t), jnp.int32)

  def fn(x, w, s0):
    return conv(x, w, segment_ids=seg, initial_state=s0)

  residuals = jax.tree.leaves(jax.eval_shape(lambda *a: jax.vjp(fn, *a)[1], *inputs))
  floats = sum(np.prod(r.shape) for r in residuals if jnp.issubdtype(r.dtype, jnp.floating))
  assert floats <= sum(np.prod(i.shape) for i in inputs)
