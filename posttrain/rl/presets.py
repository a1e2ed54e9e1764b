"""Algorithm presets: one registry, every knob in one flat ConfigDict.

A run config names the algorithm and leaves room for overrides:

    config.algorithm = "grpo"
    config.rl = presets.algorithm_overrides()      # every knob, None = keep preset

and the trainer resolves them with

    rl = presets.algorithm_config(config.algorithm, **config.rl)

so `--config.algorithm=dapo --config.rl.eps_high=0.3` picks DAPO and raises its
upper clip. Knobs:

    advantage_estimator  gae | grpo | rloo | reinforce_pp | reinforce_pp_baseline | opo |
                         gpg | grpo_passk | remax (advantages.py)
    normalize_std        divide group advantages by the group std (off: Dr.GRPO)
    use_critic, gamma, lam, value_coef, value_clip      PPO critic and GAE
    policy_loss          ppo | gspo | cispo | gmpo | gpg | sapo | clip_cov | kl_cov
                         (losses.py)
    eps_low, eps_high    ratio clip range [1 - eps_low, 1 + eps_high] (gmpo: log ratio
                         range [-eps_low, eps_high]; gpg, sapo, kl_cov: unused); eps_low =
                         1: no lower clip
    sapo_tau_pos, sapo_tau_neg   sapo's gate temperatures for positive and negative
                         advantages (larger: the gate closes sooner as the ratio leaves 1)
    cov_fraction         clip_cov / kl_cov: the share of the batch's tokens selected by
                         their covariance between log-prob and advantage
    clip_cov_lb, clip_cov_ub   clip_cov draws them from covariances in (lb, ub)
    kl_cov_coef          kl_cov's weight on |log ratio| of the selected tokens
    top_entropy_fraction  < 1: the policy loss on only that share of the batch's tokens,
                         those of highest entropy (Wang et al. 2025 keep 0.2); the KL,
                         entropy and value terms and the normaliser still see every
                         token; 1 = off (losses.high_entropy_selection)
    dual_clip            c > 1 bounds the loss of negative advantages; 0 = off
    loss_agg_mode        token_mean | seq_mean_token_mean | seq_mean_token_sum_norm
    max_response_len     Dr.GRPO's constant normaliser; 0 = the sampler's budget
    kl_coef, kl_estimator (k1 | k2 | k3), kl_in_reward   KL to the reference (in the
                         reward: the token-level estimators gae and reinforce_pp)
    kl_controller        fixed | adaptive: kl_coef is the first value of a coefficient
                         moved each step toward holding the KL at kl_target, by at most
                         20% per kl_horizon samples (Ziegler et al. 2019; veRL, TRL)
    kl_target, kl_horizon   the adaptive controller's target KL and horizon
    entropy_coef         entropy bonus weight
    tis_cap              importance weight cap between sampler and learner; 0 = off
    tis_level            token | sequence (the ratios' product) | geometric (their mean
                         in log space): what the weight is of (losses.py)
    tis_mode             truncate (TIS: min(w, cap)) | mask (MIS: 0 outside
                         [tis_lower, tis_cap]; tis_lower 0 = 1 / tis_cap)
    tis_veto             > 0: a sequence with a token ratio below it gets weight 0
    group_size           samples per prompt
    dynamic_sampling     drop groups whose rewards are all equal (DAPO)
    overlong_penalty, overlong_buffer_len, overlong_penalty_factor   DAPO soft penalty
    mask_truncated       overlong filtering (DAPO's alternative to the penalty): a sample
                         that never ended (finish_reason "length": max_new_tokens or the
                         sampler's max_len, a reasoning model cut off while thinking)
                         keeps its reward in its group's advantages but trains no token
    ppo_epochs, num_minibatches   passes and optimizer steps per rollout batch
    routing_replay       none | old | rollout: a mixture of experts' learner sends each
                         token to given experts, weighted by its router's probabilities
                         of them. old: with several updates a batch (ppo_epochs or
                         num_minibatches > 1), the experts the policy chose before the
                         first update (the old log-probs' pass; GSPO's Routing Replay,
                         Zheng et al. 2025), so the ratio compares the same experts
                         however the updates move the routers. rollout: the experts the
                         sampler chose for each token (Rollout Routing Replay, R3, Ma et
                         al. 2025), for the old log-probs and every update: learner and
                         sampler then differ only by numerics within the same experts
    preference_loss      "" = the policy-gradient update above; a paired loss of
                         posttrain.rl.preference (sigmoid, ipo, simpo, ...) = online
                         preference optimisation: each group's best sample against
                         its worst (by verified reward) as a DPO-family pair
                         (posttrain.rl.preference), the reference the policy RL started from
                         An unpaired loss (kto, apo_zero_unpaired) labels samples
                         instead: above their group's mean reward desirable, below it
                         undesirable, at it (and every sample of a tied group) left out
    beta, label_smoothing, simpo_gamma, sft_coef, discopop_tau   that loss's knobs
                         (PreferenceConfig)
    desirable_weight, undesirable_weight   an unpaired loss's weights of its labels
    pairs_per_group      pairs a group gives: its i-th best against its i-th worst
"""

