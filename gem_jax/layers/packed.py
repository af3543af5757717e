"""Packed histories on device: a first-fit-decreasing plan and its gathers, inside jit.

The model packs each batch shard's histories itself (static shapes, no host plan): a
batch of B users over G batch shards is G groups of N = B / G users, and group g's
users go into its own R rows of T tokens, so every gather stays on its device.

User n with length len_n takes S_n = c + len_n consecutive tokens of one row: c slots
for the CLS tokens, then its events newest first (slot c + j holds event j). Per group:

  order     users by S_n descending (stable)
  row_n     the first row with S_n tokens free, in that order (first-fit decreasing)
  offset_n  the row's fill before user n;   rank_n  user n's place in the order

Per token (G, R, T): user (its user, 0 at padding), slot (its slot, 0 at padding),
seg (rank of its user, N at padding: increasing along a row, as the chunked attention
wants), valid. Per user slot (G, N, c + L): tok, the flat token index in its group's
R * T tokens (R * T, out of range, past S_n), which `unpack` gathers.

Worked example, one group, c = 1, lengths (3, 0, 1), T = 4, R = 2: S = (4, 1, 2), order
(0, 2, 1); user 0 fills row 0, user 2 takes row 1 tokens [0, 2), user 1 (only its CLS)
token 2; row 1 token 3 is padding:
  user = [[0, 0, 0, 0], [2, 2, 1, 0]]   slot = [[0, 1, 2, 3], [0, 1, 0, 0]]
  seg  = [[0, 0, 0, 0], [1, 1, 2, 3]]   valid = [[T, T, T, T], [T, T, T, F]]
If a group's histories do not fit in R rows, `fits` is False: users left over have no
row (their `tok` are all out of range), so the caller must not use the result (GEM
returns NaN logits then).

Cost per step: a `lax.scan` of N steps over an (R,) vector per group, and index
scatters of the padded size G N (c + L) (int32): small next to the sequence arch.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Packing(NamedTuple):
  """The plan of G groups of N users in R rows of T tokens (module docstring)."""
  user: jax.Array   # (G, R, T) int32
  slot: jax.Array   # (G, R, T) int32
  seg: jax.Array    # (G, R, T) int32
  valid: jax.Array  # (G, R, T) bool
  tok: jax.Array    # (G, N, c + L) int32
  lengths: jax.Array  # (G, N) int32 events per user
  fits: jax.Array   # () bool: every group fits

  @property
  def rows(self) -> int:
    return self.user.shape[0] * self.user.shape[1]  # G R


def _first_fit(need: jax.Array, rows: int, capacity: int):
  """need (N,) tokens per user -> row (N,) (-1: none needed), offset (N,), rank (N,), fits."""
  order = jnp.argsort(-need, stable=True)  # (N,)

  def place(free, n):  # free (R,) tokens left per row
    room = free >= n
    r = jnp.argmax(room)
    ok = room[r] & (n > 0)
    off = capacity - free[r]
    return free.at[r].add(jnp.where(ok, -n, 0)), (jnp.where(ok, r, -1), off, ok | (n == 0))

  free0 = jnp.full((rows,), capacity, jnp.int32)
  _, (row_s, off_s, fit_s) = jax.lax.scan(place, free0, need[order])
  inv = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
  return row_s[inv], off_s[inv], inv.astype(jnp.int32), jnp.all(fit_s)


def _plan_one(lengths: jax.Array, num_cls: int, width: int, rows: int, capacity: int):
  """One group: lengths (N,) -> the Packing fields (without the group axis)."""
  n_users = lengths.shape[0]
  need = (lengths + num_cls).astype(jnp.int32)  # (N,)
  row, off, rank, fits = _first_fit(need, rows, capacity)
  s = jnp.arange(num_cls + width, dtype=jnp.int32)[None, :]  # (1, S)
  here = (s < need[:, None]) & (row[:, None] >= 0)  # (N, S)
  total = rows * capacity
  tok = jnp.where(here, row[:, None] * capacity + off[:, None] + s, total)  # (N, S)
  users = jnp.broadcast_to(jnp.arange(n_users, dtype=jnp.int32)[:, None], tok.shape)
  flat = tok.reshape(-1)

  def scatter(fill, values):
    return jnp.full((total,), fill, values.dtype).at[flat].set(values.reshape(-1), mode="drop")

  user = scatter(0, users)
  slot = scatter(0, jnp.broadcast_to(s, tok.shape))
  seg = scatter(n_users, jnp.broadcast_to(rank[:, None], tok.shape))
  valid = scatter(False, here)
  shape = (rows, capacity)
  return (user.reshape(shape), slot.reshape(shape), seg.reshape(shape), valid.reshape(shape),
          tok, fits)


def plan(lengths: jax.Array, *, groups: int, num_cls: int, width: int, rows: int,
         capacity: int) -> Packing:
  """lengths (B,) events per user (each <= width) -> the Packing of `groups` groups."""
  B = lengths.shape[0]
  if B % groups:
    raise ValueError(f"batch {B} is not divisible into {groups} packing groups")
  if num_cls + width > capacity:
    raise ValueError(f"packed rows of {capacity} tokens cannot hold a history of "
                     f"{num_cls} CLS slots + {width} events")
  lengths = lengths.reshape(groups, B // groups).astype(jnp.int32)  # (G, N)
  user, slot, seg, valid, tok, fits = jax.vmap(
      lambda l: _plan_one(l, num_cls, width, rows, capacity))(lengths)
  return Packing(user, slot, seg, valid, tok, lengths, jnp.all(fits))


def _grouped(x: jax.Array, groups: int) -> jax.Array:
  return x.reshape((groups, x.shape[0] // groups) + x.shape[1:])


def per_token(p: Packing, x: jax.Array) -> jax.Array:
  """Per-user values x (B, ...) -> each token's user's value (G R, T, ...)."""
  G, R, T = p.user.shape
  xg = _grouped(x, G)  # (G, N, ...)
  out = jax.vmap(lambda a, u: jnp.take(a, u, axis=0))(xg, p.user)  # (G, R, T, ...)
  return out.reshape((G * R, T) + x.shape[1:])


def pack_events(p: Packing, x: jax.Array, num_cls: int) -> jax.Array:
  """Padded events x (B, L, ...) -> packed tokens (G R, T, ...); 0 at CLS slots and padding."""
  G, R, T = p.user.shape
  L = x.shape[1]
  xg = _grouped(x, G)
  xg = xg.reshape((G, xg.shape[1] * L) + x.shape[2:])  # (G, N L, ...)
  event = p.valid & (p.slot >= num_cls)  # (G, R, T)
  src = p.user * L + jnp.clip(p.slot - num_cls, 0, L - 1)  # (G, R, T)
  out = jax.vmap(lambda a, i: jnp.take(a, i, axis=0))(xg, src)  # (G, R, T, ...)
  m = event.reshape(event.shape + (1,) * (x.ndim - 2))
  out = jnp.where(m, out, jnp.zeros((), x.dtype))
  return out.reshape((G * R, T) + x.shape[2:])


def unpack(p: Packing, y: jax.Array, start: int, stop: int) -> jax.Array:
  """Packed y (G R, T, ...) -> each user's slots [start, stop) (B, stop - start, ...).

  Slots a user does not have (past c + len) come back 0.
  """
  G, R, T = p.user.shape
  yg = y.reshape((G, R * T) + y.shape[2:])
  idx = p.tok[:, :, start:stop]  # (G, N, k)
  out = jax.vmap(lambda a, i: jnp.take(a, i, axis=0, mode="fill", fill_value=0))(yg, idx)
  return out.reshape((-1, stop - start) + y.shape[2:])  # (B, k, ...)
