"""Host-side id policy: raw ids -> int32 row ids in [0, rows), -1 = padding.

Runs on numpy batches before the step, so that an out-of-range id fails with a
clear message instead of silently reading a clamped row on the device.

Signed ids: negative = padding. Unsigned ids (uint64 up to 2^64 - 1) are all
real ids, taken by value: never cast to int64, so none becomes padding.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from gem_jax.embedding import managed
from gem_jax.embedding.plan import EmbeddingPlan

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _check_integer(ids: np.ndarray, feature: str) -> None:
  if not np.issubdtype(ids.dtype, np.integer):
    raise TypeError(f"feature {feature!r}: ids must be integers, got {ids.dtype}")


def _padding(ids: np.ndarray) -> np.ndarray:
  """Padding mask: id < 0 for signed dtypes, nothing for unsigned ones."""
  if np.issubdtype(ids.dtype, np.unsignedinteger):
    return np.zeros(ids.shape, bool)
  return ids < 0


def _as_uint64(ids: np.ndarray) -> np.ndarray:
  """The 64-bit pattern of each id: uint64 by value, signed ids as two's complement."""
  if np.issubdtype(ids.dtype, np.unsignedinteger):
    return ids.astype(np.uint64)
  return ids.astype(np.int64).view(np.uint64)


def hash_ids(ids: np.ndarray, rows: int) -> np.ndarray:
  """splitmix64(id) mod rows for real ids; padding (negative signed ids) stays -1.

  A bijective 64-bit mix before the modulo spreads sequential or strided raw ids
  evenly over the buckets (and hence over row-wise shards). The mix reads the
  full 64 bits: a signed id x >= 0 and the unsigned id x hash alike, and uint64
  ids >= 2^63 are hashed by value. Returns int64.
  """
  ids = np.asarray(ids)
  z = _as_uint64(ids) + _GOLDEN
  z = (z ^ (z >> np.uint64(30))) * _M1
  z = (z ^ (z >> np.uint64(27))) * _M2
  z = z ^ (z >> np.uint64(31))
  out = (z % np.uint64(rows)).astype(np.int64)
  return np.where(_padding(ids), -1, out)


def apply_id_policy(ids: np.ndarray, rows: int, policy: str, feature: str,
                    table: str) -> np.ndarray:
  """Maps raw ids of `feature` into table `table` of `rows` rows; returns int32.

  'error': ids in [0, rows) pass unchanged, a larger one raises; 'clip':
  min(id, rows - 1); 'hash': `hash_ids`. Padding (negative signed ids) -> -1.
  """
  ids = np.asarray(ids)
  _check_integer(ids, feature)
  pad = _padding(ids)
  if policy == "hash":
    out = hash_ids(ids, rows)
  elif policy == "clip":
    out = np.where(pad, -1, np.minimum(ids, rows - 1).astype(np.int64))
  elif policy == "managed":
    raise ValueError(f"feature {feature!r}: table {table!r} is managed: its rows come from the "
                     "map inside the step (prepare_ids gives the raw-id halves, "
                     "managed.resolve the rows)")
  elif policy == "error":
    bad = ~pad & (ids >= rows)   # numpy compares uint64 with int by value
    if bad.any():
      where = tuple(int(i) for i in np.argwhere(bad)[0])
      raise ValueError(
          f"feature {feature!r}: id {int(ids[where])} at position {where} is out of range "
          f"for table {table!r} of {rows} rows (id_policy='error'; use 'hash' or 'clip' "
          f"to map it into range)")
    out = np.where(pad, -1, ids.astype(np.int64))   # every real id is < rows here
  else:
    raise ValueError(f"unknown id policy {policy!r}")
  return out.astype(np.int32)


def id_collisions(raw: np.ndarray, rows: np.ndarray) -> tuple[int, int]:
  """(distinct raw ids, distinct rows they land on) over the valid entries of a batch.

  `raw` and `rows` are the same shape (before / after `apply_id_policy`); padding
  (rows == -1) is left out. Exact for the batch: two sorts of at most B x bag
  values, no state kept between batches. Merged share = 1 - rows / ids.
  """
  raw, rows = np.asarray(raw).ravel(), np.asarray(rows).ravel()
  valid = rows >= 0
  return int(np.unique(raw[valid]).size), int(np.unique(rows[valid]).size)


def table_collisions(plan: EmbeddingPlan, host_ids: Mapping[str, np.ndarray],
                     prepared: Mapping[str, np.ndarray],
                     policies: tuple[str, ...] = ("hash", "clip")) -> dict[str, tuple[int, int]]:
  """Per table: `id_collisions` over all features reading it (their ids pooled).

  Only tables whose id policy is in `policies` (under 'error' no two ids share a
  row). Works on a global batch or one process's slice alike.
  """
  raw, out = {}, {}
  for name, f in plan.features.items():
    t = plan.tables[f.table]
    if t.id_policy in policies:
      raw.setdefault(t.name, []).append((np.asarray(host_ids[name]), prepared[name]))
  for t, pairs in raw.items():
    r = np.concatenate([_as_uint64(a).ravel() for a, _ in pairs])
    m = np.concatenate([b.ravel() for _, b in pairs])
    out[t] = id_collisions(r, m)
  return out


def prepare_ids(plan: EmbeddingPlan, host_ids: Mapping[str, np.ndarray], *,
                process_index: int = 0, process_count: int = 1) -> dict[str, np.ndarray]:
  """Applies each table's id policy to a host batch `{feature: (B / P, bag) ints}`.

  B is the plan's global batch (`plan.batch_size`), P = `process_count`: each
  process passes its own rows (its slice of the global batch, assembled into
  global arrays by `jax.make_array_from_process_local_data`); the policies are
  per id, so a slice is prepared alone. Returns `{feature: int32 (B / P, bag)}`
  with -1 at padding (features of managed tables: int32 (B / P, bag, 2), the raw ids'
  halves, `managed.split_ids`: the step maps them, `managed.resolve`); put a single
  process's batch on the mesh with `jax.device_put(ids, plan.ids_shardings())`.
  """
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index {process_index} not in [0, {process_count})")
  local = plan.batch_size // process_count
  out = {}
  for name, f in plan.features.items():
    if name not in host_ids:
      raise KeyError(f"ids for feature {name!r} are missing; got {sorted(host_ids)}")
    ids = np.asarray(host_ids[name])
    if ids.shape != (local, f.bag):
      whose = ("the plan's global batch" if process_count == 1 else
               f"process {process_index}'s {local} of {plan.batch_size} rows")
      raise ValueError(f"feature {name!r}: ids of shape {ids.shape}, expected "
                       f"({local}, {f.bag}) ({whose}, bag; another batch size needs its "
                       f"own plan, see docs/embedding.md)")
    t = plan.tables[f.table]
    if t.id_policy == "managed":   # raw ids as int32 halves (local_batch, bag, 2)
      out[name] = managed.split_ids(ids, name, t.name)
    else:
      out[name] = apply_id_policy(ids, t.rows, t.id_policy, name, t.name)
  return out
