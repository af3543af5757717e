"""Synthetic Criteo-like batches for the TorchRec comparison (numpy only; no jax, no torch).

Both sides of `scripts/benchmark.py --peer torchrec` train on these arrays: gem_jax
through `gem_jax.bench.peer.PeerSource`, TorchRec through benchmarks/torchrec/bench.py,
which imports this module from the checkout (gem_jax need not be installed there).

Data model, T tables of `rows` rows, batch B, L ids per table and example:
  ids     per table, a truncated Zipf over ranks k = 0..rows-1,
            P(k) = (k+1)^-alpha / sum_j (j+1)^-alpha,
          drawn by inverse CDF (k = #{cdf <= u}, u ~ U[0,1)); a per-table random
          permutation maps rank k to row perm[k], so hot rows are scattered over the
          table as hashed production ids are (`permute=False`: row = rank).
  dense   log1p(floor(lognormal(mu=1, sigma=1.5))), (B, 13): log-scaled counts.
  labels  Bernoulli(0.25), (B,): Criteo's click rate.

Random streams: `default_rng(seed)` draws the T permutations (table order), then
`default_rng(seed + 1)` draws each batch: dense, then the ids of table 0..T-1, then
the labels. The same seed gives the same arrays on every machine (numpy's PCG64),
and the same arrays as ../shared/peers/torchrec_bench.py's generator, which follows
the same model and order.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

NUM_DENSE = 13
LABEL_RATE = 0.25
DENSE_MU, DENSE_SIGMA = 1.0, 1.5


class Batch(NamedTuple):
  dense: np.ndarray   # (B, 13) float32
  ids: np.ndarray     # (T, B, L) int64, row ids in [0, rows)
  labels: np.ndarray  # (B,) float32 in {0, 1}


class ZipfTable:
  """Id sampler of one table: rank k ~ Zipf(alpha) truncated to [0, rows), row = perm[k]."""

  def __init__(self, rows: int, alpha: float, rng: np.random.Generator | None = None,
               permute: bool = True):
    if rows < 1 or alpha <= 0:
      raise ValueError(f"ZipfTable needs rows >= 1 and alpha > 0, got rows={rows}, alpha={alpha}")
    if permute and rng is None:
      raise ValueError("ZipfTable(permute=True) needs an rng for the rank permutation")
    w = np.arange(1, rows + 1, dtype=np.float64) ** (-alpha)  # (rows,) unnormalized P(k)
    cdf = np.cumsum(w)
    self.cdf = cdf / cdf[-1]                                  # (rows,), cdf[-1] == 1
    self.rows, self.alpha = rows, alpha
    self.perm = rng.permutation(rows).astype(np.int64) if permute else None

  def probs(self) -> np.ndarray:
    """P(rank k), (rows,)."""
    return np.diff(self.cdf, prepend=0.0)

  def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
    """n row ids, (n,) int64."""
    rank = np.searchsorted(self.cdf, rng.random(n), side="right")
    rank = np.minimum(rank, self.rows - 1).astype(np.int64)  # u within 1 ulp of 1
    return rank if self.perm is None else self.perm[rank]


def make_tables(num_tables: int, rows: int, alpha: float = 1.05, seed: int = 0,
                permute: bool = True) -> list[ZipfTable]:
  """T samplers whose permutations come from one `default_rng(seed)`, in table order."""
  rng = np.random.default_rng(seed)
  return [ZipfTable(rows, alpha, rng, permute) for _ in range(num_tables)]


def draw_batch(tables: list[ZipfTable], batch_size: int, pooling: int,
               rng: np.random.Generator) -> Batch:
  """One batch from `rng`: dense (B, 13), ids (T, B, L), labels (B,)."""
  b, l = batch_size, pooling
  counts = np.floor(rng.lognormal(DENSE_MU, DENSE_SIGMA, size=(b, NUM_DENSE)))
  dense = np.log1p(counts).astype(np.float32)                                  # (B, 13)
  ids = np.stack([t.draw(b * l, rng).reshape(b, l) for t in tables])           # (T, B, L)
  labels = (rng.random(b) < LABEL_RATE).astype(np.float32)                     # (B,)
  return Batch(dense, ids, labels)


class PeerData:
  """The comparison's data settings; `pool(B, n)` gives its first n batches of B rows.

  Args:
    num_tables, rows, pooling, alpha, seed, permute: as the peer's flags
      `--num-tables --rows --pooling --alpha --seed --no-permute`.
  """

  def __init__(self, num_tables: int = 8, rows: int = 100_000, pooling: int = 1,
               alpha: float = 1.05, seed: int = 0, permute: bool = True):
    if num_tables < 1 or pooling < 1:
      raise ValueError(f"PeerData needs num_tables >= 1 and pooling >= 1, got {num_tables}, "
                       f"{pooling}")
    self.num_tables, self.rows, self.pooling = num_tables, rows, pooling
    self.alpha, self.seed, self.permute = alpha, seed, permute
    self._tables: list[ZipfTable] | None = None

  @property
  def tables(self) -> list[ZipfTable]:
    if self._tables is None:
      self._tables = make_tables(self.num_tables, self.rows, self.alpha, self.seed, self.permute)
    return self._tables

  def pool(self, batch_size: int, n: int) -> list[Batch]:
    """Batches 0..n-1 of `batch_size` rows (a fresh `default_rng(seed + 1)` each call)."""
    if batch_size < 1 or n < 1:
      raise ValueError(f"pool needs batch_size >= 1 and n >= 1, got {batch_size}, {n}")
    rng = np.random.default_rng(self.seed + 1)
    return [draw_batch(self.tables, batch_size, self.pooling, rng) for _ in range(n)]
