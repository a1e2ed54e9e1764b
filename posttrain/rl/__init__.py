"""posttrain.rl: the learning side of RL as small pure functions.

advantages  GAE, GRPO / Dr.GRPO group normalisation, RLOO, REINFORCE++ (registry), the
            on-policy distillation advantage
losses      PPO / GSPO / CISPO / GMPO / SAPO policy losses, aggregation modes as (sum, count),
            TIS, KL k1/k2/k3, entropy, clipped value loss, `rl_loss` combining them
presets     ppo, grpo, dapo, dr_grpo, gspo, cispo, gmpo, sapo, rloo, online_dpo, reinforce_pp;
            `algorithm_config`
packing     host-side packing of trajectories into rows and micro-batches
preference  preference losses of pairs (DPO, cDPO, rDPO, EXO, IPO, SLiC, NCA, SPPO, APO,
            SimPO, ORPO, RPO's NLL term) and packing of (prompt, chosen, rejected) pairs
kto         KTO and APO-zero from unpaired feedback: the losses, the reference point,
            packing labelled examples and their mismatched sequences
train_step  the jitted `(state, batch) -> (state, metrics)`: RL and preference steps
            share one update
"""
