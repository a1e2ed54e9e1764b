"""PPO with a critic (value head on the policy trunk) and GAE, on the tiny CPU policy.

    python -m launch.train --config=configs/ppo_tiny.py --workdir=/tmp/posttrain_ppo

What to expect on 2 CPU cores: the SFT warm start as in configs/default.py, then PPO with
one sample per prompt, a per-token k1 KL penalty in the reward, GAE advantages from the
value head and 4 minibatches per rollout batch. loss/value falls over the first steps as
the critic fits the returns; reward/mean rises slowly. About 8 minutes.
"""

from configs import default


def get_config():
  c = default.get_config()
  c.algorithm = "ppo"
  c.model.value_head = True
  c.rl.group_size = 1
  c.rl.kl_coef = 0.01
  c.rollout.prompts_per_step = 128
  c.train.rl_steps = 30
  return c
