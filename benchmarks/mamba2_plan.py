"""A Bamba-9B-shaped model under the Llama 3 8B LoRA recipe on a v5e-8: its plan, and its
RL update and rollout compiled for the slice on this host (libtpu, no TPU).

    python -m benchmarks.mamba2_plan [--remat=full] [--attention=9,18,27] [--rollout_only]

The model is transformers' BambaConfig defaults (d 4096, 32 layers, 32 heads / 8 kv, MLP
14336, vocabulary 128000; Mamba2: 128 heads of 64, one group, state 256, conv 4, chunks
of 256) with attention at layers 9, 18 and 27 (`--attention`: other layers, e.g.
7,15,23,31 for a pattern that repeats every eight layers, as granite-4.0-h's does every
ten), half of each head rotated; LoRA of rank 64 on every projection, the Mamba2 layers'
in_proj and out_proj included.
"""
import argparse

from configs import llama3_8b_lora_grpo_v5e8 as recipe
from posttrain import aot, models, planner

LAYERS = 32


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--remat", default="full", help="full, dots, ...")
  parser.add_argument("--attention", default="9,18,27",
                      help="the attention layers' indices, comma-separated")
  parser.add_argument("--rollout_only", action="store_true",
                      help="compile the rollout alone, not the update")
  args = parser.parse_args()
  attention = {int(i) for i in args.attention.split(",")}
  if not attention <= set(range(LAYERS)):
    parser.error(f"--attention: layer indices are 0..{LAYERS - 1}, got {args.attention}")
  c = recipe.get_config()
  kinds = tuple("full_attention" if i in attention else "linear_attention"
                for i in range(LAYERS))
  with c.unlocked():
    c.model.overrides.update(dict(
        architecture="BambaForCausalLM", vocab_size=128_000, d_model=4096, num_layers=LAYERS,
        num_heads=32, num_kv_heads=8, head_dim=128, ffn_dim=14_336, norm_eps=1e-5,
        max_position_embeddings=262_144, layer_types=kinds, linear_mixer="mamba2",
        linear_num_key_heads=1, linear_key_head_dim=256, linear_num_value_heads=128,
        linear_value_head_dim=64, linear_conv_kernel=4, linear_conv_bias=True,
        linear_chunk=256, remat=args.remat,
        lora_targets="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,in_proj,out_proj"))
    c.model.overrides.rope = models.RopeConfig(theta=10_000.0, partial_rotary_factor=0.5)
  plan_and_compile(c, rollout_only=args.rollout_only)


def plan_and_compile(c, *, rollout_only: bool = False, update_only: bool = False,
                     topology: str = "v5e:2x4") -> None:
  """Prints the plan of config `c` for 16 GiB chips, then its RL update (unless
  `rollout_only`) and rollout (unless `update_only`) compiled for `topology` on this
  host, each against it."""
  p = planner.plan(c, device_memory_gb=16)
  print(planner.format_plan(p), flush=True)
  train_resident, rollout_resident = planner.resident_outside_programs(p, c)
  devices = aot.tpu_devices(topology)
  if not rollout_only:
    report = aot.compile_rl_step(c, devices, topology=topology)
    print(aot.format_report(report, p.train_peak, train_resident), flush=True)
  if update_only:
    return
  rollout = aot.compile_rollout(c, devices)
  print(aot.format_rollout(rollout, p.rollout_peak, rollout_resident), flush=True)


if __name__ == "__main__":
  main()
