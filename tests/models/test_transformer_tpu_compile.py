"""The sharded model with flash attention compiles for a TPU slice (libtpu, no TPU).

On CPU the flash kernel runs in interpret mode, which XLA partitions like any other
program; on a TPU the Mosaic call cannot be partitioned. This compiles the model's
gradient and its prefill + decode for 4 v5e chips, parameters sharded by the rules.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from posttrain import models
from tests.tpu_aot import (cache_programs, compile_for, requires_libtpu, sharded_cache,
                           sharded_state, spec, tpu_mesh)

pytestmark = requires_libtpu

CFG = models.get_preset("tiny").replace(
    vocab_size=512, d_model=256, num_heads=4, num_kv_heads=2, head_dim=128, ffn_dim=512,
    num_layers=2, dtype="bfloat16", attention_impl="flash")


def _state_specs(mesh):
  return sharded_state(CFG, mesh)


@pytest.mark.slow
def test_flash_model_gradient_compiles_on_a_sharded_tpu_mesh():
  mesh = tpu_mesh("v5e", (2, 1, 2, 1), ("data", "fsdp", "tensor", "sequence"))
  graphdef, state = _state_specs(mesh)
  tokens = spec(mesh, (4, 1024), jnp.int32, P("data"))
  ctx = models.ShardingContext(mesh)

  def loss(state, tokens):
    model = nnx.merge(graphdef, state)
    segment_ids = jnp.ones_like(tokens)
    return model(tokens, segment_ids_BxT=segment_ids, ctx=ctx).astype(jnp.float32).mean()

  text = compile_for(mesh, jax.grad(loss), state, tokens).as_text()
  # Mosaic kernels (chosen for the mesh's TPU devices, not interpreted for the CPU host).
  assert text.count("tpu_custom_call") >= 3 * CFG.num_layers


@pytest.mark.parametrize("cache_dtype", [None, "int8"])
def test_flash_prefill_and_cached_decode_compile_on_a_sharded_tpu_mesh(cache_dtype):
  """The sampler's two programs: flash prefill into the KV cache, then one decode step
  (decode attention over the cache, bf16 or int8 with scales)."""
  mesh = tpu_mesh("v5e", (2, 1, 2, 1), ("data", "fsdp", "tensor", "sequence"))
  graphdef, state = _state_specs(mesh)
  ctx = models.ShardingContext(mesh)
  tokens = spec(mesh, (4, 512), jnp.int32, P("data"))
  step_tokens = spec(mesh, (4, 1), jnp.int32, P("data"))
  cache = sharded_cache(CFG, ctx, 4, 1024, jnp.int8 if cache_dtype else None)
  prefill, decode = cache_programs(graphdef, ctx, 512)

  assert "tpu_custom_call" in compile_for(mesh, prefill, state, tokens, cache).as_text()
  compile_for(mesh, decode, state, step_tokens, cache)


@pytest.mark.slow
@pytest.mark.parametrize("cache_dtype,scan", [
    ("int8", True),  # The default run's case; the rest run with -m slow.
    pytest.param(None, False, marks=pytest.mark.slow),
    pytest.param("int8", False, marks=pytest.mark.slow),
    pytest.param(None, True, marks=pytest.mark.slow)])
def test_decode_updates_the_kv_cache_in_place_on_tpu(cache_dtype, scan):
  """The sampler's decode loop writes each step's keys into the cache without copying
  any layer's whole cache (head_dim 128). Written as [K, H] windows per slot, XLA:TPU
  copied every layer's k and v cache between two layouts at every step. With the layers
  scanned the stacked cache rides in the scan's carry and is written in place too, and
  decode attention slices its blocks from the stack (sliced out whole, each layer's k
  and v were copied at every step)."""
  import re

  from flax import nnx

  from posttrain.sampling.sampler import Sampler
  cfg = CFG.replace(scan_layers=scan)
  mesh = tpu_mesh("v5e", (1, 4, 1, 1), ("data", "fsdp", "tensor", "sequence"))
  abstract = nnx.eval_shape(lambda: models.Transformer(cfg, rngs=nnx.Rngs(0)))
  sampler = Sampler(abstract, mesh=mesh, max_len=2048, cache_dtype=cache_dtype)
  with jax.set_mesh(mesh):
    _, decode = sampler.compile(64, 1024, 1024, distinct_prompts=8, temperature=1.0)
  text = decode.as_text()
  local = f"16,{CFG.num_kv_heads},2048,{CFG.head_dim}]"
  stacked = f"[{CFG.num_layers},{local}"
  assert (stacked in text) == scan
  copies = [line for line in text.splitlines()
            if re.search(r"\[(\d+,)?" + re.escape(local) + r"\{[^}]*\} copy\(", line)]
  assert not copies, copies[:2]
  if scan:  # Decode attention reads its blocks from the stack: no layer is sliced out.
    layers = [line for line in text.splitlines()
              if re.search(r"= \w+\[" + re.escape(local) + r"\{", line)]
    assert not layers, layers[:2]


def _all_gather_bytes_in_loops(text: str) -> int:
  """Bytes all-gathered per iteration by the while loops of a compiled program."""
  import re
  bodies = set(re.findall(r"while\([^)]*\)[^\n]*body=%?([\w.\-]+)", text))
  size = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "s8": 1, "pred": 1}
  total, current = 0, None
  for line in text.splitlines():
    if line and not line.startswith(" ") and line.rstrip().endswith("{"):
      current = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
    elif current in bodies and re.search(r" all-gather(-start)?\(", line):
      for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]\{", line.split(" all-gather")[0]):
        total += size.get(dtype, 4) * int(np.prod([int(d) for d in dims.split(",") if d]))
  return total


# Two samplers compiled for TPU (about 50 s): runs with -m slow. The default run keeps
# the sampler's sharded-weights compile below.
@pytest.mark.slow
@pytest.mark.parametrize("scan", [False, True])
def test_decode_gathers_no_weights_inside_its_loop_on_tpu(scan):
  """FSDP-sharded weights: XLA:TPU gathered each layer's weights inside the decode loop,
  at every step. The sampler gathers them once per call (gather_weights, the default),
  so the loop's all-gathers move activations only (also when the layers are scanned:
  the layer scan is a loop inside the decode loop)."""
  from posttrain.sampling.sampler import Sampler
  cfg = CFG.replace(scan_layers=scan)
  mesh = tpu_mesh("v5e", (1, 4, 1, 1), ("data", "fsdp", "tensor", "sequence"))
  abstract = nnx.eval_shape(lambda: models.Transformer(cfg, rngs=nnx.Rngs(0)))
  weights = sum(x.size * 2 for x in jax.tree.leaves(nnx.state(abstract)))  # bf16
  per_step = {}
  for gather in (True, False):
    sampler = Sampler(abstract, mesh=mesh, max_len=2048, gather_weights=gather)
    with jax.set_mesh(mesh):
      _, decode = sampler.compile(64, 1024, 1024, distinct_prompts=8, temperature=1.0)
    per_step[gather] = _all_gather_bytes_in_loops(decode.as_text())
  assert per_step[False] > weights / 10, per_step  # weights, at every step
  assert per_step[True] < per_step[False] / 10, per_step


@pytest.mark.slow
def test_sharded_weights_never_gather_the_whole_output_projection_on_tpu():
  """Weights left FSDP-sharded (gather_weights=False): XLA:TPU gathered the whole [D, V]
  output projection onto every device for the logits, in prefill and in every decode
  step (1 GiB a device for Llama 3's 128K vocabulary, most of the rollout's memory
  beyond the weights and the cache). The sampler splits the rows' D as the projection's
  is split and sums the partial logits instead."""
  import re

  from posttrain.sampling.sampler import Sampler
  # A vocabulary no other weight's shape shares, wide enough that XLA would not gather
  # the shards for their small size alone. (A tied projection is the embedding table
  # transposed, sharded the same way.)
  cfg = CFG.replace(d_model=1024, num_heads=8, ffn_dim=2048, vocab_size=8192,
                    tie_embeddings=False)
  mesh = tpu_mesh("v5e", (1, 4, 1, 1), ("data", "fsdp", "tensor", "sequence"))
  abstract = nnx.eval_shape(lambda: models.Transformer(cfg, rngs=nnx.Rngs(0)))
  sampler = Sampler(abstract, mesh=mesh, max_len=2048, gather_weights=False)
  with jax.set_mesh(mesh):
    programs = sampler.compile(64, 1024, 1024, distinct_prompts=8, temperature=1.0)
  whole = {f"[{cfg.d_model},{cfg.vocab_size}]", f"[{cfg.vocab_size},{cfg.d_model}]"}
  for program in programs:
    gathered = [line for line in program.as_text().splitlines()
                if re.search(r" all-gather(-start)?\(", line)
                and any(w in line.split(" all-gather")[0] for w in whole)]
    assert not gathered, gathered[:2]


def test_layers_of_both_kinds_scanned_decode_in_place_on_tpu():
  """Gemma-style layers, sliding (with their own rope) and full, stacked and scanned: the
  full layers' caches stack apart from the sliding layers' rings (768 slots: window 256
  + 512 - 1, rounded up, of the 2,048); each layer's keys go to both stacks (the other
  kind's write dropped), its flag picks the stack read and the kernel with a lax.cond,
  and that neither copies a carried stack at a decode step nor slices a layer out of it
  (blocks of 512 slots are read); the prefill body holds both flash kernels, once each,
  whatever the depth."""
  import re

  from posttrain.sampling.sampler import Sampler
  cfg = CFG.replace(scan_layers=True, num_layers=4, sliding_window=256,
                    layer_types=("sliding_attention", "full_attention") * 2, decode_chunk=512,
                    attn_logit_softcap=50.0, final_logit_softcap=30.0,
                    norm_unit_offset=True, sandwich_norms=True, embed_scale=True,
                    mlp_activation="gelu_tanh", rope_local=models.RopeConfig(theta=100.0))
  mesh = tpu_mesh("v5e", (1, 4, 1, 1), ("data", "fsdp", "tensor", "sequence"))
  abstract = nnx.eval_shape(lambda: models.Transformer(cfg, rngs=nnx.Rngs(0)))
  sampler = Sampler(abstract, mesh=mesh, max_len=2048, cache_dtype="int8")
  with jax.set_mesh(mesh):
    prefill, decode = sampler.compile(64, 1024, 1024, distinct_prompts=8, temperature=1.0)
  assert prefill.as_text().count("tpu_custom_call") == 2
  text = decode.as_text()
  for layers, slots in ((2, 2048), (2, 768)):
    local = f"16,{cfg.num_kv_heads},{slots},{cfg.head_dim}]"
    assert f"[{layers},{local}" in text
    copies = [line for line in text.splitlines()
              if re.search(r"\[(\d+,)?" + re.escape(local) + r"\{[^}]*\} copy\(", line)]
    sliced = [line for line in text.splitlines()
              if re.search(r"= \w+\[" + re.escape(local) + r"\{", line)]
    assert not copies and not sliced, (copies + sliced)[:2]
