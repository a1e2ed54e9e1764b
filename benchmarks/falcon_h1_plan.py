"""A Falcon-H1-7B-shaped model (7.6B) under the Llama 3 8B LoRA recipe on a v5e-8: its
plan, and its RL update and rollout compiled for the slice on this host (libtpu, no TPU).

    python -m benchmarks.falcon_h1_plan [--remat=full] [--rollout_only] [--norm=none]

The model: d 3072, 44 layers, vocabulary 130048 (its own output projection); attention
of 12 heads / 2 kv of 128 (rope theta 1e11) beside a Mamba2 mixer of 24 heads of 128
(mamba_d_ssm 3072), one group, state 256, conv 4, chunks of 256, in every layer
(`ModelConfig.parallel_mixer`); an MLP of 12288; the muP multipliers away from one.
`--norm`: where the Mamba2 output's norm sits (`linear_norm`; none by default, as
mamba_rms_norm=false). LoRA of rank 64 on every projection, the Mamba2 in_proj and
out_proj included.
"""
import argparse

from benchmarks.mamba2_plan import plan_and_compile
from configs import llama3_8b_lora_grpo_v5e8 as recipe
from posttrain import models


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--remat", default="full", help="full, dots, ...")
  parser.add_argument("--norm", default="none", choices=("none", "after_gate", "before_gate"),
                      help="where the Mamba2 output's RMS norm sits")
  parser.add_argument("--rollout_only", action="store_true",
                      help="compile the rollout alone, not the update")
  args = parser.parse_args()
  c = recipe.get_config()
  with c.unlocked():
    c.model.overrides.update(dict(
        architecture="FalconH1ForCausalLM", vocab_size=130_048, d_model=3072, num_layers=44,
        num_heads=12, num_kv_heads=2, head_dim=128, ffn_dim=12_288, norm_eps=1e-5,
        max_position_embeddings=262_144, parallel_mixer=True, linear_mixer="mamba2",
        linear_num_key_heads=1, linear_key_head_dim=256, linear_num_value_heads=24,
        linear_value_head_dim=128, linear_conv_kernel=4, linear_conv_bias=True,
        linear_chunk=256, linear_norm=args.norm, embedding_multiplier=5.6,
        lm_head_multiplier=0.04, key_multiplier=0.39, attention_in_multiplier=1.0,
        attention_out_multiplier=0.94, ssm_in_multiplier=1.25, ssm_out_multiplier=0.24,
        mlp_gate_multiplier=0.88, mlp_down_multiplier=0.59,
        ssm_multipliers=(0.35, 0.25, 0.35, 0.5, 0.35), remat=args.remat,
        lora_targets="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,in_proj,out_proj"))
    c.model.overrides.rope = models.RopeConfig(theta=1e11)
  plan_and_compile(c, rollout_only=args.rollout_only)


if __name__ == "__main__":
  main()
