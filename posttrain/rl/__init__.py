"""posttrain.rl: the learning side of RL as small pure functions.

advantages  GAE, GRPO / Dr.GRPO group normalisation, RLOO, REINFORCE++ (registry)
losses      PPO / GSPO surrogates, aggregation modes as (sum, count), TIS, KL k1/k2/k3,
            entropy, clipped value loss, `rl_loss` combining them
presets     ppo, grpo, dapo, dr_grpo, gspo, rloo, reinforce_pp; `algorithm_config`
packing     host-side packing of trajectories into rows and micro-batches
preference  offline preference losses (DPO, cDPO, IPO, SLiC hinge, SimPO, RPO's NLL term)
            and packing of (prompt, chosen, rejected) pairs
train_step  the jitted `(state, batch) -> (state, metrics)`: RL and preference steps
            share one update
"""
