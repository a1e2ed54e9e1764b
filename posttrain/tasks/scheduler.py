"""Curriculum scheduler: which domain to practise next, and DAPO dynamic sampling.

Per-domain statistics, updated from each group of rewards (``update``):
  attempts, updates, EMA pass rate p, EMA reward mean and within-group variance, EMA mean
  |advantage| q, last draw step and times drawn. EMAs use rate ``max(ema, 1 / updates)``:
  a plain running mean for the first ``1 / ema`` updates, so the prior is forgotten at once.

Sampling over the active domains (``draw``):
  base weight   uniform: 1 | learnability: p (1 - p) | failure: 1 - p |
                bandit: softmax(q / temperature)   (self-evolving curriculum, Boltzmann
                exploration over the EMA of mean |advantage|)
  bonus         b_i = novelty / sqrt(1 + attempts_i) + staleness * min(1, age_i / horizon),
                added as b_i / K to the normalised base weights (K = active domains)
  floor         P_i = (1 - floor) * w_i / sum(w) + floor / K, so P_i >= floor / K always.
An all-zero base (e.g. every p in {0, 1} under learnability) falls back to uniform.

Levels: with ``promotion_threshold`` set, each ladder (a family, or a domain's track such as
``arithmetic/add``) starts at its lowest level; when the mean EMA pass rate of its domains
at the top unlocked level reaches the threshold (with at least ``promotion_min_attempts``
attempts among them), the next level is unlocked. Lower levels stay active.

Determinism: draw k uses ``numpy.random.default_rng([seed, k])`` and task seeds are
``train_seed(splitmix64(seed, sample counter))``, so the whole state is a few counters plus
the statistics, and ``state_dict``/``load_state_dict`` reproduce the next draws exactly.
Task seeds are always training seeds (even), disjoint from ``heldout_seed``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from posttrain.tasks.base import train_seed

RULES = ("uniform", "learnability", "failure", "bandit")
PROMOTE_BY = ("family", "track")
_LEVEL_SUFFIX = re.compile(r"_[a-z](\d+)$")
_STATE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Sampling rule and its knobs; see the module docstring for the equations."""

    rule: str = "learnability"
    floor: float = 0.05
    ema: float = 0.1
    pass_threshold: float = 1.0
    prior_pass_rate: float = 0.5
    prior_abs_advantage: float = 0.5
    temperature: float = 0.1
    novelty: float = 0.0
    staleness: float = 0.0
    staleness_horizon: int = 100
    promotion_threshold: float | None = None
    promotion_min_attempts: int = 32
    promote_by: str = "family"

    def __post_init__(self):
        if self.rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {self.rule!r}")
        if self.promote_by not in PROMOTE_BY:
            raise ValueError(f"promote_by must be one of {PROMOTE_BY}, got {self.promote_by!r}")
        for name in ("floor", "ema", "prior_pass_rate"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {v!r}")
        if self.ema == 0.0:
            raise ValueError("ema must be > 0, got 0.0")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature!r}")
        if self.novelty < 0 or self.staleness < 0:
            raise ValueError(
                f"novelty/staleness must be >= 0, got {self.novelty!r}/{self.staleness!r}"
            )
        if self.staleness_horizon < 1:
            raise ValueError(f"staleness_horizon must be >= 1, got {self.staleness_horizon!r}")


def _ladder_of(name: str, promote_by: str) -> tuple[str, int]:
    """(ladder key, level) from the registry, else parsed from ``family/op_l3`` names."""
    from posttrain.tasks.catalog import registry

    if name in registry:
        d = registry.get(name)
        return (d.family if promote_by == "family" else d.track), d.level
    m = _LEVEL_SUFFIX.search(name)
    level = int(m.group(1)) if m else 1
    if promote_by == "family":
        return name.split("/", 1)[0], level
    return (name[: m.start()] if m else name), level


def _finite_floats(values, what: str) -> list[float]:
    if isinstance(values, np.ndarray):
        out = values.astype(np.float64).reshape(-1).tolist()
    else:
        out = [float(v) for v in values]
    if not out:
        raise ValueError(f"empty {what}")
    if not all(math.isfinite(v) for v in out):
        raise ValueError(f"non-finite value in {what}: {out[:8]}")
    return out


