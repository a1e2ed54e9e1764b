"""A tiny reward model trained on verifier-checked pairs, then used to score RL rollouts.

    python -m launch.pairs --domains='arithmetic/add_d1,arithmetic/sub_d1,lists/max_*,logic/parity_*' \
        --levels=1,2 --count=4096 --out=/tmp/rm_pairs.jsonl
    python -m launch.pairs --domains='arithmetic/add_d1,arithmetic/sub_d1,lists/max_*,logic/parity_*' \
        --levels=1,2 --count=512 --heldout --out=/tmp/rm_heldout.jsonl
    python -m launch.train --config=configs/reward_model_tiny.py --workdir=/tmp/rm \
        --config.rm.data=/tmp/rm_pairs.jsonl --config.rm.eval_data=/tmp/rm_heldout.jsonl \
        --config.export_hf=/tmp/rm_hf

`objective="reward_model"` trains a score-head transformer (the embedded default's tiny
trunk on the byte tokenizer) with the Bradley-Terry loss on the pairs: each prompt's
right answer (its demonstration) against a wrong one the domain's verifier rejects. It
logs `rm/rewards/accuracy` per step and the held-out pairs' `eval_rm/rewards/accuracy`,
checkpoints and resumes like a policy run, and writes a Hugging Face
`LlamaForSequenceClassification` folder to `export_hf`. An RL run then scores its rollouts
with it:

    python -m launch.train --config=configs/default.py --workdir=/tmp/rl_rm \
        --config.reward_model.path=/tmp/rm_hf --config.reward_model.mix=0.5

Start from a real model with `--config.init_from=/path/to/Qwen2.5-0.5B-Instruct` (its
trunk; the vocabulary projection is dropped and a fresh score head added) and the
matching `model.preset`, `tokenizer` and `architecture`.
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  c = default.get_config()
  c.objective = "reward_model"
  c.sft.steps = 0
  c.preference.steps = 0
  c.train.rl_steps = 0
  c.train.rows_per_microbatch = 16
  c.train.log_every = 10
  # batch_size counts pairs; center_coef is TRL's center_rewards_coefficient (keeps the
  # scores near 0; the Bradley-Terry loss alone fixes only their differences). A row's
  # optional "margin" asks its chosen answer to score that much higher.
  c.rm = ml_collections.ConfigDict(dict(
      steps=300, data="", eval_data="", eval_every=100, batch_size=32, lr=1e-3, warmup=10,
      center_coef=0.01))
  c.eval.seeds_per_domain = 0
  c.checkpoint.every = 100
  return c
