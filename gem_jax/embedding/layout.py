"""Offset and size arithmetic of the sharded layout: small pure functions, tested alone.

Notation used across the engine: R = mesh size along 'replica', S = along
'shard', B = global batch, b = B / (R S) examples per device.
"""
from __future__ import annotations

import math
from typing import Sequence

from jax.sharding import PartitionSpec as P

NO_ROW = 2 ** 31 - 1   # int32 max: sorts after every row; the padding of distinct-row lists


def ceil_div(a: int, b: int) -> int:
  return -(-a // b)


def rows_per_shard(rows: int, num_shards: int) -> int:
  """Row-wise block size: shard j holds rows [j * rps, (j + 1) * rps).

  >>> rows_per_shard(10, 4)   # shards hold 3, 3, 3, 1 real rows (+ padding)
  3
  """
  return ceil_div(rows, num_shards)


def cols_per_shard(dim: int, num_shards: int) -> int:
  """Column-wise block width: shard j holds columns [j * cps, (j + 1) * cps)."""
  return ceil_div(dim, num_shards)


def count_bound(mean: float, limit: int, sigmas: float = 4.0) -> int:
  """A count of expected value `mean` (binomial-like) with room: ceil(mean + sigmas
  sqrt(mean)) + 1, at most `limit`.

  >>> count_bound(64, 512)   # 64 + 4 * 8 + 1
  97
  """
  return int(min(limit, math.ceil(mean + sigmas * math.sqrt(mean)) + 1))


def rw_capacity(distinct: float, num_shards: int, slots: int, sigmas: float = 4.0) -> int:
  """Ids one device sends to one owner per step (the row-wise all_to_all buffer width).

  `distinct` ids per device spread over S owners (hashed ids: binomial, mean m =
  distinct / S): C = ceil(m + sigmas sqrt(m)) + 1, at most `slots` (the device's id
  slots: then nothing can overflow). More per pair takes the exact broadcast path.

  >>> rw_capacity(512, 8, 512)   # m = 64: 64 + 4 * 8 + 1
  97
  """
  if num_shards == 1:
    return slots
  return count_bound(distinct / num_shards, slots, sigmas)


def row_owner(ids, rps: int):
  """(owner shard, local row) of global row ids under a row-wise split of `rps` rows."""
  return ids // rps, ids % rps


def assign_table_wise(costs: Sequence[float], num_shards: int,
                      initial_load: Sequence[float] | None = None) -> list[int]:
  """Greedy longest-processing-time placement: biggest cost first, onto the least loaded shard.

  Returns the owner shard of each item, in input order. Ties go to the lowest shard.

  >>> assign_table_wise([5, 4, 3, 3], 2)
  [0, 1, 1, 0]
  """
  load = list(initial_load) if initial_load is not None else [0.0] * num_shards
  owner = [0] * len(costs)
  for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
    j = min(range(num_shards), key=lambda j: (load[j], j))
    owner[i] = j
    load[j] += costs[i]
  return owner


def block_offsets(owners: Sequence[int], sizes: Sequence[int],
                  num_shards: int) -> tuple[list[int], int]:
  """Offsets of items packed per owner into equal blocks, and the block capacity.

  Item i lives at rows [offset[i], offset[i] + sizes[i]) of its owner's block;
  the capacity is the fullest block (at least 1).

  >>> block_offsets([0, 1, 0], [5, 7, 2], 2)
  ([0, 0, 5], 7)
  """
  fill = [0] * num_shards
  offsets = []
  for o, n in zip(owners, sizes):
    offsets.append(fill[o])
    fill[o] += n
  return offsets, max(max(fill), 1)


def slot_table(owners: Sequence[int], num_shards: int) -> tuple[list[list[int]], int]:
  """Send-buffer slots of a table-wise all_to_all.

  Item i (a feature) goes to shard owners[i]. Returns slots[j] = items sent to
  shard j (in input order, padded with -1 to the same length) and that length P.

  >>> slot_table([1, 0, 1], 2)
  ([[1, -1], [0, 2]], 2)
  """
  slots = [[i for i, o in enumerate(owners) if o == j] for j in range(num_shards)]
  width = max(1, max(len(s) for s in slots))
  return [s + [-1] * (width - len(s)) for s in slots], width


def canonical_spec(rows: int, dim: int | None, num_shards: int) -> P:
  """How an unpadded canonical array is split for checkpoints: by rows over 'shard'
  when they divide evenly, else by columns, else replicated (jax needs even splits)."""
  if rows % num_shards == 0:
    return P("shard") if dim is None else P("shard", None)
  if dim is not None and dim % num_shards == 0:
    return P(None, "shard")
  return P() if dim is None else P(None, None)


def nbytes(shape: Sequence[int], itemsize: int) -> int:
  return int(math.prod(shape)) * int(itemsize)
