"""Jagged histories: lengths, truncation, and packing into fixed-size token rows.

A batch of N users' histories is carried padded, (N, L, ...) with `lengths` (N,) and
events newest first (position 0 = newest). Packing puts several histories into R rows
of T tokens each, so that padding costs at most the unfilled tail of each row:

  plan = pack_plan(lengths, T)      # first-fit decreasing, host side (numpy)
  x_p = pack(x, plan)               # (N, L, ...) -> (R, T, ...)  one gather
  seg, pos, valid = plan.seg, plan.pos, plan.valid           # (R, T) each
  y = unpack(y_p, plan, L)          # (R, T, ...) -> (N, L, ...), 0 at padding

Row r, token t holds event plan.pos[r, t] of user plan.user[r, t] (valid tokens) or
padding (valid False, user -1, pos 0). plan.seg numbers the histories of each row
0, 1, 2, ... along the row (the tail padding gets the next number), so segment ids
increase along a row and the chunked attention skips tiles of disjoint segments.
Attention masked to seg_q == seg_k with in-segment positions gives each history exactly
its padded-row result (tests/test_packing.py, tests/test_hstu.py).

Across devices, `balance(lengths, shards)` orders a batch so that each of `shards` equal
slices gets the same number of histories and nearly the same number of events (sorted by
length, dealt out in a snake order 0..S-1, S-1..0, ...: the slices' event counts differ by
at most the longest history).

Bad input, defined:
  * a history longer than the maximum: the most recent `max_len` events are kept
    (positions [0, max_len)), and the number of truncated histories and events is
    counted (`truncate`);
  * an empty history (length 0): takes no token of any row; unpacked it is all padding;
  * a length < 0, or greater than the padded width L of the data: ValueError naming
    the row (the lengths disagree with the data).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Truncation:
  """Histories cut to max_len (most recent kept): how many, and how many events dropped."""
  histories: int
  events: int


def check_lengths(lengths, width: int) -> np.ndarray:
  """lengths (N,) as int64, each in [0, width]; ValueError naming the first bad row."""
  lengths = np.asarray(lengths, np.int64)
  bad = np.flatnonzero((lengths < 0) | (lengths > width))
  if bad.size:
    i = int(bad[0])
    raise ValueError(f"history length {int(lengths[i])} at row {i} is outside [0, {width}] "
                     f"(the padded width of the data)")
  return lengths


def truncate(lengths, max_len: int) -> tuple[np.ndarray, Truncation]:
  """min(lengths, max_len) and the count of what was cut (newest events are kept)."""
  lengths = np.asarray(lengths, np.int64)
  if (lengths < 0).any():
    raise ValueError(f"negative history length at row {int(np.flatnonzero(lengths < 0)[0])}")
  over = lengths > max_len
  cut = Truncation(int(over.sum()), int((lengths[over] - max_len).sum()))
  return np.minimum(lengths, max_len), cut


@dataclasses.dataclass(frozen=True)
class PackPlan:
  """Where every history goes. N users, R rows of T tokens.

  row, offset: (N,) the row of user i and the token where it starts (-1, 0 when empty).
  user, pos: (R, T) int32 user and in-history position of each token (-1, 0 at padding).
  seg: (R, T) int32 segment number within the row, increasing along it.
  valid: (R, T) bool.
  """
  row: np.ndarray
  offset: np.ndarray
  lengths: np.ndarray
  user: np.ndarray
  seg: np.ndarray
  pos: np.ndarray
  valid: np.ndarray

  @property
  def rows(self) -> int:
    return self.user.shape[0]

  @property
  def capacity(self) -> int:
    return self.user.shape[1]

  @property
  def fill(self) -> float:
    """Real tokens / packed tokens."""
    return float(self.valid.mean()) if self.valid.size else 0.0


def pack_plan(lengths, capacity: int, num_rows: int | None = None) -> PackPlan:
  """First-fit decreasing of histories (each <= capacity) into rows of `capacity` tokens.

  num_rows: a fixed number of rows (static shapes across steps); ValueError when the
  histories do not fit. Default: as many rows as first-fit needs.
  """
  lengths = np.asarray(lengths, np.int64)
  if (lengths < 0).any() or (lengths > capacity).any():
    raise ValueError(f"history lengths must be in [0, {capacity}] (truncate first): "
                     f"got min {lengths.min()}, max {lengths.max()}")
  n = lengths.shape[0]
  row = np.full(n, -1, np.int64)
  offset = np.zeros(n, np.int64)
  free: list[int] = []  # tokens left per row
  for i in np.argsort(-lengths, kind="stable"):
    li = int(lengths[i])
    if li == 0:
      continue
    r = next((j for j, f in enumerate(free) if f >= li), None)
    if r is None:
      free.append(capacity)
      r = len(free) - 1
    row[i], offset[i] = r, capacity - free[r]
    free[r] -= li
  rows = len(free) if num_rows is None else num_rows
  if len(free) > rows:
    raise ValueError(f"{int(lengths.sum())} tokens of {n} histories need {len(free)} rows of "
                     f"{capacity}, only {rows} allowed")
  user = np.full((rows, capacity), -1, np.int32)
  pos = np.zeros((rows, capacity), np.int32)
  for i in np.flatnonzero(row >= 0):
    sl = slice(offset[i], offset[i] + lengths[i])
    user[row[i], sl] = i
    pos[row[i], sl] = np.arange(lengths[i])
  starts = np.concatenate([np.ones((rows, 1), bool), user[:, 1:] != user[:, :-1]], axis=1)
  seg = (np.cumsum(starts, axis=1) - 1).astype(np.int32)  # 0, 1, .. along each row
  return PackPlan(row, offset, lengths, user, seg, pos, user >= 0)


def balance(lengths, shards: int) -> np.ndarray:
  """A permutation of the N = shards * m histories: perm.reshape(shards, m)[s] are shard s's.

  Longest first, dealt 0, 1, .., S-1, S-1, .., 0, 0, 1, ..: every shard gets m histories,
  and shard event counts differ by at most max(lengths).
  """
  lengths = np.asarray(lengths, np.int64)
  n = lengths.shape[0]
  if n % shards:
    raise ValueError(f"{n} histories do not split into {shards} equal shards")
  order = np.argsort(-lengths, kind="stable")  # (N,)
  r = np.arange(n)
  rnd, k = r // shards, r % shards
  shard = np.where(rnd % 2 == 0, k, shards - 1 - k)  # snake
  slot = rnd  # position within the shard
  perm = np.empty(n, np.int64)
  perm[shard * (n // shards) + slot] = order
  return perm


def pack(x: jax.Array, plan: PackPlan) -> jax.Array:
  """(N, L, ...) padded histories -> (R, T, ...) packed rows (0 at padding tokens)."""
  N, L = x.shape[:2]
  src = np.where(plan.valid, plan.user.astype(np.int64) * L + plan.pos, 0)  # (R, T)
  flat = x.reshape((N * L,) + x.shape[2:])
  out = jnp.take(flat, jnp.asarray(src), axis=0)  # (R, T, ...)
  m = jnp.asarray(plan.valid).reshape(plan.valid.shape + (1,) * (x.ndim - 2))
  return jnp.where(m, out, jnp.zeros((), x.dtype))


def unpack(y: jax.Array, plan: PackPlan, width: int) -> jax.Array:
  """(R, T, ...) packed rows -> (N, width, ...) padded histories (0 past each length)."""
  R, T = y.shape[:2]
  p = np.arange(width)[None, :]  # (1, L)
  ok = (p < plan.lengths[:, None]) & (plan.row[:, None] >= 0)  # (N, L)
  src = np.where(ok, plan.row[:, None] * T + plan.offset[:, None] + p, 0)  # (N, L)
  flat = y.reshape((R * T,) + y.shape[2:])
  out = jnp.take(flat, jnp.asarray(src), axis=0)  # (N, L, ...)
  m = jnp.asarray(ok).reshape(ok.shape + (1,) * (y.ndim - 2))
  return jnp.where(m, out, jnp.zeros((), y.dtype))
