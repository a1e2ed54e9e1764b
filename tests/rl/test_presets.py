"""Algorithm presets: load, validate, override (also through --config flags)."""

import textwrap

import pytest
from absl import flags
from ml_collections import config_flags

from posttrain.rl import advantages as adv_lib
from posttrain.rl import losses
from posttrain.rl import presets


@pytest.mark.parametrize("name", presets.PRESET_NAMES)
def test_every_preset_loads_validates_and_builds_a_loss_config(name):
  cfg = presets.algorithm_config(name)
  assert cfg.algorithm == name
  assert set(cfg.keys()) == set(presets.KNOBS) | {"algorithm"}
  adv_lib.get_advantage_estimator(cfg.advantage_estimator)
  loss_cfg = losses.LossConfig.from_config(cfg, max_response_len=64)
  assert loss_cfg.loss_agg_mode == cfg.loss_agg_mode and loss_cfg.eps_high == cfg.eps_high


def test_all_issue_presets_exist():
  assert set(presets.PRESET_NAMES) == {
      "ppo", "grpo", "dapo", "dr_grpo", "gspo", "cispo", "gmpo", "sapo", "clip_cov", "kl_cov",
      "gpg", "grpo_passk", "rloo", "online_dpo", "online_kto", "reinforce_pp", "remax"}


def test_presets_encode_their_papers():
  ppo, grpo, dapo = (presets.get_preset(n) for n in ("ppo", "grpo", "dapo"))
  dr_grpo, gspo = presets.get_preset("dr_grpo"), presets.get_preset("gspo")
  rloo, rpp = presets.get_preset("rloo"), presets.get_preset("reinforce_pp")
  assert ppo.use_critic and ppo.advantage_estimator == "gae" and ppo.kl_in_reward
  assert grpo.loss_agg_mode == "seq_mean_token_mean" and grpo.kl_coef > 0 and grpo.normalize_std
  assert dapo.eps_high > dapo.eps_low and dapo.loss_agg_mode == "token_mean" and dapo.kl_coef == 0
  assert dapo.dynamic_sampling and dapo.overlong_penalty
  assert not dr_grpo.normalize_std and dr_grpo.loss_agg_mode == "seq_mean_token_sum_norm"
  assert gspo.policy_loss == "gspo" and gspo.eps_high < 1e-3
  cispo, gmpo = presets.get_preset("cispo"), presets.get_preset("gmpo")
  assert cispo.policy_loss == "cispo" and cispo.eps_low == 1.0 and cispo.eps_high > 0
  assert gmpo.policy_loss == "gmpo" and gmpo.eps_low == gmpo.eps_high == 0.4
  assert gmpo.loss_agg_mode == "seq_mean_token_mean"
  sapo = presets.get_preset("sapo")
  assert sapo.policy_loss == "sapo" and sapo.sapo_tau_neg > sapo.sapo_tau_pos == 1.0
  assert sapo.loss_agg_mode == "seq_mean_token_mean" and sapo.num_minibatches > 1
  clip_cov, kl_cov = presets.get_preset("clip_cov"), presets.get_preset("kl_cov")
  assert clip_cov.policy_loss == "clip_cov" and clip_cov.cov_fraction == 2e-4
  assert (clip_cov.clip_cov_lb, clip_cov.clip_cov_ub) == (1.0, 5.0)
  assert kl_cov.policy_loss == "kl_cov" and kl_cov.cov_fraction == 2e-3
  assert kl_cov.kl_cov_coef == 1.0 and kl_cov.num_minibatches > 1  # acts from update 2 on
  gpg, passk = presets.get_preset("gpg"), presets.get_preset("grpo_passk")
  assert gpg.advantage_estimator == gpg.policy_loss == "gpg" and not gpg.normalize_std
  assert gpg.kl_coef == 0 and gpg.loss_agg_mode == "token_mean"
  assert passk.advantage_estimator == "grpo_passk"
  assert rloo.advantage_estimator == "rloo" and rloo.group_size >= 2
  assert rpp.advantage_estimator == "reinforce_pp" and rpp.kl_in_reward and not rpp.use_critic