from typing import Any

import ml_collections
from ml_collections import config_dict

from posttrain.rl import advantages as advantages_lib
from posttrain.rl import losses as losses_lib
from posttrain.rl import preference as preference_lib

# Every knob with its default; a preset states only where it differs.
_BASE: dict[str, Any] = dict(
    advantage_estimator="grpo",
    normalize_std=True,
    use_critic=False,
    gamma=1.0,
    lam=0.95,
    value_coef=0.5,
    value_clip=0.2,
    policy_loss="ppo",
    eps_low=0.2,
    eps_high=0.2,
    dual_clip=0.0,
    loss_agg_mode="token_mean",
    max_response_len=0,
    kl_coef=0.0,
    kl_estimator="k3",
    kl_in_reward=False,
    kl_controller="fixed",
    kl_target=0.1,
    kl_horizon=10000,
    entropy_coef=0.0,
    tis_cap=0.0,
    tis_level="token",
    tis_mode="truncate",
    tis_lower=0.0,
    tis_veto=0.0,
    group_size=8,
    dynamic_sampling=False,
    overlong_penalty=False,
    overlong_buffer_len=1024,
    overlong_penalty_factor=1.0,
    mask_truncated=False,
    ppo_epochs=1,
    num_minibatches=1,
    routing_replay="none",
    preference_loss="",
    beta=0.1,
    label_smoothing=0.0,
    simpo_gamma=0.5,
    sft_coef=0.0,
    discopop_tau=0.05,
    desirable_weight=1.0,
    undesirable_weight=1.0,
    pairs_per_group=1,
    cov_fraction=2e-4,
    clip_cov_lb=1.0,
    clip_cov_ub=5.0,
    kl_cov_coef=1.0,
    sapo_tau_pos=1.0,
    sapo_tau_neg=1.05,
    top_entropy_fraction=1.0,
)

