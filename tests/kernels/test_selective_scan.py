"""selective_scan (chunked) and its per-token reference against a numpy oracle,
transformers' torch Mamba 1 scan and each other."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_test_utils import assert_close
from linear_test_utils import assert_bad_argument_raises, check_packing_and_padding

import kernels

# Errors are relative to max(1, max|expected|) (`assert_close`).
F32_TOL = 1e-5
GRAD_TOL = 1e-4
# bf16 inputs are computed in f32; the output is rounded to bf16 once (2^-8 relative).
BF16_OUT_TOL = 1e-2

chunked = jax.jit(functools.partial(kernels.selective_scan, return_final_state=True),
                  static_argnames=("chunk_size", "inner"))
# selective_scan's ways through a chunk (log-depth, or token by token: CPU's default).
INNER = ("associative", "sequential")
reference = jax.jit(functools.partial(kernels.selective_scan_reference,
                                      return_final_state=True))

NAMES = ("x", "dt", "A", "B", "C", "D", "initial_state")
PER_TOKEN = ("x", "dt", "B", "C")


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  batch: int = 2
  length: int = 13
  channels: int = 6
  groups: int = 1
  state_size: int = 4
  skip: bool = True  # D given
  initial_state: bool = True
  segments: bool = False


CASES = [
    Case("mamba1"),  # groups = 1, D, initial state
    Case("groups2_plain", groups=2, skip=False, initial_state=False),
    Case("groups2_packed", groups=2, segments=True),
    Case("one_token", length=1, groups=3),
]
CASE = {c.name: c for c in CASES}


def layout(name, batch=2, length=13):
  """Segment ids [batch, length] for T = 13 (chunks of 3 and 8 end at 3, 6, 9, 12 / 8).

  hostile: row 0 has padding at the start (0, 1), resets mid-chunk (4) and on chunk
    boundaries (6 for chunks of 3, 8 for chunks of 8), padding inside its last sequence
    (10) and at the end (12); row 1 is all padding.
  gaps: row 0 has padding between two tokens of one sequence (3, 4: no reset) and on a
    chunk-8 boundary (8), a reset after a token run (6); row 1 resets exactly on the
    chunk-8 boundary (8) and ends in padding.
  """
  if name is None:
    return None
  rows = {
      "hostile": [[0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 0, 4, 0], [0] * 13],
      "gaps": [[1, 1, 1, 0, 0, 1, 2, 2, 0, 2, 2, 2, 2],
               [3, 3, 3, 3, 3, 3, 3, 3, 5, 5, 5, 0, 0]],
  }[name]
  seg = np.asarray(rows, np.int32)
  assert seg.shape == (batch, length)
  return jnp.asarray(seg)


def make_inputs(case: Case, dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  b, t, ch, g, n = case.batch, case.length, case.channels, case.groups, case.state_size
  x = dict(
      x=rng.normal(size=(b, t, ch)),
      # softplus(dt_proj(...)): mostly ~0.3, some large steps.
      dt=np.log1p(np.exp(rng.normal(-1.0, 1.5, size=(b, t, ch)))),
      B=rng.normal(size=(b, t, g, n)), C=rng.normal(size=(b, t, g, n)))
  x = {k: jnp.asarray(a, dtype) for k, a in x.items()}
  # Mamba 1's A = -exp(A_log), initialised to -[1 .. N] per channel.
  x["A"] = jnp.asarray(-np.exp(rng.uniform(np.log(0.5), np.log(4.0), size=(ch, n))),
                       jnp.float32)
  x["D"] = jnp.asarray(rng.normal(size=ch), jnp.float32) if case.skip else None
  x["initial_state"] = (jnp.asarray(rng.normal(size=(b, ch, n)), jnp.float32)
                        if case.initial_state else None)
  x["segment_ids"] = layout("hostile") if case.segments else None
  return x


def args(x):
  return (x["x"], x["dt"], x["A"], x["B"], x["C"])


def kwargs(x):
  return dict(D=x["D"], segment_ids=x["segment_ids"], initial_state=x["initial_state"])


def np_selective_scan(x, dt, A, B, C, D=None, segment_ids=None, initial_state=None):
  """Token by token in float64, straight from the contract."""
  x, dt, A, B, C = (np.asarray(a).astype(np.float64) for a in (x, dt, A, B, C))
  b, t, ch = x.shape
  n = A.shape[1]
  B = np.repeat(B, ch // B.shape[2], axis=2)  # [b, t, ch, N]: channel c reads c // r
  C = np.repeat(C, ch // C.shape[2], axis=2)
  D = np.zeros(ch) if D is None else np.asarray(D, np.float64)
  seg = np.ones((b, t), int) if segment_ids is None else np.asarray(segment_ids)
  y = np.zeros((b, t, ch))
  final = np.zeros((b, ch, n))
  for row in range(b):
    h = (np.zeros((ch, n)) if initial_state is None
         else np.asarray(initial_state[row], np.float64))
    previous = None
    for i in range(t):
      if seg[row, i] == 0:
        continue
      if previous is not None and seg[row, i] != previous:
        h = np.zeros_like(h)
      previous = seg[row, i]
      h = (np.exp(dt[row, i][:, None] * A) * h
           + (dt[row, i] * x[row, i])[:, None] * B[row, i])
      y[row, i] = (C[row, i] * h).sum(-1) + D * x[row, i]
    final[row] = h
  return y, final


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_numpy_oracle(case):
  x = make_inputs(case)
  want_y, want_state = np_selective_scan(*args(x), **kwargs(x))
  for fn in (functools.partial(chunked, chunk_size=8), reference):
    y, state = fn(*args(x), **kwargs(x))
    assert y.dtype == jnp.float32 and state.dtype == jnp.float32
    assert_close(y, want_y, F32_TOL, "y")
    assert_close(state, want_state, F32_TOL, "final state")
  if case.skip:  # the D term is there (and counted once)
    no_skip, _ = np_selective_scan(*args(x), **{**kwargs(x), "D": None})
    assert float(np.max(np.abs(no_skip - want_y))) > 1e-2


@pytest.mark.parametrize("inner", INNER)
@pytest.mark.parametrize("segments", [None, "hostile", "gaps"])
@pytest.mark.parametrize("chunk_size", [1, 3, 8, 64])
def test_chunked_matches_reference(chunk_size, segments, inner):
  case = CASE["groups2_packed"]
  x = {**make_inputs(case), "segment_ids": layout(segments)}
  y, state = chunked(*args(x), **kwargs(x), chunk_size=chunk_size, inner=inner)
  want_y, want_state = reference(*args(x), **kwargs(x))
  assert y.shape == (case.batch, case.length, case.channels)
  assert state.shape == (case.batch, case.channels, case.state_size)
  assert_close(y, want_y, F32_TOL, "y")
  assert_close(state, want_state, F32_TOL, "final state")
  if segments is not None:
    pad = np.asarray(x["segment_ids"]) == 0
    assert np.all(np.asarray(y)[pad] == 0)  # the D term included
  if segments == "hostile":  # row 1 is all padding: the state passes through untouched
    np.testing.assert_array_equal(np.asarray(state[1]), np.asarray(x["initial_state"][1]))


@pytest.mark.parametrize("implementation", ["chunked", "reference"])
def test_packing_and_padding_are_transparent(implementation):
  fn = (functools.partial(chunked, chunk_size=8) if implementation == "chunked"
        else reference)
  x = make_inputs(Case("pad", length=24), seed=1)

  def scan(x_, dt, b, c, **kw):
    return fn(x_, dt, x["A"], b, c, D=x["D"], **kw)

  # A padding token's huge step would wipe the state and its x would add a lot.
  check_packing_and_padding(scan, x, PER_TOKEN, {"dt": 30.0, "x": 100.0}, F32_TOL)


def _loss_and_grads(fn, chunk_size=None):
  kw = {} if chunk_size is None else dict(chunk_size=chunk_size)

  def loss(x, dt, A, B, C, D, initial_state, segment_ids, ct_y, ct_state):
    y, state = fn(x, dt, A, B, C, D=D, segment_ids=segment_ids,
                  initial_state=initial_state, return_final_state=True, **kw)
    return jnp.sum(y * ct_y) + jnp.sum(state * ct_state)

  return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(NAMES)))))


chunked_grads = {inner: _loss_and_grads(functools.partial(kernels.selective_scan,
                                                            inner=inner), chunk_size=3)
                 for inner in INNER}
reference_grads = _loss_and_grads(kernels.selective_scan_reference)


def cotangents(case, seed=2):
  """Random weights of y [B, T, channels] and of the final state [B, channels, N]."""
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.normal(size=(case.batch, case.length, case.channels)),
                      jnp.float32),
          jnp.asarray(rng.normal(size=(case.batch, case.channels, case.state_size)),
                      jnp.float32))


def _grad_inputs(x):
  return tuple(x[name] for name in NAMES) + (x["segment_ids"],)


@pytest.mark.parametrize("inner", INNER)
@pytest.mark.parametrize("segments", ["hostile", "gaps"])
def test_gradients_match_reference(segments, inner):
  case = CASE["groups2_packed"]
  x = {**make_inputs(case), "segment_ids": layout(segments)}
  cts = cotangents(case)
  loss, grads = chunked_grads[inner](*_grad_inputs(x), *cts)
  want_loss, want_grads = reference_grads(*_grad_inputs(x), *cts)
  assert_close(loss, want_loss, F32_TOL, "loss")
  for name, got, want in zip(NAMES, grads, want_grads):
    assert float(np.max(np.abs(np.asarray(want)))) > 0, name
    assert_close(got, want, GRAD_TOL, f"d{name}")
  # Padding tokens take no part: their inputs get no gradient.
  pad = np.asarray(x["segment_ids"]) == 0
  for name, got in zip(NAMES, grads):
    if name in PER_TOKEN:
      assert np.all(np.asarray(got)[pad] == 0), name


def test_gradients_match_finite_differences_of_the_oracle():
  # Central differences of the float64 oracle along a random direction per input.
  case = CASE["groups2_packed"]
  x = make_inputs(case)
  cts = cotangents(case)
  ct_y, ct_state = (np.asarray(c, np.float64) for c in cts)
  _, grads = chunked_grads["associative"](*_grad_inputs(x), *cts)
  rng = np.random.default_rng(5)
  eps = 1e-5
  for name, grad in zip(NAMES, grads):
    direction = rng.normal(size=x[name].shape)
    losses = []
    for sign in (1, -1):
      moved = {**x, name: np.asarray(x[name], np.float64) + sign * eps * direction}
      y, state = np_selective_scan(*args(moved), **kwargs(moved))
      losses.append(np.sum(y * ct_y) + np.sum(state * ct_state))
    want = (losses[0] - losses[1]) / (2 * eps)
    got = float(np.sum(np.asarray(grad, np.float64) * direction))
    assert abs(got - want) <= GRAD_TOL * max(1.0, abs(want)), (name, got, want)


def test_bf16_inputs():
  case = CASE["groups2_packed"]
  x = make_inputs(case, jnp.bfloat16)
  y, state = chunked(*args(x), **kwargs(x), chunk_size=8)
  assert y.dtype == jnp.bfloat16 and state.dtype == jnp.float32
  # The oracle on the same (bf16-rounded) inputs: only the output's rounding differs.
  want_y, want_state = np_selective_scan(*args(x), **kwargs(x))
  assert_close(y, want_y, BF16_OUT_TOL, "bf16 y")
  assert_close(state, want_state, F32_TOL, "final state from bf16 inputs")


def test_prefill_then_decode_matches_full_run():
  case = CASE["mamba1"]
  x = make_inputs(case)
  want_y, want_state = chunked(*args(x), **kwargs(x), chunk_size=8)
  prefill = 10

  def tokens(t):
    return {n: x[n][:, t] for n in PER_TOKEN}

  head = tokens(np.arange(prefill))
  ys, state = chunked(head["x"], head["dt"], x["A"], head["B"], head["C"], D=x["D"],
                      initial_state=x["initial_state"], chunk_size=8)
  ys = [ys]
  for t in range(prefill, case.length):
    # T == 1 takes the per-token path.
    token = tokens(np.arange(t, t + 1))
    y, state = chunked(token["x"], token["dt"], x["A"], token["B"], token["C"], D=x["D"],
                       initial_state=state, chunk_size=8)
    ys.append(y)
  assert_close(jnp.concatenate(ys, axis=1), want_y, F32_TOL, "y")
  assert_close(state, want_state, F32_TOL, "final state")


def test_matches_transformers_mamba1():
  pytest.importorskip("torch")
  mamba = pytest.importorskip("transformers.models.mamba.modeling_mamba")
  import torch
  # mamba_ssm's layout: u, delta [b, channels, T], A [channels, N], B, C [b, N, T].
  case = CASE["mamba1"]
  x = make_inputs(case)
  torch_in = {n: torch.from_numpy(np.array(x[n])) for n in ("x", "dt", "A", "D")}
  b_in, c_in = (torch.from_numpy(np.asarray(x[n][:, :, 0]).transpose(0, 2, 1).copy())
                for n in ("B", "C"))
  want_y, want_state = mamba.mamba_selective_scan(
      torch_in["x"].transpose(1, 2), torch_in["dt"].transpose(1, 2), torch_in["A"], b_in,
      c_in, D=torch_in["D"], return_last_state=True)
  for fn in (functools.partial(chunked, chunk_size=8), reference):
    y, state = fn(*args(x), D=x["D"])  # transformers' scan starts from zeros
    assert_close(y, want_y.numpy().transpose(0, 2, 1), F32_TOL, "y")
    assert_close(state, want_state.numpy(), F32_TOL, "final state")


@pytest.mark.parametrize("inner", INNER)
def test_backward_keeps_no_per_token_state(inner):
  # With the chunk body rematerialised, the residuals are the inputs (a few copies) and
  # one carried state per chunk, never a [batch, T, channels, N] tensor; the reference,
  # which keeps one state per token, shows the check can fail.
  b, t, ch, g, n, chunk = 2, 40, 8, 2, 4, 8
  shapes = [(b, t, ch), (b, t, ch), (ch, n), (b, t, g, n), (b, t, g, n)]
  inputs = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
  per_token_states = b * t * ch * n

  def residual_sizes(fn):
    residuals = jax.tree.leaves(jax.eval_shape(lambda *a: jax.vjp(fn, *a)[1], *inputs))
    return [int(np.prod(r.shape)) for r in residuals]

  sizes = residual_sizes(functools.partial(kernels.selective_scan, chunk_size=chunk,
                                           inner=inner))
  assert max(sizes) < per_token_states // 2, sizes
  input_size = sum(np.prod(s) for s in shapes)
  chunk_states = (t // chunk + 1) * b * ch * n
  assert sum(sizes) <= 4 * input_size + chunk_states
  assert max(residual_sizes(kernels.selective_scan_reference)) >= per_token_states


# Argument checks: a user's shape mistake is a ValueError naming the argument.

BB, T, CH, G, N = 2, 5, 6, 2, 3
GOOD = dict(x=(BB, T, CH), dt=(BB, T, CH), A=(CH, N), B=(BB, T, G, N), C=(BB, T, G, N),
            D=None)
BAD = [
    ("x", dict(x=(BB, T))),
    ("dt", dict(dt=(BB, T, CH + 1))),
    ("dt", dict(dt=(BB, T + 1, CH))),
    ("B", dict(B=(BB, T, N))),
    ("B", dict(B=(BB, T + 1, G, N))),
    ("B", dict(B=(BB, T, 4, N), C=(BB, T, 4, N))),  # 4 groups do not divide 6 channels
    ("B", dict(B=(BB, T, 0, N), C=(BB, T, 0, N))),
    ("C", dict(C=(BB, T, G, N + 1))),
    ("C", dict(C=(BB, T, 1, N))),
    ("A", dict(A=(N, CH))),
    ("A", dict(A=(CH,))),
    ("D", dict(D=(CH, 1))),
    ("D", dict(D=(N,))),
    ("segment_ids", dict(segment_ids=(BB, T + 1))),
    ("initial_state", dict(initial_state=(BB, N, CH))),
    ("initial_state", dict(initial_state=(BB, G, CH // G, N))),
    ("chunk_size", dict(chunk_size=0)),
    ("chunk_size", dict(chunk_size=2.5)),
    ("chunk_size", dict(chunk_size=True)),
]


@pytest.mark.parametrize("name,change", BAD,
                         ids=[f"{n}{i}" for i, (n, _) in enumerate(BAD)])
def test_bad_arguments_raise(name, change):
  assert_bad_argument_raises(kernels.selective_scan, kernels.selective_scan_reference,
                             GOOD, name, change)


def test_inner_picks_a_way_and_refuses_others():
  """inner=None runs the CPU backend's sequential chunks (the same numbers as either
  named way); another name is a ValueError naming the argument."""
  x = make_inputs(CASE["groups2_packed"])
  auto = chunked(*args(x), **kwargs(x), chunk_size=8)
  for inner in INNER:
    assert_close(chunked(*args(x), **kwargs(x), chunk_size=8, inner=inner)[0], auto[0],
                 F32_TOL, inner)
  call = {n: np.zeros(s, np.float32) for n, s in GOOD.items() if s is not None}
  with pytest.raises(ValueError, match=r"^inner must be one of"):
    kernels.selective_scan(**call, inner="parallel")
