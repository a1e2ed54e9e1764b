"""Scheduler on synthetic bandits with known pass rates, dynamic sampling, checkpoints."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.tasks import Scheduler, dynamic_sample, is_heldout_seed, registry

RATES = {
    "toy/p00": 0.0,
    "toy/p05": 0.05,
    "toy/p50a": 0.5,
    "toy/p50b": 0.5,
    "toy/p95": 0.95,
    "toy/p100": 1.0,
}


def _train(scheduler, rates, steps=150, batch=16, group=8, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        for name, _ in scheduler.draw(batch):
            scheduler.update(name, (rng.random(group) < rates[name]).astype(float))


def test_learnability_concentrates_near_half_and_floor_holds():
    floor = 0.1
    s = Scheduler(list(RATES), rule="learnability", seed=0, floor=floor)
    _train(s, RATES)
    p = dict(zip(s.domains, s.probabilities()))
    assert p["toy/p50a"] + p["toy/p50b"] > 0.7
    assert min(p["toy/p50a"], p["toy/p50b"]) > max(p["toy/p05"], p["toy/p95"])
    for name in RATES:
        assert p[name] >= floor / len(RATES) - 1e-12
    # The learned pass rates are close to the truth (checked against the known rates).
    assert abs(s.pass_rate[s.domains.index("toy/p50a")] - 0.5) < 0.2
    assert s.pass_rate[s.domains.index("toy/p00")] == 0.0


def test_draw_frequencies_follow_probabilities():
    s = Scheduler(list(RATES), rule="learnability", seed=3, floor=0.1)
    _train(s, RATES, steps=50)
    p = s.probabilities()
    before = s.times_drawn.copy()
    # Freeze the statistics: draw without updating, many times.
    counts = np.zeros(len(RATES))
    for _ in range(40):
        for name, _ in s.draw(256):
            counts[s.domains.index(name)] += 1
    freq = counts / counts.sum()
    np.testing.assert_allclose(freq, p, atol=0.02)
    assert (s.times_drawn - before).sum() == 40 * 256


def test_failure_rule_prefers_hard_domains_and_uniform_is_flat():
    s = Scheduler(list(RATES), rule="failure", seed=0, floor=0.0)
    _train(s, RATES, steps=60)
    p = dict(zip(s.domains, s.probabilities()))
    assert p["toy/p00"] > p["toy/p50a"] > p["toy/p100"]
    u = Scheduler(list(RATES), rule="uniform", floor=0.2)
    _train(u, RATES, steps=20)
    np.testing.assert_allclose(u.probabilities(), np.full(len(RATES), 1 / len(RATES)))


def test_bandit_follows_mean_absolute_advantage():
    names = ["toy/a", "toy/b", "toy/c"]
    s = Scheduler(names, rule="bandit", temperature=0.05, floor=0.03)
    for _ in range(30):
        s.update("toy/a", [0.0, 0.0], advantages=[0.9, -0.9])
        s.update("toy/b", [0.0, 0.0], advantages=[0.1, -0.1])
        s.update("toy/c", [1.0, 1.0, 0.0, 0.0])  # |r - mean| = 0.5
    p = dict(zip(names, s.probabilities()))
    assert p["toy/a"] > 0.9 and p["toy/a"] > p["toy/c"] > p["toy/b"]
    # Softmax reference, mixed with the floor.
    q = np.array([0.9, 0.1, 0.5]) / 0.05
    ref = np.exp(q - q.max()) / np.exp(q - q.max()).sum()
    np.testing.assert_allclose(s.probabilities(), 0.97 * ref + 0.01, rtol=1e-6)


def test_novelty_and_staleness_favour_neglected_domains():
    names = ["toy/a", "toy/b"]
    s = Scheduler(names, rule="uniform", floor=0.0, novelty=1.0)
    s.update("toy/a", [1.0] * 99)
    p = s.probabilities()
    # bonus_a = 1/sqrt(100) = 0.1, bonus_b = 1: weights (0.5 + 0.05, 0.5 + 0.5).
    np.testing.assert_allclose(p, np.array([0.55, 1.0]) / 1.55)
    s = Scheduler(names, rule="uniform", floor=0.0, staleness=1.0, staleness_horizon=10)
    for _ in range(5):
        s.draw(0)
    s.last_sampled[:] = [4, 0]  # a sampled last draw, b five draws ago
    np.testing.assert_allclose(s.probabilities(), np.array([0.5 + 0.05, 0.5 + 0.25]) / 1.3)


def test_all_zero_learnability_falls_back_to_uniform():
    s = Scheduler(["toy/a", "toy/b"], rule="learnability", floor=0.0)
    s.update("toy/a", [1.0])
    s.update("toy/b", [0.0])
    np.testing.assert_allclose(s.probabilities(), [0.5, 0.5])


def test_state_round_trip_gives_identical_next_draws():
    s = Scheduler(
        list(RATES),
        rule="learnability",
        seed=11,
        novelty=0.3,
        staleness=0.2,
        promotion_threshold=0.9,
    )
    _train(s, RATES, steps=20)
    state = json.loads(json.dumps(s.state_dict()))
    expected = [s.draw(33) for _ in range(3)]
    restored = Scheduler(
        list(RATES),
        rule="learnability",
        seed=0,
        novelty=0.3,
        staleness=0.2,
        promotion_threshold=0.9,
    )
    restored.load_state_dict(state)
    assert [restored.draw(33) for _ in range(3)] == expected
    assert len(json.dumps(state)) < 4096  # the whole state is small


def test_state_is_small_for_the_full_registry():
    s = Scheduler(registry.names(), seed=1)
    s.draw(1024)
    assert len(json.dumps(s.state_dict())) < 64 * 1024


def test_load_matches_by_name_when_domains_change():
    s = Scheduler(["toy/a", "toy/b"], seed=2)
    s.update("toy/a", [1.0, 1.0])
    t = Scheduler(["toy/b", "toy/a", "toy/c"], seed=2)
    t.load_state_dict(s.state_dict())
    assert t.stats("toy/a")["attempts"] == 2 and t.stats("toy/c")["attempts"] == 0


def test_draws_are_deterministic_and_seeds_are_training_seeds():
    a = Scheduler(list(RATES), seed=5).draw(500)
    b = Scheduler(list(RATES), seed=5).draw(500)
    c = Scheduler(list(RATES), seed=6).draw(500)
    assert a == b and a != c
    seeds = [seed for _, seed in a]
    assert len(set(seeds)) == len(seeds)
    assert not any(is_heldout_seed(x) for x in seeds)
    assert all(0 <= x < 2**63 for x in seeds)


def test_level_promotion_unlocks_next_level():
    names = ["toy/x_l1", "toy/y_l1", "toy/x_l2", "toy/x_l3"]
    s = Scheduler(names, seed=0, promotion_threshold=0.8, promotion_min_attempts=16)
    assert [n for n, a in zip(names, s.active_mask()) if a] == ["toy/x_l1", "toy/y_l1"]
    assert {n for n, _ in s.draw(200)} == {"toy/x_l1", "toy/y_l1"}
    s.update("toy/x_l1", [1.0] * 16)
    assert s.unlocked["toy"] == 1  # y_l1 still at its prior 0.5: family mean 0.75 < 0.8
    s.update("toy/y_l1", [1.0] * 8)
    assert s.unlocked["toy"] == 2
    assert "toy/x_l2" in {n for n, _ in s.draw(200)}
    assert "toy/x_l3" not in {n for n, _ in s.draw(200)}


def test_promotion_by_track_is_per_ladder():
    names = ["toy/x_l1", "toy/x_l2", "toy/y_l1", "toy/y_l2"]
    s = Scheduler(names, promotion_threshold=0.5, promotion_min_attempts=1, promote_by="track")
    s.update("toy/x_l1", [1.0])
    assert s.unlocked == {"toy/x": 2, "toy/y": 1}


def test_registry_levels_drive_promotion():
    names = registry.names(pattern="arithmetic/add_d*")
    s = Scheduler(names, promotion_threshold=0.9)
    assert {n for n, _ in s.draw(100)} == {"arithmetic/add_d1"}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"rule": "greedy"}, "greedy"),
        ({"floor": 1.5}, "1.5"),
        ({"temperature": 0.0}, "temperature"),
        ({"promote_by": "op"}, "op"),
        ({"seed": -1}, "-1"),
    ],
)
def test_bad_config_is_a_clear_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Scheduler(["toy/a"], **kwargs)


def test_verdicts_decide_passing_and_rewards_the_reward_statistics():
    # Rewards mixed with a reward model's score never reach 1; the verifier's verdicts
    # say which samples passed.
    s = Scheduler(["toy/a", "toy/b"], rule="learnability", floor=0.0)
    s.update("toy/a", [0.9, 0.2, 0.7, 0.1], verdicts=[1.0, 0.0, 1.0, 0.0])
    s.update("toy/b", [0.9, 0.2, 0.7, 0.1])
    a, b = s.stats("toy/a"), s.stats("toy/b")
    assert a["pass_rate"] == 0.5 and b["pass_rate"] == 0.0
    assert a["reward_mean"] == b["reward_mean"] == pytest.approx(0.475)
    probs = dict(zip(s.domains, s.probabilities()))
    assert probs["toy/a"] == 1.0 and probs["toy/b"] == 0.0  # b looks solved-or-hopeless
    with pytest.raises(ValueError, match="3 verdicts for 4 rewards of domain 'toy/a'"):
        s.update("toy/a", [0.9, 0.2, 0.7, 0.1], verdicts=[1.0, 0.0, 1.0])


def test_bad_updates_are_clear_errors():
    s = Scheduler(["toy/a"])
    with pytest.raises(KeyError, match="toy/zz"):
        s.update("toy/zz", [1.0])
    with pytest.raises(ValueError, match="empty"):
        s.update("toy/a", [])
    with pytest.raises(ValueError, match="nan"):
        s.update("toy/a", [float("nan")])
    with pytest.raises(ValueError, match="duplicate"):
        Scheduler(["toy/a", "toy/a"])


@settings(max_examples=40, deadline=None)
@given(
    st.dictionaries(st.sampled_from(list(RATES)), st.floats(0, 1), min_size=1),
    st.integers(1, 12),
    st.integers(1, 6),
    st.integers(0, 2**32),
)
def test_dynamic_sampling_never_returns_an_all_equal_group(rates, batch_size, group_size, seed):
    names = sorted(rates)
    s = Scheduler(names, seed=seed)
    rng = np.random.default_rng(seed)
    calls = []

    def make_group(domain, task_seed):
        calls.append((domain, task_seed))
        return (rng.random(group_size) < rates[domain]).astype(float)

    out = dynamic_sample(s, make_group, batch_size, max_draws=30 * batch_size)
    assert out.draws == len(calls) == len(out.groups) + out.dropped
    assert len(out.groups) <= batch_size
    for _, _, rewards in out.groups:
        assert np.ptp(rewards) > 0
    if group_size == 1 or all(r in (0.0, 1.0) for r in rates.values()):
        assert out.groups == []  # no group can differ: everything is dropped, nothing raises
    assert out.full == (len(out.groups) == batch_size)
    assert int(s.attempts.sum()) == group_size * out.draws


def test_dynamic_sampling_fills_batch_and_counts_draws_batched():
    s = Scheduler(["toy/easy", "toy/mixed"], rule="uniform", seed=0)
    pattern = {"toy/easy": [1.0, 1.0, 1.0], "toy/mixed": [1.0, 0.0, 1.0]}

    class Group:
        def __init__(self, rewards):
            self.rewards = rewards

    out = dynamic_sample(s, lambda pairs: [Group(pattern[d]) for d, _ in pairs], 10, batched=True)
    assert out.full and len(out.groups) == 10
    assert all(d == "toy/mixed" for d, _, _ in out.groups)
    assert out.draws == 10 + out.dropped and out.dropped > 0


def test_concurrent_updates_from_worker_threads_are_all_counted():
    import threading

    s = Scheduler(list(RATES), seed=0)

    def worker(k):
        for name, _ in s.draw(200):
            s.update(name, [float(k % 2)] * 3)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert int(s.attempts.sum()) == 4 * 200 * 3 and int(s.updates.sum()) == 800
    assert s.samples == 800 and s.draw_calls == 4