def _locked(method):
    """Rollout worker threads share one scheduler: serialise its public methods."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class Scheduler:
    """Draws ``(domain_name, seed)`` pairs by a curriculum rule and learns from rewards."""

    _STAT_FIELDS = (
        "attempts",
        "updates",
        "pass_rate",
        "reward_mean",
        "reward_var",
        "abs_advantage",
        "last_sampled",
        "times_drawn",
    )

    def __init__(self, domains: Sequence[str], rule: str = "learnability", seed: int = 0, **config):
        names = list(domains)
        if not names:
            raise ValueError("Scheduler needs at least one domain, got an empty list")
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate domain names: {dupes}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        self.config = SchedulerConfig(rule=rule, **config)
        self.domains = names
        self.seed = int(seed)
        self._index = {n: i for i, n in enumerate(names)}
        ladders = [_ladder_of(n, self.config.promote_by) for n in names]
        self._ladder = [key for key, _ in ladders]
        self._level = np.array([lvl for _, lvl in ladders], dtype=np.int64)
        self._ladder_levels: dict[str, list[int]] = {}
        for key, lvl in ladders:
            self._ladder_levels.setdefault(key, [])
            if lvl not in self._ladder_levels[key]:
                self._ladder_levels[key].append(lvl)
        for levels in self._ladder_levels.values():
            levels.sort()
        self._members: dict[tuple[str, int], np.ndarray] = {}
        for i, (key, lvl) in enumerate(ladders):
            self._members.setdefault((key, lvl), [])
            self._members[(key, lvl)].append(i)
        self._members = {k: np.array(v) for k, v in self._members.items()}
        self._lock = threading.RLock()
        self._reset_stats()

    def _reset_stats(self):
        k, c = len(self.domains), self.config
        self.draw_calls = 0
        self.samples = 0
        self.attempts = np.zeros(k, np.int64)
        self.updates = np.zeros(k, np.int64)
        self.pass_rate = np.full(k, c.prior_pass_rate)
        self.reward_mean = np.zeros(k)
        self.reward_var = np.zeros(k)
        self.abs_advantage = np.full(k, c.prior_abs_advantage)
        self.last_sampled = np.full(k, -1, np.int64)
        self.times_drawn = np.zeros(k, np.int64)
        if c.promotion_threshold is None:
            self.unlocked = {key: lv[-1] for key, lv in self._ladder_levels.items()}
        else:
            self.unlocked = {key: lv[0] for key, lv in self._ladder_levels.items()}

    # -- sampling ---------------------------------------------------------------------

    def active_mask(self) -> np.ndarray:
        limits = np.array([self.unlocked[key] for key in self._ladder], dtype=np.int64)
        return self._level <= limits

    @_locked
    def probabilities(self) -> np.ndarray:
        """The distribution the next ``draw`` uses, aligned with ``self.domains``."""
        c = self.config
        active = self.active_mask()
        n_active = int(active.sum())
        p = self.pass_rate
        if c.rule == "uniform":
            base = np.ones_like(p)
        elif c.rule == "learnability":
            base = p * (1.0 - p)
        elif c.rule == "failure":
            base = 1.0 - p
        else:
            logits = self.abs_advantage / c.temperature
            logits = logits - logits[active].max()
            base = np.exp(logits)
        base = np.where(active, base, 0.0)
        total = base.sum()
        base = base / total if total > 0 else active / n_active
        if c.novelty or c.staleness:
            age = np.where(
                self.last_sampled < 0, c.staleness_horizon, self.draw_calls - self.last_sampled
            )
            bonus = c.novelty / np.sqrt(1.0 + self.attempts)
            bonus = bonus + c.staleness * np.minimum(1.0, age / c.staleness_horizon)
            base = base + np.where(active, bonus, 0.0) / n_active
            base = base / base.sum()
        return (1.0 - c.floor) * base + np.where(active, c.floor / n_active, 0.0)

    @_locked
    def draw(self, n: int) -> list[tuple[str, int]]:
        """``n`` (domain name, training seed) pairs; deterministic given the state."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        probs = self.probabilities()
        rng = np.random.default_rng([self.seed, self.draw_calls])
        idx = rng.choice(len(self.domains), size=int(n), p=probs)
        counters = np.arange(self.samples, self.samples + n, dtype=np.uint64)
        keys = _splitmix64(_splitmix64(np.full(n, self.seed, np.uint64)) ^ counters)
        seed_indices = (keys >> np.uint64(2)).tolist()  # 62-bit seed indices
        self.last_sampled[idx] = self.draw_calls
        np.add.at(self.times_drawn, idx, 1)
        self.draw_calls += 1
        self.samples += int(n)
        return [(self.domains[i], train_seed(s)) for i, s in zip(idx.tolist(), seed_indices)]

    # -- learning ---------------------------------------------------------------------

    @_locked
    def update(
        self,
        domain_name: str,
        rewards: Sequence[float],
        advantages: Sequence[float] | None = None,
        verdicts: Sequence[float] | None = None,
    ):
        """Folds one group of rewards (and optionally its advantages) into the statistics.

        ``verdicts``, one per reward, are the values passing is judged on
        (``>= pass_threshold``) when that is not the reward itself: with a reward model's
        score mixed into the rewards, the verifier's values. The pass rate drives the
        learnability and failure rules and promotion, so a mixed reward that never reaches
        1 must not read as a failure.
        """
        i = self._index.get(domain_name)
        if i is None:
            raise KeyError(f"domain {domain_name!r} is not in this scheduler")
        # Plain Python floats: groups are small and numpy's per-call overhead dominated here.
        r = _finite_floats(rewards, f"rewards for domain {domain_name!r}")
        n = len(r)
        mean = math.fsum(r) / n
        var = math.fsum((x - mean) ** 2 for x in r) / n
        if advantages is None:
            abs_adv = math.fsum(abs(x - mean) for x in r) / n
        else:
            a = _finite_floats(advantages, f"advantages for domain {domain_name!r}")
            abs_adv = math.fsum(abs(x) for x in a) / len(a)
        if verdicts is not None:
            v = _finite_floats(verdicts, f"verdicts for domain {domain_name!r}")
            if len(v) != n:
                raise ValueError(
                    f"{len(v)} verdicts for {n} rewards of domain {domain_name!r}"
                )
        else:
            v = r
        passed = sum(1 for x in v if x >= self.config.pass_threshold) / n
        updates = int(self.updates[i]) + 1
        self.updates[i] = updates
        self.attempts[i] += n
        rate = max(self.config.ema, 1.0 / updates)
        for stats, value in (
            (self.pass_rate, passed),
            (self.reward_mean, mean),
            (self.reward_var, var),
            (self.abs_advantage, abs_adv),
        ):
            old = float(stats[i])
            stats[i] = old + rate * (value - old)
        self._maybe_promote(self._ladder[i])

    def _maybe_promote(self, key: str):
        threshold = self.config.promotion_threshold
        if threshold is None:
            return
        levels = self._ladder_levels[key]
        while True:
            current = self.unlocked[key]
            if current == levels[-1]:
                return
            members = self._members[(key, current)]
            if self.attempts[members].sum() < self.config.promotion_min_attempts:
                return
            if self.pass_rate[members].mean() < threshold:
                return
            self.unlocked[key] = levels[levels.index(current) + 1]

    # -- inspection and checkpoints ----------------------------------------------------

    @_locked
    def stats(self, domain_name: str) -> dict[str, float]:
        i = self._index[domain_name]
        return {f: getattr(self, f)[i].item() for f in self._STAT_FIELDS}

    @_locked
    def metrics(self) -> dict[str, float]:
        """Flat scalars for logging: sampling probability and pass rate per domain."""
        probs = self.probabilities()
        out = {"curriculum/active_domains": float(self.active_mask().sum())}
        for i, name in enumerate(self.domains):
            out[f"curriculum/prob/{name}"] = float(probs[i])
            out[f"curriculum/pass_rate/{name}"] = float(self.pass_rate[i])
        return out

    @_locked
    def state_dict(self) -> dict[str, Any]:
        """JSON-safe state: counters, per-domain statistics and unlocked levels."""
        return {
            "version": _STATE_VERSION,
            "seed": self.seed,
            "draw_calls": self.draw_calls,
            "samples": self.samples,
            "domains": list(self.domains),
            "stats": {f: getattr(self, f).tolist() for f in self._STAT_FIELDS},
            "unlocked": dict(self.unlocked),
            "config": dataclasses.asdict(self.config),
        }

    @_locked
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a ``state_dict``. Statistics are matched by domain name, so domains
        added since the save start fresh and removed ones are dropped; the sampling
        config stays the one this scheduler was built with."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"unsupported scheduler state version {state.get('version')!r}")
        self._reset_stats()
        self.seed = int(state["seed"])
        self.draw_calls = int(state["draw_calls"])
        self.samples = int(state["samples"])
        saved = {name: j for j, name in enumerate(state["domains"])}
        for f in self._STAT_FIELDS:
            values = state["stats"][f]
            arr = getattr(self, f)
            for i, name in enumerate(self.domains):
                j = saved.get(name)
                if j is not None:
                    arr[i] = values[j]
        for key, level in state["unlocked"].items():
            if key in self.unlocked and level in self._ladder_levels[key]:
                self.unlocked[key] = int(level)


