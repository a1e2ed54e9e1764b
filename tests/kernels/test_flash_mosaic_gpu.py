"""The Hopper (Mosaic GPU) flash forward: its block schedule against a brute-force mask,
lowering for CUDA without a GPU, and the choice between it and the Triton forward.
Its numbers are checked on an H200 by `python -m benchmarks.attention --accelerator-only`
(the Mosaic GPU interpreter of this jax cannot run wgmma kernels on CPU)."""
import importlib

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

fa = importlib.import_module("kernels.flash_attention")  # the module, not the function
fm = importlib.import_module("kernels.flash_mosaic_gpu")


def _visible(cfg, q_rows, kv_block, block_kv):
  """Brute force: [rows, keys] visibility of real query rows against one kv block."""
  q_pos = np.asarray(q_rows)[:, None] + cfg.offset
  kv_pos = kv_block * block_kv + np.arange(block_kv)[None, :]
  mask = np.broadcast_to(kv_pos < cfg.kv_len, (len(q_rows), block_kv)).copy()
  if cfg.causal:
    mask &= q_pos >= kv_pos
  if cfg.sliding_window is not None:
    mask &= q_pos - kv_pos < cfg.sliding_window
    if not cfg.causal:
      mask &= kv_pos - q_pos < cfg.sliding_window
  return mask


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(
    q_len=st.integers(1, 700), kv_len=st.integers(1, 700), causal=st.booleans(),
    window=st.one_of(st.none(), st.integers(1, 400)), head_dim=st.sampled_from([128, 256]),
    offset=st.one_of(st.none(), st.integers(-300, 300)))
def test_schedule_runs_exactly_the_visible_blocks(q_len, kv_len, causal, window, head_dim,
                                                  offset):
  """Per pair of q tiles: both consumers run the same steps (the producer's union, in
  order, so barrier phases match); each computes exactly the kv blocks a real row of its
  tile sees, and skips the element mask only where no element is masked."""
  hypothesis.assume(causal or window is None or offset is None)
  q = jax.ShapeDtypeStruct((1, q_len, 1, head_dim), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, kv_len, 1, head_dim), jnp.bfloat16)
  cfg = fa.make_config(q, k, causal=causal, sliding_window=window, q_offset=offset,
                       backend="gpu", interpret=True)
  block_kv, _ = fm.kv_block_and_slots(head_dim)
  cfg = fm._tile_config(cfg, block_kv)
  pairs = -(-q_len // (fm.CONSUMERS * fm.TILE_Q))
  for pair in range(pairs):
    first = pair * fm.CONSUMERS
    u_lo, n = (int(x) for x in fm._union(cfg, first))
    if n:
      assert 0 <= u_lo and u_lo + n <= cfg.num_kv_blocks
    for tile in (first, first + 1):
      spans = fm._spans(u_lo, u_lo + n - 1, fa.kv_block_range(cfg, tile),
                        fa.kv_full_range(cfg, tile))
      spans = [(int(a), int(b), kind) for a, b, kind in spans]
      assert spans[0][0] == u_lo and spans[-1][1] == u_lo + n
      for (_, stop, _), (start, _, _) in zip(spans, spans[1:]):
        assert stop == start
      assert all(a <= b for a, b, _ in spans), spans
      computed = {i for a, b, kind in spans if kind != "skip" for i in range(a, b)}
      unmasked = {i for a, b, kind in spans if kind == "full" for i in range(a, b)}
      rows = np.arange(tile * fm.TILE_Q, min((tile + 1) * fm.TILE_Q, q_len))
      if not len(rows):  # a tile of padding rows: whatever it computes is dropped
        continue
      want = {i for i in range(cfg.num_kv_blocks)
              if _visible(cfg, rows, i, block_kv).any()}
      assert computed == want, (tile, spans, sorted(want))
      for i in unmasked:
        assert _visible(cfg, rows, i, block_kv).all(), (tile, i)


def _lower(gpu_forward="mosaic", q_len=1000, kv_len=1000, heads=4, kv_heads=2, d=128,
           dtype=jnp.bfloat16, segments=False, **mask):
  def f(q, k, v, seg):
    ids = dict(q_segment_ids=seg, kv_segment_ids=seg) if segments else {}
    fn = lambda q, k, v: fa.flash_attention(  # noqa: E731
        q, k, v, backend="gpu", interpret=False, gpu_forward=gpu_forward, **ids, **mask)
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(out)
  q = jax.ShapeDtypeStruct((1, q_len, heads, d), dtype)
  k = jax.ShapeDtypeStruct((1, kv_len, kv_heads, d), dtype)
  seg = jax.ShapeDtypeStruct((1, q_len), jnp.int32)
  return jax.jit(f).trace(q, k, k, seg).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("kwargs", [
    dict(causal=True),
    dict(causal=True, sliding_window=300, logits_soft_cap=30.0),
    dict(causal=False, d=64, kv_heads=1, dtype=jnp.float16),
    dict(causal=True, q_len=300, d=256),
    dict(causal=True, q_len=1000, kv_len=300, d=192),
])
def test_lowers_for_cuda_with_mosaic_forward(kwargs):
  """Forward: one Mosaic GPU kernel; backward: the Triton dq and dk / dv kernels."""
  text = _lower(**kwargs)
  assert text.count("custom_call @mosaic_gpu") == 1, text.count("mosaic_gpu")
  triton = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
  assert len(triton) == 2 and not any("flash_attention_fwd" in c for c in triton)


def test_triton_forward_when_asked_or_unsupported():
  for text in (_lower(gpu_forward="triton", causal=True),
               _lower(gpu_forward=None, causal=True, segments=True),
               _lower(gpu_forward=None, causal=True, d=96)):
    assert "custom_call @mosaic_gpu" not in text
    assert text.count("__gpu$xla.gpu.triton") == 3


def test_auto_needs_a_hopper_device(monkeypatch):
  assert not fm.hopper_device()  # the CPU test host
  monkeypatch.setattr(fm, "hopper_device", lambda: True)
  assert "custom_call @mosaic_gpu" in _lower(gpu_forward=None, causal=True)


@pytest.mark.parametrize("kwargs,message", [
    (dict(gpu_forward="cudnn"), "gpu_forward must be 'mosaic', 'triton' or None"),
    (dict(backend="tpu", gpu_forward="mosaic"), "gpu_forward is an option of the gpu"),
    (dict(gpu_forward="mosaic", d=96), "cannot run this call: head_dim 96"),
    (dict(gpu_forward="mosaic", dtype=jnp.float32), "cannot run this call: dtype float32"),
    (dict(gpu_forward="mosaic", segments=True), "cannot run this call: segment ids"),
])
def test_bad_mosaic_options(kwargs, message):
  d, dtype = kwargs.pop("d", 128), kwargs.pop("dtype", jnp.bfloat16)
  x = jnp.zeros((1, 128, 2, d), dtype)
  if kwargs.pop("segments", False):
    kwargs.update(q_segment_ids=jnp.ones((1, 128), jnp.int32),
                  kv_segment_ids=jnp.ones((1, 128), jnp.int32))
  with pytest.raises(ValueError, match=message):
    fa.flash_attention(x, x, x, **({"backend": "gpu", "interpret": False} | kwargs))


def test_shared_memory_plan():
  assert fm.kv_block_and_slots(64) == (128, 2)
  assert fm.kv_block_and_slots(128) == (128, 2)
  assert fm.kv_block_and_slots(256) == (64, 2)