_PRESETS: dict[str, dict[str, Any]] = {
    # Ouyang et al. 2022 / verl: critic + GAE, per-token KL penalty in the reward.
    "ppo": dict(
        advantage_estimator="gae",
        use_critic=True,
        group_size=1,
        kl_coef=0.001,
        kl_estimator="k1",
        kl_in_reward=True,
        num_minibatches=4,
    ),
    # Shao et al. 2024 (DeepSeekMath): group baseline, k3 KL as a loss term.
    "grpo": dict(
        loss_agg_mode="seq_mean_token_mean",
        kl_coef=0.04,
        kl_estimator="k3",
    ),
    # Yu et al. 2025: clip-higher, token-level loss, dynamic sampling, overlong shaping, no KL.
    "dapo": dict(
        eps_high=0.28,
        loss_agg_mode="token_mean",
        group_size=16,
        dynamic_sampling=True,
        overlong_penalty=True,
        overlong_buffer_len=4096,
    ),
    # Liu et al. 2025: no std normalisation, constant-length token-sum normaliser.
    "dr_grpo": dict(
        normalize_std=False,
        loss_agg_mode="seq_mean_token_sum_norm",
    ),
    # Zheng et al. 2025: sequence-level ratio, tiny clip range.
    "gspo": dict(
        policy_loss="gspo",
        eps_low=3e-4,
        eps_high=4e-4,
        loss_agg_mode="seq_mean_token_mean",
    ),
    # MiniMax-M1 (2025): the importance weight clipped and held constant, every token's
    # gradient kept; no lower bound (eps_low 1); the upper bound is DAPO's clip-higher
    # (MiniMax tunes it).
    "cispo": dict(
        policy_loss="cispo",
        eps_low=1.0,
        eps_high=0.28,
        loss_agg_mode="token_mean",
    ),
    # Zhao et al. 2025: the geometric mean of the token ratios, clipped in log space to
    # (e^-0.4, e^0.4).
    "gmpo": dict(
        policy_loss="gmpo",
        eps_low=0.4,
        eps_high=0.4,
        loss_agg_mode="seq_mean_token_mean",
    ),
    # Gao et al. 2025 (Qwen): a smooth gate on the token ratio in place of the clip,
    # closing sooner for negative advantages (tau 1.05 against 1.0), GRPO advantages and
    # sequence-mean aggregation; several updates per rollout batch, where the ratio moves
    # off 1 and the gate acts (on-policy it is GRPO's gradient).
    "sapo": dict(
        policy_loss="sapo",
        sapo_tau_pos=1.0,
        sapo_tau_neg=1.05,
        loss_agg_mode="seq_mean_token_mean",
        num_minibatches=4,
    ),
    # Cui et al. 2025 (the entropy mechanism of RL for reasoning models): GRPO advantages,
    # the gradient of a few tokens of high covariance between log-prob and advantage cut
    # (Clip-Cov: 2e-4 of the tokens, drawn from covariances in (1, 5)) or pulled back to
    # the old policy (KL-Cov: the top 2e-3, the paper's choice for a 7B model, 2e-4 for a
    # 32B; coefficient 1). Several updates per rollout batch: KL-Cov's penalty is 0 on a
    # batch's first update, where the ratio is 1.
    "clip_cov": dict(
        policy_loss="clip_cov",
        cov_fraction=2e-4,
        loss_agg_mode="token_mean",
        num_minibatches=4,
    ),
    "kl_cov": dict(
        policy_loss="kl_cov",
        cov_fraction=2e-3,
        kl_cov_coef=1.0,
        loss_agg_mode="token_mean",
        num_minibatches=4,
    ),
    # Chu et al. 2025: the plain policy gradient (no ratio, clip, KL or reference) on
    # group-centred rewards, scaled up by the share of samples that carry a gradient.
    "gpg": dict(
        advantage_estimator="gpg",
        policy_loss="gpg",
        normalize_std=False,
        loss_agg_mode="token_mean",
    ),
    # Pass@k training (veRL's grpo_passk, after Tang et al. 2025): only each group's best
    # sample is credited, with its lead over the runner-up.
    "grpo_passk": dict(
        advantage_estimator="grpo_passk",
        loss_agg_mode="seq_mean_token_mean",
    ),
    # Ahmadian et al. 2024: leave-one-out baseline.
    "rloo": dict(
        advantage_estimator="rloo",
        group_size=4,
    ),
    # Online DPO on verified rewards (Guo et al. 2024; with sft_coef=1, iterative RPO, Pang
    # et al. 2024): each informative group's best sample is preferred over its worst.
    "online_dpo": dict(
        preference_loss="sigmoid",
        dynamic_sampling=True,
        beta=0.1,
    ),
    # Online KTO on verified rewards: each informative group's samples above its mean
    # reward are desirable, those below undesirable (Ethayarajh et al. 2024's loss, its
    # reference point estimated over the batch).
    "online_kto": dict(
        preference_loss="kto",
        dynamic_sampling=True,
        beta=0.1,
    ),
    # Hu 2025: KL-penalised token returns, normalised over the batch.
    "reinforce_pp": dict(
        advantage_estimator="reinforce_pp",
        group_size=1,
        kl_coef=0.01,
        kl_estimator="k1",
        kl_in_reward=True,
    ),
    # Li et al. 2023 (ReMax) as veRL's examples/remax_trainer: the reward of a greedy
    # completion of the prompt as the baseline, 4 samples a prompt. veRL's KL of 0.001 is in
    # the reward; sequence-level estimators read no per-token reward, so it is a loss term
    # here, k3 as GRPO's (k1 as a loss has no gradient in expectation on-policy).
    "remax": dict(
        advantage_estimator="remax",
        group_size=4,
        kl_coef=0.001,
        kl_estimator="k3",
    ),
}