@dataclasses.dataclass
class DynamicBatch:
    """Groups kept by dynamic sampling, with the draw counts that produced them."""

    groups: list[tuple[str, int, Any]]
    draws: int
    dropped: int
    batch_size: int

    @property
    def full(self) -> bool:
        return len(self.groups) >= self.batch_size


def _default_rewards(group: Any) -> Sequence[float]:
    return getattr(group, "rewards", group)


def dynamic_sample(
    scheduler: Scheduler,
    make_group: Callable[..., Any],
    batch_size: int,
    *,
    max_draws: int | None = None,
    batched: bool = False,
    rewards_of: Callable[[Any], Sequence[float]] = _default_rewards,
    update: bool = True,
    tol: float = 0.0,
) -> DynamicBatch:
    """DAPO dynamic sampling: keep only groups whose rewards differ; draw until full.

    Args:
      scheduler: draws the tasks and, with ``update``, learns from every group (kept or
        dropped: an all-pass group is informative about the pass rate).
      make_group: ``(domain, seed) -> group`` or, with ``batched``, a list of pairs to a
        list of groups. A group is a sequence of rewards or has a ``rewards`` attribute
        (see ``rewards_of``).
      batch_size: number of groups wanted.
      max_draws: cap on groups generated (default ``16 * batch_size``); when reached the
        batch comes back short.
      tol: groups with ``max(r) - min(r) <= tol`` count as all-equal and are dropped.

    Returns:
      ``DynamicBatch(groups=[(domain, seed, group)], draws, dropped)``.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
    max_draws = 16 * batch_size if max_draws is None else max_draws
    if max_draws < 1:
        raise ValueError(f"max_draws must be >= 1, got {max_draws!r}")
    kept: list[tuple[str, int, Any]] = []
    draws = dropped = 0
    while len(kept) < batch_size and draws < max_draws:
        pairs = scheduler.draw(min(batch_size - len(kept), max_draws - draws))
        groups = make_group(pairs) if batched else [make_group(d, s) for d, s in pairs]
        if len(groups) != len(pairs):
            raise ValueError(f"make_group returned {len(groups)} groups for {len(pairs)} tasks")
        for (domain, seed), group in zip(pairs, groups):
            rewards = np.asarray(rewards_of(group), dtype=np.float64).reshape(-1)
            draws += 1
            if update:
                scheduler.update(domain, rewards)
            if rewards.size and float(rewards.max() - rewards.min()) > tol:
                kept.append((domain, seed, group))
            else:
                dropped += 1
    return DynamicBatch(kept, draws, dropped, batch_size)