def test_get_preset_returns_a_fresh_copy():
  cfg = presets.get_preset("grpo")
  cfg.eps_high = 0.9
  cfg.group_size = 99
  assert presets.get_preset("grpo").eps_high == 0.2
  assert presets.get_preset("grpo").group_size == 8


def test_overrides_apply_and_none_keeps_the_preset():
  cfg = presets.algorithm_config("dapo", eps_high=0.3, group_size=4, kl_coef=None)
  assert cfg.eps_high == 0.3 and cfg.group_size == 4 and cfg.kl_coef == 0.0
  assert presets.algorithm_config("grpo", eps_high=1).eps_high == 1.0  # int -> float is fine
  with pytest.raises(AttributeError):
    cfg.new_knob = 1  # locked: typos cannot add keys


@pytest.mark.parametrize("overrides,message", [
    (dict(eps_hi=0.3), r"^unknown knob 'eps_hi' for algorithm 'grpo'; known: advantage_estim"),
    (dict(eps_high="wide"), r"^knob eps_high='wide' has type str, expected float$"),
    (dict(loss_agg_mode="mean"), r"^unknown loss_agg_mode 'mean'"),
    (dict(advantage_estimator="vtrace"), r"^unknown advantage estimator 'vtrace'"),
    (dict(dual_clip=0.5), r"^dual_clip must be 0 \(off\) or > 1, got 0.5$"),
    (dict(group_size=1), r"^invalid group_size=1 for algorithm 'grpo'$"),
    (dict(gamma=1.5), r"^invalid gamma=1.5 for algorithm 'grpo'$"),
    (dict(use_critic=True), r"^invalid use_critic=True for algorithm 'grpo'$"),
    (dict(kl_controller="pid"), r"^invalid kl_controller='pid' for algorithm 'grpo'$"),
    # The controller scales the coefficient: from 0 it would never move.
    (dict(kl_controller="adaptive", kl_coef=0.0), r"^invalid kl_coef=0.0 for algorithm"),
    (dict(kl_controller="adaptive", kl_target=0.0), r"^invalid kl_target=0.0 for algorithm"),
    (dict(kl_controller="adaptive", kl_horizon=0), r"^invalid kl_horizon=0 for algorithm"),
    # A per-token penalty in the reward that a sequence-level estimator would never read.
    (dict(kl_in_reward=True), r"^kl_in_reward=True puts the KL in per-token rewards, which "
                              r"the sequence-level estimator 'grpo' does not read"),
])
def test_bad_overrides_are_one_line_errors_naming_the_value(overrides, message):
  with pytest.raises(ValueError, match=message) as info:
    presets.algorithm_config("grpo", **overrides)
  assert "\n" not in str(info.value)


def test_unknown_algorithm_lists_known_ones():
  for call in (presets.get_preset, presets.algorithm_config):
    with pytest.raises(ValueError) as info:
      call("ppo2")
    assert str(info.value) == (
        "unknown algorithm 'ppo2'; known: ppo, grpo, dapo, dr_grpo, gspo, cispo, gmpo, sapo, "
        "clip_cov, kl_cov, gpg, grpo_passk, rloo, online_dpo, online_kto, reinforce_pp, remax")


def test_command_line_picks_and_overrides_an_algorithm(tmp_path):
  config_file = tmp_path / "run.py"
  config_file.write_text(textwrap.dedent("""
      import ml_collections
      from posttrain.rl import presets

      def get_config():
        config = ml_collections.ConfigDict()
        config.algorithm = "grpo"
        config.rl = presets.algorithm_overrides()
        return config
  """))
  argv = ["train", f"--config={config_file}", "--config.algorithm=dapo",
          "--config.rl.eps_high=0.35", "--config.rl.dynamic_sampling=False"]
  flag_values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", flag_values=flag_values, sys_argv=argv)
  flag_values(argv)
  config = flag_values.config
  cfg = presets.algorithm_config(config.algorithm, **config.rl)
  assert cfg.algorithm == "dapo"
  assert cfg.eps_high == 0.35 and not cfg.dynamic_sampling
  assert cfg.loss_agg_mode == "token_mean" and cfg.group_size == 16  # untouched DAPO knobs