PRESET_NAMES = tuple(_PRESETS)
ROUTING_REPLAY = ("none", "old", "rollout")
KNOBS = tuple(_BASE)


def _unknown_preset(name) -> ValueError:
  return ValueError(f"unknown algorithm {name!r}; known: {', '.join(PRESET_NAMES)}")


def get_preset(name: str) -> ml_collections.ConfigDict:
  """A fresh (mutable) copy of preset `name`, with `algorithm` set to the name."""
  if name not in _PRESETS:
    raise _unknown_preset(name)
  return ml_collections.ConfigDict(dict(algorithm=name, **(_BASE | _PRESETS[name])))


def algorithm_overrides() -> ml_collections.ConfigDict:
  """Every knob as a typed placeholder (None = keep the preset), for run configs."""
  return ml_collections.ConfigDict({k: config_dict.placeholder(type(v)) for k, v in _BASE.items()})


def validate(cfg: ml_collections.ConfigDict) -> None:
  """Raises a one-line ValueError naming the first inconsistent knob value."""
  advantages_lib.get_advantage_estimator(cfg.advantage_estimator)
  # LossConfig checks clip ranges, dual clip, aggregation mode, KL estimator, TIS cap,
  # the token fractions.
  losses_lib.LossConfig.from_config(cfg, max_response_len=max(cfg.max_response_len, 1))

  def check(ok, knob):
    if not ok:
      raise ValueError(f"invalid {knob}={cfg[knob]!r} for algorithm {cfg.algorithm!r}")

  check(0.0 <= cfg.gamma <= 1.0, "gamma")
  check(0.0 <= cfg.lam <= 1.0, "lam")
  check(cfg.kl_coef >= 0, "kl_coef")
  check(cfg.kl_controller in losses_lib.KL_CONTROLLERS, "kl_controller")
  if cfg.kl_controller == "adaptive":
    # A coefficient of 0 would stay 0: the controller moves it by a factor.
    check(cfg.kl_coef > 0, "kl_coef")
    check(cfg.kl_target > 0, "kl_target")
    check(cfg.kl_horizon >= 1, "kl_horizon")
  if cfg.kl_in_reward and cfg.kl_coef > 0:
    # Sequence-level estimators see one reward per sequence: a per-token penalty has no
    # place there (the KL would silently act nowhere).
    if cfg.advantage_estimator in advantages_lib.SEQUENCE_LEVEL_ESTIMATORS:
      raise ValueError(f"kl_in_reward=True puts the KL in per-token rewards, which the "
                       f"sequence-level estimator {cfg.advantage_estimator!r} does not read; "
                       "set kl_in_reward=False (a KL loss term) or advantage_estimator="
                       "gae | reinforce_pp")
  check(cfg.value_coef >= 0, "value_coef")
  check(cfg.max_response_len >= 0, "max_response_len")
  check(cfg.group_size >= 1, "group_size")
  check(cfg.ppo_epochs >= 1, "ppo_epochs")
  check(cfg.num_minibatches >= 1, "num_minibatches")
  if cfg.get("routing_replay", "none") not in ROUTING_REPLAY:
    raise ValueError(f"unknown routing_replay {cfg.routing_replay!r}; known: "
                     f"{', '.join(ROUTING_REPLAY)}")
  if cfg.get("routing_replay") == "old" and cfg.ppo_epochs * cfg.num_minibatches == 1:
    raise ValueError("routing_replay=old keeps the old policy's experts across several "
                     "updates of a batch; with ppo_epochs=1 and num_minibatches=1 the one "
                     "update routes as the old policy does: raise either, or set "
                     "routing_replay=none")
  check(cfg.overlong_buffer_len >= 1, "overlong_buffer_len")
  check(cfg.overlong_penalty_factor >= 0, "overlong_penalty_factor")
  if cfg.advantage_estimator in advantages_lib.SEQUENCE_LEVEL_ESTIMATORS - {"remax"}:
    check(cfg.group_size >= 2, "group_size")  # remax's baseline is no sample of the group
  check(cfg.use_critic == (cfg.advantage_estimator == "gae"), "use_critic")
  sequence_level = cfg.advantage_estimator in advantages_lib.SEQUENCE_LEVEL_ESTIMATORS
  check(not cfg.dynamic_sampling or sequence_level, "dynamic_sampling")
  check(cfg.pairs_per_group >= 1, "pairs_per_group")
  if not cfg.preference_loss:  # the unpaired losses' label weights act nowhere else
    check(cfg.get("desirable_weight", 1.0) == 1.0, "desirable_weight")
    check(cfg.get("undesirable_weight", 1.0) == 1.0, "undesirable_weight")
  if cfg.preference_loss:
    preference_config(cfg)  # checks the loss name and its knobs
    check(cfg.group_size >= 2, "group_size")
    check(sequence_level, "advantage_estimator")
    check(cfg.kl_coef == 0, "kl_coef")  # the preference loss's reference plays that part
    check(cfg.top_entropy_fraction == 1, "top_entropy_fraction")  # no policy-gradient loss
    check(cfg.ppo_epochs == 1, "ppo_epochs")
    check(cfg.num_minibatches == 1, "num_minibatches")
    check(cfg.routing_replay == "none", "routing_replay")
    check(2 * cfg.pairs_per_group <= cfg.group_size, "pairs_per_group")


