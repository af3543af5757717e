"""Synthetic long user histories with a signal planted far back (issue 19).

Per user (everything from one numpy Generator, so a seed fixes the data):
  n ~ round(LogNormal(log median, sigma)), clipped to [1, max_len]; 0 with prob p_empty
  items_t ~ Uniform{0..vocab-1}, t = 0..n-1 (newest first); dt_t = cumulative
    Exponential(mean_gap_s) ages, so dt grows with t
  candidate c: with prob p_deep an item of an event older than the `recent` newest ones
    (t >= recent; needs n > recent), else with prob p_recent one of the `recent` newest,
    else a uniform item
  logit f = bias + beta * 1[c in items_0..n-1],   label ~ Bernoulli(sigmoid(f))

A model that sees only the newest `recent` events cannot tell a deep match from a fresh
candidate, so it loses the AUC the full history gives (`oracle_auc` of f, `short_oracle_auc`
of the best logit computable from the newest `recent` events). With the defaults
(median 300, sigma 1, max 4096): median length ~290, 55 % of the users have more than 256
events; on 20k users the oracle AUC is 0.82 and the newest-64-events oracle 0.63.
"""
from __future__ import annotations

import dataclasses

import numpy as np


def history_lengths(n: int, median: float, sigma: float, max_len: int,
                    rng: np.random.Generator) -> np.ndarray:
  """n log-normal lengths (median, sigma), rounded, clipped to [1, max_len]."""
  x = rng.lognormal(np.log(median), sigma, n)
  return np.clip(np.round(x), 1, max_len).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class LongHistory:
  """The generator's knobs (module docstring)."""
  max_len: int = 4096
  median: float = 300.0
  sigma: float = 1.0
  p_empty: float = 0.02
  vocab: int = 100_000
  recent: int = 64
  p_deep: float = 0.35
  p_recent: float = 0.15
  beta: float = 3.0
  bias: float = -1.5
  mean_gap_s: float = 3600.0

  def lengths(self, n: int, rng: np.random.Generator) -> np.ndarray:
    x = history_lengths(n, self.median, self.sigma, self.max_len, rng)
    return np.where(rng.random(n) < self.p_empty, 0, x)

  def batch(self, n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """n users: items (n, max_len) int32 (-1 padded), dt (n, max_len) float32 seconds,
    lengths (n,), candidate (n,), logit (n,) float32, label (n,) float32,
    deep_match / recent_match (n,) bool (where the candidate occurs)."""
    L = self.max_len
    lengths = self.lengths(n, rng)
    pos = np.arange(L)[None, :]
    valid = pos < lengths[:, None]  # (n, L)
    items = np.where(valid, rng.integers(0, self.vocab, (n, L)), -1).astype(np.int32)
    dt = np.cumsum(rng.exponential(self.mean_gap_s, (n, L)), axis=1).astype(np.float32)
    dt = np.where(valid, dt, 0.0).astype(np.float32)
    u = rng.random(n)
    # A uniform position among the deep (t >= recent) or the recent (t < recent) events.
    deep_t = self.recent + np.floor(rng.random(n) * np.maximum(lengths - self.recent, 0))
    recent_t = np.floor(rng.random(n) * np.minimum(lengths, self.recent))
    pick_deep = (u < self.p_deep) & (lengths > self.recent)
    pick_recent = ~pick_deep & (u < self.p_deep + self.p_recent) & (lengths > 0)
    t = np.where(pick_deep, deep_t, recent_t).astype(np.int64)
    from_hist = items[np.arange(n), np.minimum(t, L - 1)]
    cand = np.where(pick_deep | pick_recent, from_hist,
                    rng.integers(0, self.vocab, n)).astype(np.int32)
    hit = (items == cand[:, None]) & valid  # (n, L)
    recent_match = hit[:, :self.recent].any(1)
    deep_match = hit[:, self.recent:].any(1)
    logit = (self.bias + self.beta * (recent_match | deep_match)).astype(np.float32)
    label = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    return dict(items=items, dt=dt, lengths=lengths, candidate=cand, logit=logit, label=label,
                deep_match=deep_match, recent_match=recent_match)

  def short_logit(self, b: dict[str, np.ndarray]) -> np.ndarray:
    """The best logit from the newest `recent` events only: a recent match gives f's high
    value; otherwise the match rate of the users alike (a deep match needs n > recent,
    which the newest events show) mixed into the logit."""
    hi, lo = self.bias + self.beta, self.bias
    out = np.full(b["logit"].shape, hi, np.float32)
    long = b["lengths"] > self.recent
    for group in (long, ~long):
      rest = group & ~b["recent_match"]
      q = (b["deep_match"] & rest).sum() / max(rest.sum(), 1)  # deep matches among them
      p = q / (1 + np.exp(-hi)) + (1 - q) / (1 + np.exp(-lo))
      out[rest] = np.log(p / (1 - p))
    return out
