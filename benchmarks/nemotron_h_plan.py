"""A Nemotron-H-8B-shaped model under the Llama 3 8B LoRA recipe on a v5e-8: its plan, and
its RL update and rollout compiled for the slice on this host (libtpu, no TPU).

    python -m benchmarks.nemotron_h_plan [--remat=full] [--pattern=M-M*-...] [--rollout_only]

The model is transformers' NemotronHConfig defaults (d 4096, MLP 21504 of squared ReLU,
32 heads / 8 kv of 128 without a position embedding, vocabulary 131072; Mamba2: 128
heads of 64, 8 groups, state 128, conv 4, chunks of 128) over 52 single-sublayer layers
(`--pattern`, hybrid_override_pattern's letters: M Mamba2, * attention, - MLP; by default
24 Mamba2 layers, 4 attention layers and 24 MLPs, as Nemotron-H-8B's); LoRA of rank 64
on every projection it has (q/k/v/o, up, down, the Mamba2 layers' in_proj and out_proj).
"""
import argparse

from benchmarks.mamba2_plan import plan_and_compile
from configs import llama3_8b_lora_grpo_v5e8 as recipe

PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
KINDS = {"M": "linear_attention", "*": "full_attention", "-": "mlp"}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--remat", default="full", help="full, dots, ...")
  parser.add_argument("--pattern", default=PATTERN,
                      help="the layers' kinds: M (Mamba2), * (attention), - (MLP)")
  parser.add_argument("--rollout_only", action="store_true",
                      help="compile the rollout alone, not the update")
  args = parser.parse_args()
  if not args.pattern or set(args.pattern) - set(KINDS):
    parser.error(f"--pattern: letters M, * and - only, got {args.pattern!r}")
  c = recipe.get_config()
  layers = len(args.pattern)
  with c.unlocked():
    c.model.overrides.update(dict(
        architecture="NemotronHForCausalLM", vocab_size=131_072, d_model=4096,
        num_layers=layers, num_heads=32, num_kv_heads=8, head_dim=128, ffn_dim=21_504,
        norm_eps=1e-5, max_position_embeddings=8192,
        layer_types=tuple(KINDS[k] for k in args.pattern), rope_layers=(0,) * layers,
        mlp_activation="relu2", linear_mixer="mamba2", linear_num_key_heads=8,
        linear_key_head_dim=128, linear_num_value_heads=128, linear_value_head_dim=64,
        linear_conv_kernel=4, linear_conv_bias=True, linear_chunk=128,
        linear_dt_min=0.001, remat=args.remat,
        lora_targets="q_proj,k_proj,v_proj,o_proj,up_proj,down_proj,in_proj,out_proj"))
  plan_and_compile(c, rollout_only=args.rollout_only)


if __name__ == "__main__":
  main()