def preference_config(cfg) -> "preference_lib.PreferenceConfig | None":
  """The online preference loss of an algorithm config; None for a policy-gradient one."""
  if not cfg.preference_loss:
    return None
  return preference_lib.PreferenceConfig(
      loss=cfg.preference_loss, beta=float(cfg.beta), label_smoothing=float(cfg.label_smoothing),
      simpo_gamma=float(cfg.simpo_gamma), sft_coef=float(cfg.sft_coef),
      discopop_tau=float(cfg.discopop_tau),
      desirable_weight=float(cfg.get("desirable_weight", 1.0)),
      undesirable_weight=float(cfg.get("undesirable_weight", 1.0)))


def algorithm_config(name: str, **overrides) -> ml_collections.ConfigDict:
  """Preset `name` with knobs overridden; None values keep the preset's value.

  Args:
    name: one of `PRESET_NAMES`.
    **overrides: knob=value pairs (e.g. `eps_high=0.3`).

  Returns:
    A locked ConfigDict (no new keys) that passed `validate`.

  Raises:
    ValueError: unknown algorithm or knob, wrongly typed or invalid value.
  """
  cfg = get_preset(name)
  for knob, value in overrides.items():
    if knob not in _BASE:
      raise ValueError(f"unknown knob {knob!r} for algorithm {name!r}; known: {', '.join(KNOBS)}")
    if value is None:
      continue
    try:
      cfg[knob] = value
    except TypeError:
      raise ValueError(
          f"knob {knob}={value!r} has type {type(value).__name__}, "
          f"expected {type(_BASE[knob]).__name__}"
      ) from None
  validate(cfg)
  cfg.lock()
  return cfg
