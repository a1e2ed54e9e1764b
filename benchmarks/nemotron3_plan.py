"""A Nemotron-3-Nano-shaped model (30B, 3B active) under the Llama 3 8B LoRA recipe on a
v5e-8: its plan, and its RL update and rollout compiled for the slice on this host
(libtpu, no TPU).

    python -m benchmarks.nemotron3_plan [--remat=full] [--pattern=MEMEM*E...] [--rollout_only]
        [--latent=0] [--ep] [--expert_lora] [--lora_rank=64] [--topology=v5e:2x4]
        [--update_only]

The model (NVIDIA-Nemotron-3-Nano-30B-A3B's config.json): d 2688, vocabulary 131072; 32
heads / 2 kv of 128 without a position embedding; Mamba2: 64 heads of 64, 8 groups,
state 128, conv 4, chunks of 128; mixtures of 128 experts of 1856 without a gate (relu^2)
routed 6 a token by sigmoid scores (scaled by 2.5), beside a shared expert of 3712; 52
single-sublayer layers (`--pattern`, hybrid_override_pattern's letters: M Mamba2, *
attention, E mixture, - MLP; by default 23 Mamba2 layers, 23 mixtures and 6 attention
layers as the published model's). `--latent`: the experts in a latent of that width
(Nemotron 3 Super's layout). `--ep`: the experts split over fsdp (expert parallelism).
LoRA of rank 64 on the attention, the Mamba2 in_proj and the shared experts;
`--expert_lora`: on every routed expert's up_proj and down_proj too; `--lora_rank`:
another rank. `--topology`: another slice to compile for, the mesh the same (fsdp 8).
"""
import argparse

from benchmarks.mamba2_plan import plan_and_compile
from configs import llama3_8b_lora_grpo_v5e8 as recipe

PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
KINDS = {"M": "linear_attention", "*": "full_attention", "E": "moe", "-": "mlp"}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--remat", default="full", help="full, dots, ...")
  parser.add_argument("--pattern", default=PATTERN,
                      help="the layers' kinds: M (Mamba2), * (attention), E (mixture), - (MLP)")
  parser.add_argument("--latent", type=int, default=0, help="the experts' latent width (0: none)")
  parser.add_argument("--ep", action="store_true", help="the experts split over fsdp")
  parser.add_argument("--expert_lora", action="store_true",
                      help="adapters on the routed experts too (experts_up_proj, "
                      "experts_down_proj)")
  parser.add_argument("--lora_rank", type=int, default=64, help="the adapters' rank")
  parser.add_argument("--topology", default="v5e:2x4", help="the TPU slice compiled for")
  parser.add_argument("--update_only", action="store_true",
                      help="compile the update alone, not the rollout")
  parser.add_argument("--rollout_only", action="store_true",
                      help="compile the rollout alone, not the update")
  args = parser.parse_args()
  if args.update_only and args.rollout_only:
    parser.error("--update_only and --rollout_only: choose one")
  if not args.pattern or set(args.pattern) - set(KINDS) or "E" not in args.pattern:
    parser.error(f"--pattern: letters M, *, E and - only, with an E; got {args.pattern!r}")
  c = recipe.get_config()
  layers = len(args.pattern)
  with c.unlocked():
    c.model.overrides.update(dict(
        architecture="NemotronHForCausalLM", vocab_size=131_072, d_model=2688,
        num_layers=layers, num_heads=32, num_kv_heads=2, head_dim=128, ffn_dim=1856,
        dense_ffn_dim=1856 if "-" in args.pattern else 0, norm_eps=1e-5,
        max_position_embeddings=8192, layer_types=tuple(KINDS[k] for k in args.pattern),
        rope_layers=(0,) * layers, mlp_activation="relu2", linear_mixer="mamba2",
        linear_num_key_heads=8, linear_key_head_dim=128, linear_num_value_heads=64,
        linear_value_head_dim=64, linear_conv_kernel=4, linear_conv_bias=True,
        linear_chunk=128, linear_dt_min=0.001, num_experts=128, num_experts_per_tok=6,
        shared_expert_dim=3712, router_scoring="sigmoid", routed_scaling_factor=2.5,
        moe_latent_dim=args.latent, remat=args.remat, lora_rank=args.lora_rank,
        lora_targets="q_proj,k_proj,v_proj,o_proj,up_proj,down_proj,in_proj"
        + (",experts_up_proj,experts_down_proj" if args.expert_lora else "")))
    if args.ep:
      c.sharding_rules = (("experts", ("fsdp",)),)
  plan_and_compile(c, rollout_only=args.rollout_only, update_only=args.update_only,
                   topology=args.topology)


if __name__ == "__main__":
  main()
