"""Reward shaping: DAPO overlong penalty, format reward, per-domain normalisation."""

import json

import numpy as np
import pytest

from posttrain.tasks import Reward, RewardShaper, overlong_penalty
from posttrain.tasks.shaping import DomainNormalizer


def _dapo_reference(length, l_max, l_cache):
    # Yu et al. (2025), DAPO, eq. 13, written independently with numpy.piecewise.
    return float(
        np.piecewise(
            float(length),
            [
                length <= l_max - l_cache,
                (l_max - l_cache < length) & (length <= l_max),
                length > l_max,
            ],
            [0.0, lambda y: ((l_max - l_cache) - y) / l_cache, -1.0],
        )
    )


@pytest.mark.parametrize("l_max, l_cache", [(20, 4), (100, 37), (8, 8)])
def test_overlong_penalty_matches_dapo(l_max, l_cache):
    for length in range(0, l_max + 10):
        assert overlong_penalty(length, l_max, l_cache) == pytest.approx(
            _dapo_reference(length, l_max, l_cache)
        )
    assert overlong_penalty(l_max, l_max, l_cache) == -1.0
    assert overlong_penalty(l_max - l_cache, l_max, l_cache) == 0.0


def test_overlong_penalty_without_cache_is_a_hard_cut():
    assert overlong_penalty(10, 10, 0) == 0.0
    assert overlong_penalty(11, 10, 0) == -1.0
    with pytest.raises(ValueError, match="cache_length"):
        overlong_penalty(1, 10, 11)


def test_format_weight_mixes_value_and_format():
    shaper = RewardShaper(format_weight=0.2)
    wrong_but_formatted = Reward(0.0, {"format": 1.0, "exact": 0.0}, "wrong")
    right = Reward(1.0, {"format": 1.0, "exact": 1.0}, "correct")
    no_answer = Reward(0.0, {"format": 0.0, "exact": 0.0}, "no_answer")
    np.testing.assert_allclose(
        shaper.shape("d/x", [wrong_but_formatted, right, no_answer]), [0.2, 1.0, 0.0]
    )


def test_overlong_applied_per_completion():
    shaper = RewardShaper(max_length=10, cache_length=4)
    r = Reward(1.0, {"format": 1.0}, "correct")
    np.testing.assert_allclose(shaper.shape("d/x", [r, r, r], lengths=[6, 8, 12]), [1.0, 0.5, 0.0])
    with pytest.raises(ValueError, match="lengths"):
        shaper.shape("d/x", [r], lengths=[1, 2])


def test_running_normalisation_matches_numpy_then_ema():
    norm = DomainNormalizer(ema=0.01, min_std=1e-3)
    rng = np.random.default_rng(0)
    seen = []
    for _ in range(5):
        batch = rng.random(8)
        seen.extend(batch)
        norm.update("d/x", batch)
        mean, std = norm.mean_std("d/x")
        # Fewer than 1/ema samples: exactly the running mean and population std so far.
        assert mean == pytest.approx(np.mean(seen))
        assert std == pytest.approx(np.std(seen))


def test_normalisation_keeps_an_easy_domain_from_dominating():
    shaper = RewardShaper(normalize=True)
    rng = np.random.default_rng(1)
    easy_scores, hard_scores = [], []
    for _ in range(30):
        easy = [Reward(1.0, {"format": 1.0}, "")] * 8
        hard = [Reward(float(v), {"format": 1.0}, "") for v in rng.random(8) < 0.2]
        easy_scores.append(shaper.shape("d/easy", easy))
        hard_scores.append(shaper.shape("d/hard", hard))
    assert np.abs(easy_scores[-1]).max() == pytest.approx(0.0)
    assert np.abs(np.concatenate(hard_scores[-10:])).max() > 1.0
    assert np.abs(np.concatenate(hard_scores)).max() <= shaper.normalizer.clip


def test_normalizer_state_round_trip():
    a = DomainNormalizer()
    a.update("d/x", [0.0, 1.0, 1.0])
    b = DomainNormalizer()
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    np.testing.assert_array_equal(a.normalize("d/x", [0.3, 0.9]), b.normalize("d/x", [0.3, 0.9]))


@pytest.mark.parametrize("kwargs", [{"format_weight": 2.0}, {"max_length": 4, "cache_length": 5}])
def test_bad_shaper_config(kwargs):
    with pytest.raises(ValueError):
        RewardShaper(**kwargs)
