"""ALiBi (attention with linear biases: BLOOM, MPT, Falcon-RW, Baichuan-13B): every kernel
against the independent numpy oracle (forward) and the reference's autodiff (gradients),
with BLOOM's slopes for 6 heads; the ring at its true positions; decode and paged decode
on each row's prefix; the bias in flash blocks that no mask touches; hostile slopes; and
the kernels that take the slopes lowered for GPU (Triton) and TPU (Mosaic)."""
import contextlib
import functools
import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from kernel_test_utils import assert_close, numpy_attention

import kernels

fa = importlib.import_module("kernels.flash_attention")  # the module, not the function

B, H, KVH, D = 2, 6, 2, 16


def bloom_slopes(heads: int) -> np.ndarray:
  """BLOOM's slopes (transformers' `build_alibi_tensor`): with p the largest power of two
  <= heads, 2^(-8 i / p) for i = 1..p, then for the other heads the odd powers of
  2^(-8 / 2p)."""
  p = 2 ** math.floor(math.log2(heads))
  slopes = [2.0 ** (-8.0 * i / p) for i in range(1, p + 1)]
  slopes += [2.0 ** (-8.0 * i / (2 * p)) for i in range(1, 2 * (heads - p), 2)]
  return np.asarray(slopes, np.float32)


SLOPES = bloom_slopes(H)


def test_bloom_slopes_for_a_non_power_of_two_head_count():
  np.testing.assert_array_equal(SLOPES, [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3])
  np.testing.assert_array_equal(bloom_slopes(8), [2.0**-i for i in range(1, 9)])


def _inputs(q_len, kv_len, seed=0):
  # numpy draws: jax.random would compile a program for every new shape.
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))  # noqa: E731
  return (normal(B, q_len, H, D), normal(B, kv_len, KVH, D), normal(B, kv_len, KVH, D),
          normal(B, q_len, H, D))


