"""Moving table-wise tables between their canonical split and their owner's block.

A canonical table is split over 'shard' (by rows, by columns, or not at all:
`layout.canonical_spec`); in the state it lives whole in its owner's block of a
packed (S * cap, D) buffer. Letting the SPMD partitioner do this move from a
plain `dynamic_update_slice` gathers the whole table onto every device (S x the
table in temporaries), so both directions are written as explicit `ppermute`s
of 1/S pieces inside `shard_map`.

Example (S = 4, table t of 8 rows owned by shard 2 at offset 5, canonical split
by rows into pieces of 2): piece k (rows 2k, 2k+1, on device k) is sent by
`ppermute` k -> 2 (piece 2 stays) and written at block rows 5 + 2k; export runs
the same sends backwards (2 -> k). Temporaries: one piece per step.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from gem_jax.embedding.plan import Buffer, EmbeddingPlan


def _split_axis(spec: P, ndim: int) -> int | None:
  """Axis of a canonical array split over 'shard' (None: replicated)."""
  for a, s in enumerate(tuple(spec) + (None,) * (ndim - len(spec))):
    if s == "shard":
      return a
  return None


def _send(x, src: int, dst: int):
  """x of device `src` on device `dst` (zeros elsewhere); identity when src == dst."""
  return x if src == dst else jax.lax.ppermute(x, "shard", perm=[(src, dst)])


def _region(ndim, axis, start_row, k, piece_shape):
  """Start index of piece k of a table starting at block row `start_row`."""
  start = [start_row] + [0] * (ndim - 1)
  if axis is not None:
    start[axis] += k * piece_shape[axis]
  return start


def pack(plan: EmbeddingPlan, buf: Buffer, pieces: list, specs: list[P], block_shape, dtype):
  """Canonical tables of `buf` (global arrays, canonical specs) -> (S * cap, ...) buffer."""
  S = plan.num_shards

  def body(*xs):
    me = jax.lax.axis_index("shard")
    blk = jnp.zeros(block_shape, dtype)                    # (cap, D) or (cap,)
    for i, (x, spec) in enumerate(zip(xs, specs)):
      o, off = buf.owners[i], buf.offsets[i]
      axis = _split_axis(spec, x.ndim)
      for k in range(S if axis is not None else 1):
        piece = _send(x.astype(dtype), k, o) if axis is not None else x.astype(dtype)
        start = _region(x.ndim, axis, off, k, x.shape)
        old = jax.lax.dynamic_slice(blk, start, piece.shape)
        blk = jax.lax.dynamic_update_slice(blk, jnp.where(me == o, piece, old), start)
    return blk

  out_spec = P("shard", *([None] * (len(block_shape) - 1)))
  return jax.shard_map(body, mesh=plan.mesh, in_specs=tuple(specs), out_specs=out_spec,
                       check_vma=False)(*pieces)


def unpack(plan: EmbeddingPlan, buf: Buffer, x, shapes: list, specs: list[P]) -> list:
  """(S * cap, ...) buffer -> the canonical tables of `buf`, in their canonical specs."""
  S = plan.num_shards

  def body(blk):
    me = jax.lax.axis_index("shard")
    outs = []
    for i, (shape, spec) in enumerate(zip(shapes, specs)):
      o, off = buf.owners[i], buf.offsets[i]
      axis = _split_axis(spec, len(shape))
      if axis is None:   # replicated canonical: the owner's copy, summed with zeros
        mine = jax.lax.dynamic_slice(blk, [off] + [0] * (blk.ndim - 1), shape)
        outs.append(jax.lax.psum(jnp.where(me == o, mine, jnp.zeros_like(mine)), "shard"))
        continue
      piece_shape = list(shape)
      piece_shape[axis] //= S
      out = jnp.zeros(piece_shape, blk.dtype)
      for k in range(S):
        start = _region(len(shape), axis, off, k, piece_shape)
        val = _send(jax.lax.dynamic_slice(blk, start, piece_shape), o, k)
        out = jnp.where(me == k, val, out)
      outs.append(out)
    return tuple(outs)

  in_spec = P("shard", *([None] * (x.ndim - 1)))
  return list(jax.shard_map(body, mesh=plan.mesh, in_specs=(in_spec,), out_specs=tuple(specs),
                            check_vma=False)(x))
