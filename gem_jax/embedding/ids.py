"""Host-side id policy: raw ids -> int32 row ids in [0, rows), -1 = padding.

Runs on numpy batches before the step, so that an out-of-range id fails with a
clear message instead of silently reading a clamped row on the device.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from gem_jax.embedding.plan import EmbeddingPlan

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def hash_ids(ids: np.ndarray, rows: int) -> np.ndarray:
  """splitmix64(id) mod rows for ids >= 0; negative ids stay -1 (padding).

  A bijective 64-bit mix before the modulo spreads sequential or strided raw ids
  evenly over the buckets (and hence over row-wise shards).
  """
  ids = np.asarray(ids)
  z = ids.astype(np.int64).view(np.uint64) + _GOLDEN
  z = (z ^ (z >> np.uint64(30))) * _M1
  z = (z ^ (z >> np.uint64(27))) * _M2
  z = z ^ (z >> np.uint64(31))
  out = (z % np.uint64(rows)).astype(np.int64)
  return np.where(ids < 0, -1, out)


def apply_id_policy(ids: np.ndarray, rows: int, policy: str, feature: str,
                    table: str) -> np.ndarray:
  """Maps raw ids of `feature` into table `table` of `rows` rows; returns int32."""
  ids = np.asarray(ids)
  if not np.issubdtype(ids.dtype, np.integer):
    raise TypeError(f"feature {feature!r}: ids must be integers, got {ids.dtype}")
  ids = ids.astype(np.int64)
  if policy == "hash":
    out = hash_ids(ids, rows)
  elif policy == "clip":
    out = np.where(ids < 0, -1, np.minimum(ids, rows - 1))
  elif policy == "error":
    bad = ids >= rows
    if bad.any():
      where = tuple(int(i) for i in np.argwhere(bad)[0])
      raise ValueError(
          f"feature {feature!r}: id {int(ids[where])} at position {where} is out of range "
          f"for table {table!r} of {rows} rows (id_policy='error'; use 'hash' or 'clip' "
          f"to map it into range)")
    out = np.where(ids < 0, -1, ids)
  else:
    raise ValueError(f"unknown id policy {policy!r}")
  return out.astype(np.int32)


def prepare_ids(plan: EmbeddingPlan, host_ids: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Applies each table's id policy to a host batch `{feature: (B, bag) ints}`.

  Returns `{feature: int32 (B, bag)}` with -1 at padding; put it on the mesh with
  `jax.device_put(ids, plan.ids_shardings())`.
  """
  out = {}
  for name, f in plan.features.items():
    if name not in host_ids:
      raise KeyError(f"ids for feature {name!r} are missing; got {sorted(host_ids)}")
    ids = np.asarray(host_ids[name])
    if ids.shape != (plan.batch_size, f.bag):
      raise ValueError(f"feature {name!r}: ids of shape {ids.shape}, expected "
                       f"({plan.batch_size}, {f.bag}) (global batch, bag)")
    t = plan.tables[f.table]
    out[name] = apply_id_policy(ids, t.rows, t.id_policy, name, t.name)
  return out
