"""Reward shaping and calibration between the verifier and the RL loss.

For a completion of ``L`` tokens with verifier reward ``v`` and format component ``f``:

    raw     = (1 - w_format) * v + w_format * f + w_overlong * overlong(L)
    shaped  = clip((raw - mean_d) / max(std_d, min_std), -clip, clip)   if normalize
            = raw                                                        otherwise

* Format reward (``w_format``): partial credit for a well-formed ``<answer>`` even when
  wrong; keep it small (0.1) so it bootstraps the format without becoming the goal.
* Overlong penalty, DAPO's soft punishment (Yu et al., 2025, eq. 13), with
  ``L_max = max_length`` and ``L_cache = cache_length``::

      overlong(L) = 0                                  if L <= L_max - L_cache
                  = ((L_max - L_cache) - L) / L_cache  if L_max - L_cache < L <= L_max
                  = -1                                 if L > L_max

* Per-domain running normalisation: ``mean_d``/``std_d`` are running moments of ``raw`` for
  domain d (a plain average over the first ``1 / ema`` samples, then an EMA). An easy domain
  whose reward is always 1 normalises to 0 instead of dominating the batch, and a hard one
  keeps a comparable scale. The state is JSON-safe and belongs in checkpoints.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from posttrain.tasks.base import Reward


def overlong_penalty(length: int, max_length: int, cache_length: int) -> float:
    """DAPO soft overlong punishment in [-1, 0]; see the module docstring."""
    if cache_length < 0 or cache_length > max_length:
        raise ValueError(
            f"cache_length must be in [0, max_length={max_length}], got {cache_length}"
        )
    expected = max_length - cache_length
    if length <= expected:
        return 0.0
    if length <= max_length:
        return (expected - length) / cache_length
    return -1.0


def format_reward(reward: Reward) -> float:
    """The ``format`` component, or 1/0 by whether the reward is positive when absent."""
    return float(reward.components.get("format", 1.0 if reward.value > 0 else 0.0))


class DomainNormalizer:
    """Running per-domain mean and standard deviation of rewards."""

    def __init__(self, ema: float = 0.01, min_std: float = 0.1, clip: float = 5.0):
        if not 0 < ema <= 1:
            raise ValueError(f"ema must be in (0, 1], got {ema!r}")
        if min_std <= 0:
            raise ValueError(f"min_std must be > 0, got {min_std!r}")
        self.ema, self.min_std, self.clip = ema, min_std, clip
        self._moments: dict[str, list[float]] = {}  # domain -> [count, mean, mean of squares]

    def update(self, domain: str, rewards: Sequence[float]) -> None:
        r = np.asarray(rewards, dtype=np.float64).reshape(-1)
        if r.size == 0:
            return
        count, mean, sq = self._moments.get(domain, (0, 0.0, 0.0))
        count += r.size
        rate = max(self.ema, r.size / count)
        mean += rate * (float(r.mean()) - mean)
        sq += rate * (float((r * r).mean()) - sq)
        self._moments[domain] = [count, mean, sq]

    def mean_std(self, domain: str) -> tuple[float, float]:
        count, mean, sq = self._moments.get(domain, (0, 0.0, 1.0))
        return mean, float(np.sqrt(max(sq - mean * mean, 0.0)))

    def normalize(self, domain: str, rewards: Sequence[float]) -> np.ndarray:
        mean, std = self.mean_std(domain)
        z = (np.asarray(rewards, dtype=np.float64) - mean) / max(std, self.min_std)
        return np.clip(z, -self.clip, self.clip)

    def state_dict(self) -> dict[str, Any]:
        return {"moments": {k: list(v) for k, v in self._moments.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._moments = {
            k: [int(v[0]), float(v[1]), float(v[2])] for k, v in state["moments"].items()
        }


@dataclasses.dataclass
class RewardShaper:
    """Turns verifier ``Reward``s into the scalar the RL loss sees (module docstring)."""

    format_weight: float = 0.0
    max_length: int | None = None
    cache_length: int = 0
    overlong_weight: float = 1.0
    normalize: bool = False
    normalizer: DomainNormalizer = dataclasses.field(default_factory=DomainNormalizer)

    def __post_init__(self):
        if not 0 <= self.format_weight <= 1:
            raise ValueError(f"format_weight must be in [0, 1], got {self.format_weight!r}")
        if self.max_length is not None and not 0 <= self.cache_length <= self.max_length:
            raise ValueError(
                f"cache_length must be in [0, max_length={self.max_length}], got {self.cache_length!r}"
            )

    def raw(self, reward: Reward, length: int | None = None) -> float:
        w = self.format_weight
        value = (1.0 - w) * reward.value + w * format_reward(reward)
        if self.max_length is not None and length is not None and self.overlong_weight:
            value += self.overlong_weight * overlong_penalty(
                length, self.max_length, self.cache_length
            )
        return value

    def shape(
        self, domain: str, rewards: Sequence[Reward], lengths: Sequence[int] | None = None
    ) -> np.ndarray:
        """Shaped rewards for one domain's completions; updates the running moments."""
        if lengths is not None and len(lengths) != len(rewards):
            raise ValueError(f"got {len(lengths)} lengths for {len(rewards)} rewards")
        lengths = [None] * len(rewards) if lengths is None else lengths
        raw = np.array([self.raw(r, n) for r, n in zip(rewards, lengths)], dtype=np.float64)
        if not self.normalize:
            return raw
        self.normalizer.update(domain, raw)
        return self.normalizer.normalize(domain, raw)