def _segments(t):
  """Leading padding (queries that see nothing), two sequences, trailing padding."""
  seg = np.ones((B, t), np.int32)
  seg[0, :5] = 0
  seg[1, t // 2:] = 2
  seg[1, t - 13:] = 0
  return jnp.asarray(seg)


IMPLEMENTATIONS = {
    "reference": dict(implementation="reference"),
    "chunked": dict(implementation="chunked", chunk_size=32),
    "flash_tpu": dict(implementation="pallas_tpu", block_q=128, block_kv=128, interpret=True),
    "flash_gpu": dict(implementation="pallas_gpu", block_q=32, block_kv=32, interpret=True),
}
# name: (q_len, kv_len, options). Lengths 96-136 so that the small slopes matter too.
CASES = {
    "causal_gqa": (128, 128, dict(causal=True)),
    "window_cap_segments": (112, 112, dict(causal=True, sliding_window=24, logits_soft_cap=3.0,
                                           segments=True)),
    "bidirectional_q_shorter": (80, 96, dict(causal=False)),
    "causal_q_shorter": (40, 136, dict(causal=True)),
    "ragged": (100, 100, dict(causal=True)),  # no multiple of any block
    "sinks": (96, 96, dict(causal=True, sinks=True)),
    # Two blocks a side for the TPU kernels, one pair hidden: compact grids step past it.
    "long_window": (256, 256, dict(causal=True, sliding_window=100)),
}
# The flash options that change the kernels' structure, on the cases they matter for:
# one backward kernel (dq fused into dk / dv's, or by atomic adds) and compact TPU grids.
VARIANTS = {
    "flash_tpu_fused_compact": (
        dict(implementation="pallas_tpu", block_q=128, block_kv=128, fused_bwd=True,
             compact_grid=True, interpret=True),
        ("long_window", "window_cap_segments", "causal_q_shorter")),
    "flash_gpu_dq_atomic": (
        dict(implementation="pallas_gpu", block_q=32, block_kv=32, dq_atomic=True,
             interpret=True),
        ("long_window", "window_cap_segments", "causal_q_shorter")),
}


def _reference_grads(q, k, v, dout, slopes, sinks, kw):
  """The reference's autodiff (its forward is checked against the oracle here and in
  test_reference), w.r.t. q, k, v and the sinks; in one jit (eagerly, each op would
  compile on its own)."""
  arrays = {n: kw[n] for n in ("q_segment_ids", "kv_segment_ids") if n in kw}
  options = {n: x for n, x in kw.items() if n not in arrays}

  @jax.jit
  def grads(q, k, v, dout, slopes, sinks, arrays):
    _, vjp = jax.vjp(lambda q, k, v, s: kernels.reference_attention(
        q, k, v, alibi_slopes=slopes, sinks=s, **arrays, **options), q, k, v, sinks)
    return vjp(dout)

  return grads(q, k, v, dout, slopes, sinks, arrays)


@pytest.mark.parametrize("case", [c for c in CASES if c != "long_window"])
@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_every_kernel_equals_the_oracle(impl, case):
  _check_kernel(IMPLEMENTATIONS[impl], case)


@pytest.mark.parametrize("impl,case", [(impl, case) for impl, (_, cases) in VARIANTS.items()
                                       for case in cases])
def test_flash_variants_equal_the_oracle(impl, case):
  options = VARIANTS[impl][0]
  if options.get("compact_grid") and case == "long_window":  # the grids are compact
    q, k, _, _ = _inputs(*CASES[case][:2])
    cfg = fa.make_config(q, k, backend="tpu", block_q=128, block_kv=128, compact_grid=True,
                         sliding_window=100, interpret=True, alibi=True)
    assert all(fa.compact_steps(c, n) for c, n in ((cfg, "fwd"), (cfg.for_backward(), "dkv")))
  _check_kernel(options, case)


def _check_kernel(implementation, case):
  """Forward against the oracle; q, k, v (and sinks) gradients against the reference's
  autodiff; none for the slopes; and the bias changes the output."""
  q_len, kv_len, options = CASES[case]
  q, k, v, dout = _inputs(q_len, kv_len)
  kw = dict(options)
  sinks = jnp.array([-2.0, 0.0, 1.0, 3.0, -1.0, 2.0]) if kw.pop("sinks", False) else None
  if kw.pop("segments", False):
    kw.update(q_segment_ids=_segments(q_len), kv_segment_ids=_segments(kv_len))
  slopes = jnp.asarray(SLOPES)

  @jax.jit
  def run(q, k, v, slopes, sinks, dout):
    out, vjp = jax.vjp(lambda q, k, v, slopes, sinks: kernels.dot_product_attention(
        q, k, v, alibi_slopes=slopes, sinks=sinks, **kw, **implementation),
        q, k, v, slopes, sinks)
    return out, vjp(dout)

  out, (dq, dk, dv, dslopes, dsinks) = run(q, k, v, slopes, sinks, dout)
  want = numpy_attention(q, k, v, alibi_slopes=SLOPES, sinks=sinks, **kw)
  assert_close(out, want, 2e-5, "out")
  want_grads = _reference_grads(q, k, v, dout, slopes, sinks, kw)
  for name, g, w in zip(("dq", "dk", "dv", "dsinks"), (dq, dk, dv, dsinks), want_grads):
    if w is not None:
      assert_close(g, w, 1e-4, name)
  # The slopes are constants, and the bias matters.
  np.testing.assert_array_equal(np.asarray(dslopes), 0.0)
  assert np.abs(np.asarray(out) - numpy_attention(q, k, v, sinks=sinks, **kw)).max() > 0.1


@pytest.mark.parametrize("backend,block,t", [("tpu", 128, 256), ("gpu", 32, 96)])
def test_the_bias_reaches_blocks_no_mask_touches(backend, block, t):
  """Non-causal, no segment ids, lengths whole blocks: the kernels' counters show that
  no visited block pair runs the mask, and yet the output, its lse (which holds the
  bias) and the gradients are ALiBi's."""
  q, k, v, dout = _inputs(t, t, seed=1)
  slopes = jnp.asarray(SLOPES)
  cfg = fa.make_config(q, k, causal=False, backend=backend, block_q=block, block_kv=block,
                       interpret=True, alibi=True)

  @jax.jit
  def run(q, k, v, dout, slopes):
    out, lse, fwd_counts = fa._forward(cfg, q, k, v, None, None, counts=True, slopes=slopes)
    di = jnp.einsum("bqhd,bqhd->bhq", dout, out)
    grads, (dq_counts, dkv_counts) = fa._backward(cfg.for_backward(), q, k, v, None, None,
                                                  dout, lse, di, counts=True, slopes=slopes)
    return out, fa.public_lse(lse), grads, (fwd_counts, dq_counts, dkv_counts)

  out, lse, grads, counts = run(q, k, v, dout, slopes)
  for name, c in zip(("fwd", "dq", "dkv"), counts):  # (visited, masked) block pairs
    c = np.asarray(c)
    assert c[..., 0].sum() == B * H * (t // block) ** 2, name
    assert c[..., 1].sum() == 0, f"{name} masked a block"
  assert_close(out, numpy_attention(q, k, v, causal=False, alibi_slopes=SLOPES), 2e-5, "out")
  # The lse by hand: logsumexp over keys of the scaled logits less slope * distance.
  qn, kn = np.asarray(q, np.float64), np.repeat(np.asarray(k, np.float64), H // KVH, axis=2)
  logits = np.einsum("bqhd,bkhd->bqhk", qn, kn) / np.sqrt(D) - (
      SLOPES.astype(np.float64)[None, None, :, None]
      * np.abs(np.arange(t)[:, None, None] - np.arange(t)[None, None, :]))
  top = logits.max(-1)
  assert_close(lse, top + np.log(np.exp(logits - top[..., None]).sum(-1)), 2e-5, "lse")
  want = _reference_grads(q, k, v, dout, slopes, None, dict(causal=False))
  for name, g, w in zip(("dq", "dk", "dv"), grads, want):
    assert_close(g, w, 1e-4, name)


@pytest.mark.parametrize("impl", ["chunked", "flash_tpu", "flash_gpu"])
def test_bf16_within_the_bf16_tolerance(impl):
  """bf16 inputs (f32 logits and bias inside) against the oracle on the same inputs."""
  q, k, v, _ = (x.astype(jnp.bfloat16) for x in _inputs(128, 128, seed=5))
  out = jax.jit(lambda q, k, v, slopes: kernels.dot_product_attention(
      q, k, v, alibi_slopes=slopes, **IMPLEMENTATIONS[impl]))(q, k, v, jnp.asarray(SLOPES))
  assert out.dtype == jnp.bfloat16
  assert_close(out, numpy_attention(q, k, v, alibi_slopes=SLOPES), 3e-2, impl)


# ----------------------------------------------------------------------------------
# Ring attention: sequence over 4 devices, heads over 2 (the slopes split with them).

RING_T = 64  # shards of 16 positions, zig-zag chunks of 8


def _ring_run(mesh, **options):
  @jax.jit
  def run(q, k, v, dout, segments, slopes):
    out, vjp = jax.vjp(lambda q, k, v: kernels.ring_attention_sharded(
        q, k, v, mesh=mesh, axis_name="sp", head_axis="heads", alibi_slopes=slopes,
        **segments, **options), q, k, v)
    return out, vjp(dout)
  return run


@pytest.fixture(scope="module")
def ring_mesh():
  return Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("sp", "heads"))


def _check_ring(mesh, causal=True, sliding_window=None, segments=True, **options):
  q, k, v, dout = _inputs(RING_T, RING_T, seed=2)
  seg, slopes = _segments(RING_T), jnp.asarray(SLOPES)
  ids = dict(q_segment_ids=seg, kv_segment_ids=seg) if segments else {}
  kw = dict(causal=causal, sliding_window=sliding_window)
  out, grads = _ring_run(mesh, **kw, **options)(q, k, v, dout, ids, slopes)
  kw.update(ids)
  assert_close(out, numpy_attention(q, k, v, alibi_slopes=SLOPES, **kw), 2e-5, "out")
  want = _reference_grads(q, k, v, dout, slopes, None, kw)
  for name, g, w in zip(("dq", "dk", "dv"), grads, want):
    assert_close(g, w, 1e-4, name)


@pytest.mark.parametrize("layout,block_kernel,options", [
    ("zigzag", "chunked", dict(chunk_size=8)),
    ("contiguous", "chunked", dict(chunk_size=8)),
    # Flash blocks with one backward kernel each (dq fused / by atomic adds), to compile
    # in seconds.
    ("zigzag", "flash", dict(backend="tpu", fused_bwd=True, interpret=True,
                             segments=False)),
    ("contiguous", "flash", dict(backend="gpu", block_q=16, block_kv=16, dq_atomic=True,
                                 interpret=True)),
])
def test_causal_ring_at_the_true_positions(ring_mesh, layout, block_kernel, options):
  """Each block kernel biases by its local positions; the ring corrects each block's lse
  to the shards' true distance, zig-zag chunks included."""
  _check_ring(ring_mesh, layout=layout, block_kernel=block_kernel, **options)


@pytest.mark.parametrize("kw", [
    dict(causal=False, layout="zigzag"),  # keys after the queries too
    dict(causal=True, sliding_window=20, layout="contiguous"),  # the windowed ring
])
def test_bidirectional_and_windowed_rings(ring_mesh, kw):
  _check_ring(ring_mesh, block_kernel="reference", **kw)


def test_sharded_attention_splits_the_slopes_with_the_heads():
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
  q, k, v, _ = _inputs(96, 96)
  out = jax.jit(lambda q, k, v, slopes: kernels.sharded_attention(
      q, k, v, mesh=mesh, batch_axis="data", head_axis="model", alibi_slopes=slopes,
      implementation="chunked", chunk_size=32))(q, k, v, jnp.asarray(SLOPES))
  assert_close(out, numpy_attention(q, k, v, alibi_slopes=SLOPES), 2e-5, "out")


# ----------------------------------------------------------------------------------
# Decode: the newest tokens of each row against its cache, at positions lengths - q_len.

LENGTHS = (13, 40)
INT8_TOLERANCE = 0.03  # as test_decode_attention: max|x| / 254 per element


def _per_row_oracle(q, k, v, alibi=True, **kw):
  """Each row attends to exactly its prefix: the numpy oracle, row by row."""
  return np.concatenate([numpy_attention(q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n],
                                         alibi_slopes=SLOPES if alibi else None, **kw)
                         for i, n in enumerate(LENGTHS)])


@functools.partial(jax.jit, static_argnames=("layout", "chunk", "ring", "window"))
def _decode(q, k, v, lengths, slopes, k_scale=None, v_scale=None, *, layout, chunk,
            ring=False, window=None):
  """decode_attention on a slot-major test cache, laid out as `layout` says, read at
  layer 1 of a two-layer stack (a model's scan over its layers)."""
  if layout == "bksh":
    k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    k_scale, v_scale = (None if s is None else jnp.swapaxes(s, 1, 2) for s in (k_scale, v_scale))
  stack = lambda x: None if x is None else jnp.stack([jnp.zeros_like(x), x])  # noqa: E731
  return kernels.decode_attention(q, stack(k), stack(v), lengths=lengths, layer=1,
                                  k_scale=stack(k_scale), v_scale=stack(v_scale),
                                  chunk_size=chunk, kv_layout=layout, ring=ring,
                                  sliding_window=window, alibi_slopes=slopes)


@pytest.mark.parametrize("layout,chunk", [("bskh", 8), ("bksh", 8), ("bskh", 64)])
def test_decode_on_each_prefix(layout, chunk):
  """Block by block (the last one overlapping) and in one block; f32, bf16 and int8."""
  q, k, v, _ = _inputs(2, 40)
  lengths, slopes = jnp.array(LENGTHS), jnp.asarray(SLOPES)
  out = _decode(q, k, v, lengths, slopes, layout=layout, chunk=chunk)
  want = _per_row_oracle(q, k, v)
  assert_close(out, want, 2e-5, "decode")
  assert np.abs(np.asarray(out) - _per_row_oracle(q, k, v, alibi=False)).max() > 0.1
  bf16 = _decode(*(x.astype(jnp.bfloat16) for x in (q, k, v)), lengths, slopes,
                 layout=layout, chunk=chunk)
  assert bf16.dtype == jnp.bfloat16
  assert_close(bf16, want, 3e-2, "bf16")
  (k8, ks), (v8, vs) = kernels.quantize_int8(k), kernels.quantize_int8(v)
  out8 = _decode(q, k8, v8, lengths, slopes, ks, vs, layout=layout, chunk=chunk)
  assert float(np.max(np.abs(np.asarray(out8) - want))) < INT8_TOLERANCE
  exact = _per_row_oracle(q, k8 * ks[..., None], v8 * vs[..., None])
  assert_close(out8, exact, 2e-5, "int8, exactly dequantised")


def test_decode_over_a_sliding_windows_ring_buffer():
  """16 slots, position p in slot p % 16: the bias is by each slot's newest position."""
  q, k, v, _ = _inputs(2, 40, seed=3)
  slots, window = 16, 8
  idx = np.stack([[n - 1 - ((n - 1 - s) % slots) for s in range(slots)] for n in LENGTHS])
  kc, vc = (jnp.take_along_axis(x, jnp.asarray(idx.clip(0))[:, :, None, None], axis=1)
            for x in (k, v))
  out = _decode(q, kc, vc, jnp.array(LENGTHS), jnp.asarray(SLOPES), layout="bskh", chunk=8,
                ring=True, window=window)
  assert_close(out, _per_row_oracle(q, k, v, sliding_window=window), 2e-5, "ring")


@pytest.mark.parametrize("per_block", [1, 5])
def test_paged_decode_on_each_prefix(per_block):
  """Pages of 8 in shuffled order, merged block by block and in one block; int8 too."""
  q, k, v, _ = _inputs(2, 40, seed=4)
  page_size, pages = 8, 5
  order = np.random.default_rng(0).permutation(B * pages)
  table = jnp.asarray(order.reshape(B, pages), jnp.int32)

  def pool(x):
    x = np.asarray(x).reshape(B * pages, page_size, *x.shape[2:])
    out = np.empty_like(x)
    out[order] = x
    return jnp.asarray(out)

  paged = jax.jit(functools.partial(kernels.paged_decode_attention, pages_per_block=per_block))
  lengths, slopes = jnp.array(LENGTHS), jnp.asarray(SLOPES)
  out = paged(q, pool(k), pool(v), page_table=table, lengths=lengths, alibi_slopes=slopes)
  want = _per_row_oracle(q, k, v)
  assert_close(out, want, 2e-5, "paged")
  (k8, ks), (v8, vs) = kernels.quantize_int8(k), kernels.quantize_int8(v)
  out8 = paged(q, pool(k8), pool(v8), page_table=table, lengths=lengths, alibi_slopes=slopes,
               k_scale=pool(ks), v_scale=pool(vs))
  assert float(np.max(np.abs(np.asarray(out8) - want))) < INT8_TOLERANCE
  assert_close(out8, _per_row_oracle(q, k8 * ks[..., None], v8 * vs[..., None]), 2e-5, "int8")


# ----------------------------------------------------------------------------------
# Hostile slopes, the Mosaic GPU kernels, and lowering for the accelerators.

BAD_SLOPES = [np.zeros(KVH, np.float32), np.zeros((H, 1), np.float32), np.zeros(H, np.int32),
              [0.5] * H]


@pytest.mark.parametrize("bad", BAD_SLOPES, ids=["kv_heads", "2d", "int", "list"])
def test_bad_slopes_name_the_argument(bad, ring_mesh):
  q, k, v, _ = _inputs(16, 16)
  message = r"alibi_slopes must be a float array \[heads\] = \(6,\)"
  calls = [
      lambda: kernels.dot_product_attention(q, k, v, alibi_slopes=bad,
                                            implementation="reference"),
      lambda: kernels.dot_product_attention(q, k, v, alibi_slopes=bad,
                                            implementation="chunked"),
      lambda: kernels.flash_attention(q, k, v, alibi_slopes=bad, interpret=True),
      lambda: kernels.decode_attention(q[:, :1], k, v, lengths=jnp.ones(B),
                                       alibi_slopes=bad),
      lambda: kernels.paged_decode_attention(
          q[:, :1], k.reshape(-1, 8, KVH, D), v.reshape(-1, 8, KVH, D),
          page_table=jnp.arange(4).reshape(B, 2), lengths=jnp.ones(B), alibi_slopes=bad),
      lambda: kernels.ring_attention_sharded(q, k, v, mesh=ring_mesh, axis_name="sp",
                                             alibi_slopes=bad),
  ]
  for call in calls:
    with pytest.raises(ValueError, match=message):
      call()


def test_mosaic_gpu_kernels_refuse_alibi_and_the_default_runs_triton():
  q, k, v, _ = _inputs(16, 16)
  slopes = jnp.asarray(SLOPES)
  for option in ("gpu_forward", "gpu_backward"):
    with pytest.raises(ValueError, match=f"{option}='mosaic' has no ALiBi"):
      kernels.flash_attention(q, k, v, backend="gpu", alibi_slopes=slopes,
                              **{option: "mosaic"})
  # On a Hopper target a call the Mosaic forward takes runs it by default; with ALiBi,
  # Triton.
  q16, k16 = (jnp.zeros((B, 128, H, 64), jnp.bfloat16), jnp.zeros((B, 128, KVH, 64),
                                                                  jnp.bfloat16))
  mosaic = importlib.import_module("kernels.flash_mosaic_gpu")
  with kernels.gpu_target("NVIDIA H100 80GB HBM3"):
    plain, alibi = (fa.make_config(q16, k16, backend="gpu", interpret=False, alibi=a)
                    for a in (False, True))
    if mosaic.unsupported(plain, q16, k16):
      pytest.skip("this host's CUDA runtime keeps the Mosaic GPU forward off anyway")
    assert fa._mosaic_forward(plain, q16, k16)
    assert not fa._mosaic_forward(alibi, q16, k16)
  assert "ALiBi" in mosaic.unsupported(alibi, q16, k16)


def _lower(backend, platform, **options):
  """Forward and backward of flash with ALiBi (6 heads, segment ids, a window), lowered
  for `platform` without the device."""
  def f(q, k, v, seg, slopes):
    fn = lambda q, k, v: kernels.flash_attention(  # noqa: E731
        q, k, v, backend=backend, interpret=False, q_segment_ids=seg, kv_segment_ids=seg,
        sliding_window=300, alibi_slopes=slopes, **options)
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(out)

  q = jax.ShapeDtypeStruct((1, 1000, H, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 1000, KVH, 128), jnp.bfloat16)
  args = (q, k, k, jax.ShapeDtypeStruct((1, 1000), jnp.int32),
          jax.ShapeDtypeStruct((H,), jnp.float32))
  with kernels.gpu_target() if platform == "cuda" else contextlib.nullcontext():
    return jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("dq_atomic", [False, True])
def test_lowers_for_gpu_with_triton(dq_atomic):
  calls = [line for line in _lower("gpu", "cuda", dq_atomic=dq_atomic).splitlines()
           if "__gpu$xla.gpu.triton" in line]
  assert len(calls) == (2 if dq_atomic else 3), calls


@pytest.mark.parametrize("fused_bwd", [False, True])
def test_lowers_for_tpu_with_the_slopes_in_smem(monkeypatch, capsys, fused_bwd):
  from jax._src.pallas.mosaic import tpu_info
  if not hasattr(tpu_info, "registry") or jax.default_backend() == "tpu":
    pytest.skip("needs jax's TPU info registry to describe a TPU from a CPU host")
  describe = getattr(tpu_info, "_get_tpu_info_impl", None) or tpu_info.get_tpu_info_for_chip
  monkeypatch.setitem(tpu_info.registry, jax.devices()[0].device_kind,
                      lambda: describe(tpu_info.ChipVersion.TPU_V5P, 1))
  monkeypatch.setattr(fa.pl, "pallas_call", functools.partial(fa.pl.pallas_call, debug=True))
  capsys.readouterr()
  text = _lower("tpu", "tpu", fused_bwd=fused_bwd, compact_grid=True)
  assert text.count("tpu_custom_call") == (2 if fused_bwd else 3)
  modules = capsys.readouterr().out.split("The Mosaic module for pallas_call")[1:]
  assert len(modules) == (2 if fused_bwd else 3)
  for module in modules:  # the slopes: one f32 [heads] operand in SMEM
    assert f"memref<{H}xf32, #tpu.memory_space<smem>>" in module
