"""DAPO (clip-higher, token-mean loss, dynamic sampling, overlong shaping) on the tiny policy.

    python -m launch.train --config=configs/dapo_tiny.py --workdir=/tmp/posttrain_dapo

What to expect on 2 CPU cores: the SFT warm start as in configs/default.py, then DAPO with
8 samples per prompt. Groups whose rewards are all equal are dropped and replaced
(dynamic_sampling/draws and dynamic_sampling/dropped in metrics.jsonl count them), and
completions that run into the last 8 tokens of the budget are softly penalised. About
10 minutes.
"""

from configs import default


def get_config():
  c = default.get_config()
  c.algorithm = "dapo"
  c.rl.group_size = 8
  c.rl.overlong_buffer_len = 8
  c.rollout.max_draws = 96
  c.train.rl_steps = 30
  return c
