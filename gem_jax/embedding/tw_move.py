"""Moving table-wise tables between their canonical split and their owner's block.

A canonical table (rows, W) is split over 'shard' for checkpoints; in the state
it lives whole in its owner's block of a packed (S * cap, W) buffer. Letting the
SPMD partitioner do this move from a plain `dynamic_update_slice` (or using one
`ppermute` per piece) allocates the whole table on every device, S x the table
in temporaries. Instead every table is padded to S * c rows (c = ceil(rows / S))
and split by rows, and one `all_to_all` moves all pieces of a buffer at once.

Send layout (`_slots`): slot o of every device's send buffer holds, one after
the other, its pieces of the tables owned by shard o (Q rows, padded).
Example, S = 2, tables a (4 rows, owner 1), b (2 rows, owner 1), d (6 rows,
owner 0): c = 2, 1, 3; slot 0 = [d piece], slot 1 = [a piece, b piece], Q = 3.
Device 0 sends [d0..d2 | a0 a1 b0], device 1 sends [d3..d5 | a2 a3 b1];
after the `all_to_all` shard 1 holds [[a0 a1 b0], [a2 a3 b1]] and assembles
a = a0..a3 at a's block offset, b = b0 b1 at b's. Export runs it backwards.
Per device: one block in the send buffer and one in the receive buffer.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from gem_jax.embedding import layout
from gem_jax.embedding.plan import Buffer, EmbeddingPlan

ROWS = P("shard", None)


def _slots(plan: EmbeddingPlan, buf: Buffer):
  """Piece rows c_t, position of each table in its owner's slot, slot length Q."""
  S = plan.num_shards
  c = [layout.rows_per_shard(plan.tables[t].rows, S) for t in buf.tables]
  fill, pos = [0] * S, []
  for o, ct in zip(buf.owners, c):
    pos.append(fill[o])
    fill[o] += ct
  return c, pos, max(max(fill), 1)


def pack(plan: EmbeddingPlan, buf: Buffer, arrays: list, block_shape, dtype):
  """Canonical tables of `buf` (any split) -> its (S * cap, ...) buffer, split by rows."""
  S, mesh = plan.num_shards, plan.mesh
  c, pos, Q = _slots(plan, buf)
  one_d = len(block_shape) == 1
  xs = []
  for x, ct in zip(arrays, c):
    x = x.astype(dtype)
    x = x[:, None] if one_d else x
    x = jnp.pad(x, ((0, S * ct - x.shape[0]), (0, 0)))
    xs.append(jax.lax.with_sharding_constraint(x, NamedSharding(mesh, ROWS)))
  width = xs[0].shape[1]

  def assemble(j, recv):
    """Block of shard j from recv (S, Q, W): its tables at their offsets."""
    blk = jnp.zeros((buf.local_rows, width), dtype)
    for i, t in enumerate(buf.tables):
      if buf.owners[i] != j:
        continue
      table = recv[:, pos[i]:pos[i] + c[i]].reshape(S * c[i], width)[:plan.tables[t].rows]
      blk = jax.lax.dynamic_update_slice(blk, table, (buf.offsets[i], 0))
    return blk

  def body(*pieces):                                           # each (c_t, W)
    slots = []
    for o in range(S):
      mine = [p for p, own in zip(pieces, buf.owners) if own == o]
      n = sum(p.shape[0] for p in mine)
      slots.append(jnp.concatenate(mine + [jnp.zeros((Q - n, width), dtype)]))
    recv = jax.lax.all_to_all(jnp.stack(slots), "shard", 0, 0, tiled=True)   # (S, Q, W)
    blk = jax.lax.switch(jax.lax.axis_index("shard"),
                         [lambda r, j=j: assemble(j, r) for j in range(S)], recv)
    return blk[:, 0] if one_d else blk

  out_spec = P("shard") if one_d else ROWS
  return jax.shard_map(body, mesh=mesh, in_specs=(ROWS,) * len(xs), out_specs=out_spec,
                       check_vma=False)(*xs)


def unpack(plan: EmbeddingPlan, buf: Buffer, x, specs: list[P]) -> list:
  """(S * cap, ...) buffer -> the canonical (rows, ...) tables of `buf`, in `specs`."""
  S, mesh = plan.num_shards, plan.mesh
  c, pos, Q = _slots(plan, buf)
  one_d = x.ndim == 1
  width = 1 if one_d else x.shape[1]

  def scatter(j, blk):
    """Send buffer (S, Q, W) of shard j: piece k of each of its tables in slot k."""
    blk = jnp.pad(blk, ((0, S * max(c)), (0, 0)))
    send = jnp.zeros((S, Q, width), blk.dtype)
    for i in range(len(buf.tables)):
      if buf.owners[i] != j:
        continue
      table = blk[buf.offsets[i]:buf.offsets[i] + S * c[i]].reshape(S, c[i], width)
      send = send.at[:, pos[i]:pos[i] + c[i]].set(table)
    return send

  def body(blk):
    blk = blk[:, None] if one_d else blk
    send = jax.lax.switch(jax.lax.axis_index("shard"),
                          [lambda b, j=j: scatter(j, b) for j in range(S)], blk)
    recv = jax.lax.all_to_all(send, "shard", 0, 0, tiled=True)  # [o] = pieces from owner o
    return tuple(recv[o, p:p + ct] for o, p, ct in zip(buf.owners, pos, c))

  in_spec = P("shard") if one_d else ROWS
  padded = jax.shard_map(body, mesh=mesh, in_specs=(in_spec,),
                         out_specs=(ROWS,) * len(buf.tables), check_vma=False)(x)
  out = []
  for t, y, spec in zip(buf.tables, padded, specs):
    y = y[:plan.tables[t].rows]
    y = y[:, 0] if one_d else y
    out.append(jax.lax.with_sharding_constraint(y, NamedSharding(mesh, spec)))
  return out
