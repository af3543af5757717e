"""Plain configs of the embedding engine: tables, the features that read them, the optimizer.

A *table* is a (rows, dim) matrix of embeddings; a *feature* is one column of the
batch (`batch['ids'][feature]`, shape (B, bag)) whose ids index one table. Several
features may share a table (the ad-id table read by the candidate ad and by the
ad history). A feature's pooling turns its bag of ids into one vector per example
(`sum`, `mean`) or keeps one vector per id (`none`, sequence features: (B, L, D)).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

Dtype = Any
Initializer = Callable[[jax.Array, tuple[int, ...], Dtype], jax.Array]

SHARDING_TYPES = ("auto", "table_wise", "row_wise", "column_wise", "replicated")
ID_POLICIES = ("hash", "error", "clip", "managed")
EVICTIONS = ("lru", "lfu")
POOLINGS = ("sum", "mean", "none")
OPTIMIZERS = ("rowwise_adagrad", "sgd", "adam")
# Row ids are int32 on the device, INT32_MAX marks "no row" in the row-wise exchange: every
# row of every state buffer must have a smaller index.
MAX_ROWS = (1 << 31) - 2


def uniform_init(scale: float | None = None) -> Initializer:
  """U(-s, s) with s = `scale`, or 1/sqrt(rows) when None (TorchRec's default).

  `rows` (optional) is the table's row count when `shape` holds only some of its
  rows (managed tables re-initialise evicted rows in batches); default shape[0].
  """
  def init(key, shape, dtype, rows=None):
    s = scale if scale is not None else 1.0 / max(rows or shape[0], 1) ** 0.5
    return jax.random.uniform(key, shape, jnp.float32, -s, s).astype(dtype)
  return init


def normal_init(stddev: float = 0.01) -> Initializer:
  """N(0, stddev^2) (`rows` is accepted and unused, see `uniform_init`)."""
  def init(key, shape, dtype, rows=None):
    return (stddev * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
  return init


@dataclasses.dataclass(frozen=True)
class TableConfig:
  """One embedding table of `rows` x `dim`.

  Args:
    name: unique table name (the key of the canonical state).
    rows: number of rows (vocabulary or hash buckets).
    dim: embedding width D.
    dtype: storage dtype of the weights (optimizer slots are fp32).
    sharding: 'table_wise' (whole table on one 'shard' device), 'row_wise'
      (contiguous row blocks over 'shard'), 'column_wise' (column blocks over
      'shard'), 'replicated' (every device), or 'auto' (the planner decides).
    initializer: `init(key, (rows, dim), dtype) -> array`.
    id_policy: what `prepare_ids` does with raw ids. 'error' (default): ids in
      [0, rows) pass unchanged, an id >= rows raises a ValueError naming it;
      'hash': splitmix64(id) mod rows for every id, also those already in range
      (raw 64-bit ids, signed or uint64; distinct ids can share a row); 'clip':
      min(id, rows - 1); 'managed': a managed-collision map owned with the rows
      (gem_jax/embedding/managed.py): every distinct raw id in [0, 2^63) gets a row of
      its own while one is free in its probe window, else evicts by `eviction`;
      -1 is padding there and other negative ids raise. Negative signed ids are
      padding under the other policies.
    vocab: distinct raw ids the table's features can carry, when known (None:
      unknown). Used only by `EmbeddingPlan.describe()` for the expected
      share of ids that the policy merges (`expected_collision_rate`).
    optimizer: this table's `SparseOptimizerConfig` (kind, lr, ...); None: the
      plan's. Optimizer state stays fp32 whatever `dtype` the weights have.
    eviction: managed tables: 'lru' (evict the probed slot seen longest ago) or 'lfu'
      (the one with the fewest lookups, then the oldest).
    ttl_steps: managed tables: an id not seen for this many steps is forgotten (its
      slot is free again); 0: never.
    probe: managed tables: slots per probe window (the rows an id may occupy);
      `rows` must be a multiple of it.
  """
  name: str
  rows: int
  dim: int
  dtype: Dtype = jnp.float32
  sharding: str = "auto"
  initializer: Initializer = dataclasses.field(default_factory=uniform_init)
  id_policy: str = "error"
  vocab: int | None = None
  optimizer: "SparseOptimizerConfig | None" = None
  eviction: str = "lru"
  ttl_steps: int = 0
  probe: int = 8

  def __post_init__(self):
    if self.rows <= 0 or self.dim <= 0:
      raise ValueError(f"table {self.name!r}: rows and dim must be positive, got "
                       f"rows={self.rows} dim={self.dim}")
    if self.rows > MAX_ROWS:
      raise ValueError(f"table {self.name!r}: {self.rows:,d} rows, more than the engine can "
                       f"address ({MAX_ROWS:,d}: device row ids are int32); split it into "
                       "several tables (features hashed into each) or use fewer rows")
    if self.sharding not in SHARDING_TYPES:
      raise ValueError(f"table {self.name!r}: sharding {self.sharding!r} not in {SHARDING_TYPES}")
    if self.id_policy not in ID_POLICIES:
      raise ValueError(f"table {self.name!r}: id_policy {self.id_policy!r} not in {ID_POLICIES}")
    if self.eviction not in EVICTIONS:
      raise ValueError(f"table {self.name!r}: eviction {self.eviction!r} not in {EVICTIONS}")
    if self.ttl_steps < 0:
      raise ValueError(f"table {self.name!r}: ttl_steps must be >= 0, got {self.ttl_steps}")
    if self.probe <= 0:
      raise ValueError(f"table {self.name!r}: probe must be positive, got {self.probe}")
    if self.id_policy == "managed":
      if self.rows % self.probe:
        raise ValueError(f"table {self.name!r}: id_policy='managed' needs rows a multiple of "
                         f"probe={self.probe}, got rows={self.rows}")
      if self.sharding not in ("auto", "row_wise"):
        raise ValueError(f"table {self.name!r}: id_policy='managed' tables are row_wise "
                         f"(their map is sharded with the rows), got sharding={self.sharding!r}")
    if self.vocab is not None and self.vocab <= 0:
      raise ValueError(f"table {self.name!r}: vocab must be positive or None, got {self.vocab}")


def expected_collision_rate(rows: int, vocab: int | None, policy: str) -> float | None:
  """Expected share of distinct ids merged with another id, 1 - E[rows hit] / vocab.

  hash (vocab ids uniform over `rows` buckets): E[rows hit] = rows (1 - (1 - 1/rows)^vocab),
  e.g. vocab = rows: 1 - (1 - 1/e) = 36.8 %; clip: min(vocab, rows) rows hit;
  error: 0. None when `vocab` is unknown.
  """
  if policy in ("error", "managed"):
    return 0.0
  if vocab is None:
    return None
  if policy == "clip":
    return 1.0 - min(vocab, rows) / vocab
  hit = -rows * math.expm1(vocab * math.log1p(-1.0 / rows)) if rows > 1 else 1.0
  return max(0.0, 1.0 - hit / vocab)


@dataclasses.dataclass(frozen=True)
class FeatureConfig:
  """A sparse feature: `bag` ids per example (L for sequences) looked up in `table`.

  Pooling: 'sum' -> sum_i w_i e_i; 'mean' -> sum_i w_i e_i / n_valid (0 for an
  empty bag); 'none' -> one row per id, (B, L, D), zeros at padding (-1) ids.
  """
  name: str
  table: str
  bag: int = 1
  pooling: str = "sum"

  def __post_init__(self):
    if self.bag <= 0:
      raise ValueError(f"feature {self.name!r}: bag must be positive, got {self.bag}")
    if self.pooling not in POOLINGS:
      raise ValueError(f"feature {self.name!r}: pooling {self.pooling!r} not in {POOLINGS}")


@dataclasses.dataclass(frozen=True)
class SparseOptimizerConfig:
  """The optimizer applied in place to the looked-up rows (see docs/embedding.md).

  rowwise_adagrad (FBGEMM): s += mean_j g_j^2 (one s per row); w -= lr g / (sqrt(s) + eps).
  sgd: w -= lr g.
  adam (lazy: only rows present in the batch move): m = b1 m + (1-b1) g,
    v = b2 v + (1-b2) g^2, w -= lr (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps),
    t = number of update steps taken (global).
  """
  kind: str = "rowwise_adagrad"
  lr: float = 0.01
  eps: float = 1e-8
  beta1: float = 0.9
  beta2: float = 0.999
  initial_accumulator: float = 0.0

  def __post_init__(self):
    if self.kind not in OPTIMIZERS:
      raise ValueError(f"sparse optimizer {self.kind!r} not in {OPTIMIZERS}")

  def slot_names(self) -> tuple[str, ...]:
    return {"rowwise_adagrad": ("accumulator",), "sgd": (), "adam": ("m", "v", "step")}[self.kind]

  def slot_bytes_per_row(self, dim: int) -> int:
    """fp32 bytes of optimizer state per table row of width `dim`."""
    return {"rowwise_adagrad": 4, "sgd": 0, "adam": 8 * dim}[self.kind]
