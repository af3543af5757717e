"""`apply_sparse_updates`: row gradients -> deduplicated in-place optimizer steps.

Replica consistency. Each replica group computed row gradients for its own part
of the batch, on the owners of the rows. Every holder of a buffer block must
apply the same update, bit for bit, without moving the table. Two ways, chosen
per buffer by the planner (`Buffer.sync`, the one that sends fewer bytes):

'rows' (bounded by the batch): each owner all-gathers the (row, gradient) pairs
of the same block from the other replicas (`all_gather` over 'replica': R x the
per-device row count), then every replica deduplicates and applies exactly the
same computation to exactly the same inputs. An all-reduce is not guaranteed to
give bitwise identical sums on every participant; a gather followed by the same
local sum is.
  Worked example (R = 2, S = 1, one table): replica 0 looked up rows [4, 7],
  replica 1 rows [7, .]; after the gather both hold rows [4, 7, 7, .] with their
  gradients, dedup gives [4, 7] with g7 = g7' + g7'', and both apply it.

'dense' (bounded by the table shard; for small shards and many replicas, where
R x the looked-up rows exceeds the shard): each device scatter-adds its row
gradients and a touch count into a (N, D + 1) buffer of its local rows, the
buffer is reduce-scattered over the replica group (replica r sums rows
[r N/R, (r+1) N/R)) and all-gathered back, so each sum is computed once and
copied, again bit-identical everywhere; the rows with a non-zero count are
updated. Bytes sent: 2 (R - 1) / R x N (D + 1) x 4, flat in R.
  Worked example (R = 2, N = 4 local rows): replica 0 looked up row 1, replica 1
  rows [1, 3]; each scatters into its (4, D + 1) buffer; the reduce-scatter has
  replica 0 sum rows 0-1 (row 1: g1 + g1', count 2) and replica 1 rows 2-3
  (row 3: g3', count 1); after the all-gather both hold the same 4 rows and
  update rows 1 and 3.

Replicated tables sync over ('replica', 'shard') the same way.

Column-wise tables keep one row-wise Adagrad accumulator per row (FBGEMM
semantics over the full width D): each shard sums g^2 over its columns, the
partial sums are all-gathered over 'shard' and added in shard order, so every
shard holds the same accumulator (stored replicated).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from gem_jax.embedding import ragged
from gem_jax.embedding.exchange import DEV, NO_ROW, rw_routes
from gem_jax.embedding.optimizers import apply_rows, dedup_rows
from gem_jax.embedding.plan import EmbeddingPlan


def _accumulate(rows, g, num_rows: int):
  """(n,) rows (-1 = none), (n, D) grads -> (num_rows, D + 1): per-row gradient sums and, in
  the last column, how many slots touched the row. One scatter-add, no sort."""
  safe = jnp.where(rows >= 0, rows, num_rows)
  acc = jnp.zeros((num_rows, g.shape[1] + 1), jnp.float32)
  return acc.at[safe].add(jnp.concatenate([g, jnp.ones_like(g[:, :1])], axis=1), mode="drop")


def _touched_rows(acc, num_rows: int):
  """Accumulated (>= num_rows, D + 1) -> (rows (num_rows,), -1 where untouched; grads)."""
  touched = acc[:num_rows, -1] > 0
  uniq = jnp.where(touched, jnp.arange(num_rows, dtype=jnp.int32), -1)
  return uniq, jnp.where(touched[:, None], acc[:num_rows, :-1], 0.0)


def _sync(plan: EmbeddingPlan, buf, rows, g, unique: bool, additive: bool, index=None):
  """Local (rows, grads) -> (rows, grads) of the whole replica group, duplicates summed.

  unique: the local rows are already distinct (one unit: `gather_rows` deduplicated; a
    row-wise unit on one shard: the owner's rows are its own distinct requests).
  additive: the optimizer step is a scatter-add of -lr g (SGD on fp32 rows), which
    sums duplicate rows by itself: no deduplication (and no sort) is needed.
  index: each row's distinct index at this owner (a managed table's by-owner route,
    `_sum_by_index`): duplicates are summed by it, without a sort.
  Otherwise duplicates are summed by a sort (`dedup_rows`). (Accumulating into a
  table-sized buffer instead, for buffers with fewer rows than slots, measured no faster
  on the `small` GEM: 157-168 vs 158-162 ms per step.)
  """
  axes = buf.sync_axes
  if buf.sync == "dense":                # planned only for groups of G > 1
    G = plan.sync_group(buf)
    n_pad = -(-buf.local_rows // G) * G
    acc = _accumulate(rows, g, n_pad)                                  # (N_pad, Dl + 1)
    acc = jax.lax.psum_scatter(acc, axes, scatter_dimension=0, tiled=True)  # (N_pad/G, .)
    acc = jax.lax.all_gather(acc, axes, axis=0, tiled=True)           # (N_pad, Dl + 1)
    return _touched_rows(acc, buf.local_rows)
  if buf.sync == "rows":
    rows = jax.lax.all_gather(rows, axes, axis=0, tiled=True)         # (G n,) same everywhere
    g = jax.lax.all_gather(g, axes, axis=0, tiled=True)               # (G n, Dl)
    if index is not None:
      index = jax.lax.all_gather(index, axes, axis=0, tiled=True)     # (G n,)
    unique = False
  if unique or additive:
    return rows, g
  return dedup_rows(rows, g) if index is None else _sum_by_index(rows, g, index)


def _sum_by_index(rows, g, index):
  """`dedup_rows` for rows that come with their distinct index at this owner (int32 (n,)
  each, -1 = none; grads (n, D)): one scatter-add by the index instead of two sorts and a
  search; the same sums, in the same order. Where some row lacks an index in [0, n) (a
  step the managed resolve redid by broadcast: every device's index is -1 then) it falls
  back to `dedup_rows`. Output: (rows (n,) in index order, -1 where none; sums (n, D)).
    Example: rows [7, 3, 7, -1], index [1, 0, 1, -1] -> [3, 7, -1, -1], [g1, g0 + g2, 0, 0]."""
  n = rows.shape[0]

  def by_index(rows, g, index):
    seg = jnp.where(rows >= 0, index, n)                                # n: dropped
    summed = jax.ops.segment_sum(g.astype(jnp.float32), seg, num_segments=n)   # (n, D)
    return jnp.full((n,), -1, jnp.int32).at[seg].set(rows, mode="drop"), summed

  indexed = jnp.all((rows < 0) | ((index >= 0) & (index < n)))
  return jax.lax.cond(indexed, by_index, lambda r, g, _: dedup_rows(r, g), rows, g, index)


def _rw_a2a(uniq, g, rps: int, num_shards: int, capacity: int, index=None):
  """Requester (distinct global rows (n,), -1 = none; grads (n, D)[; owner index (n,)]) ->
  the owners' (local rows (S C,), grads (S C, D), owner index (S C,) or None) along the
  routes of the lookup (`exchange.rw_routes`)."""
  uniq = jnp.where(uniq >= 0, uniq, NO_ROW)
  _, _, slot, valid = rw_routes(uniq, rps, num_shards, capacity)
  base = (jnp.arange(num_shards, dtype=jnp.int32) * rps)[:, None]
  send_r = jnp.where(valid, jnp.take(uniq, slot) - base, -1)             # (S, C)
  if index is not None:   # with the rows, one all_to_all of (S, C, 2)
    send_r = jnp.stack([send_r, jnp.where(valid, jnp.take(index, slot), -1)], -1)
  send_g = jnp.where(valid[..., None], jnp.take(g, slot, axis=0), 0.0)   # (S, C, D)
  rows = jax.lax.all_to_all(send_r, "shard", 0, 0, tiled=True)
  grads = jax.lax.all_to_all(send_g, "shard", 0, 0, tiled=True).reshape(-1, g.shape[-1])
  if index is None:
    return rows.reshape(-1), grads, None
  return rows[..., 0].reshape(-1), grads, rows[..., 1].reshape(-1)


def _rw_ragged(uniq, g, rps: int, num_shards: int, recv_capacity: int, native: bool,
               index=None):
  """The same pairs by `ragged_all_to_all` (module `ragged`): each owner receives its runs
  into (M,) local rows (-1 past them), (M, D) grads and, given, (M,) owner index."""
  uniq = jnp.where(uniq >= 0, uniq, NO_ROW)
  start, count, _, _ = rw_routes(uniq, rps, num_shards, 1)
  r = ragged.routes(start, count)
  local = jnp.where(uniq != NO_ROW, uniq - jnp.minimum(uniq // rps, num_shards - 1) * rps, -1)
  if index is not None:
    local = jnp.stack([local, index], -1)                                  # (n, 2)
  rows = ragged.to_owners(r, local, -1, recv_capacity, native)             # (M[, 2])
  grads = ragged.to_owners(r, g, 0.0, recv_capacity, native)               # (M, D)
  return (rows, grads, None) if index is None else (rows[:, 0], grads, rows[:, 1])


def _rw_broadcast(uniq, g, rps: int):
  """The same pairs by all-gather over 'shard', each owner keeping its rows (any skew)."""
  rows = jax.lax.all_gather(uniq, "shard", axis=0, tiled=True)           # (S n,)
  grads = jax.lax.all_gather(g, "shard", axis=0, tiled=True)             # (S n, D)
  local = rows - jax.lax.axis_index("shard") * rps
  own = (rows >= 0) & (local >= 0) & (local < rps)
  return jnp.where(own, local, -1), grads, None


def _drop_frozen(uniq, buf, ranges):
  """Local rows (-1 = none) -> the same with rows in frozen global ranges set to -1.

  Global row of local row r: shard * local_rows + r where rows are split over
  'shard' (table-wise, row-wise), r elsewhere (column-wise, replicated).
  """
  base = (jax.lax.axis_index("shard") * buf.local_rows
          if buf.kind in ("table_wise", "row_wise") else 0)
  glob = uniq + base                                                  # (n,)
  hit = jnp.zeros(uniq.shape, bool)
  for a, b in ranges:
    hit = hit | ((glob >= a) & (glob < b))
  return jnp.where(hit, -1, uniq)


def apply_sparse_updates(plan: EmbeddingPlan, state, ctx, row_grads, lr=None, enabled=None,
                         frozen=None):
  """Applies d loss / d rows to the owning shards, in place.

  Args:
    plan: the embedding plan.
    state: the embedding state (donate it to the enclosing jit for in-place updates).
    ctx: the `ctx` returned by `gather_rows` for these rows.
    row_grads: {unit: gradient}, the same structure as `rows`.
    lr: learning rate overriding `plan.optimizer.lr` (may be traced, for schedules); a
      table with its own optimizer gets lr x (its lr / `plan.optimizer.lr`).
    enabled: optional bool scalar (traced): False skips the update (e.g. a
      non-finite loss) without a table-sized select.
    frozen: optional {buffer: ((start, stop), ...)} global buffer rows that keep
      their weights and per-row slots bit for bit (their updates are dropped, no
      table-sized select); a buffer frozen whole is returned as is, scalar slots
      (Adam's step) included.
  Returns:
    The updated state (same structure and shardings).
  """
  base = plan.optimizer
  lr = jnp.asarray(base.lr if lr is None else lr, jnp.float32)
  specs = plan.state_specs()
  frozen = {k: tuple(v) for k, v in (frozen or {}).items() if v}
  for name in frozen:
    if name not in plan.buffers:
      raise KeyError(f"frozen rows for unknown buffer {name!r}; buffers: {sorted(plan.buffers)}")

  def update(name, buf, units, st, rows, g, unique, lr, enabled, index=None):
    """One buffer's (rows, grads[, owner index]) on its owners -> its new state. A buffer
    with its own optimizer steps at lr x (its lr / the plan's): the schedule is shared."""
    opt = buf.optimizer
    if opt.lr != base.lr:
      lr = lr * (opt.lr / base.lr)
    ranges = frozen.get(name, ())
    additive = opt.kind == "sgd" and st["weight"].dtype == jnp.float32
    uniq, gsum = _sync(plan, buf, rows, g, unique=unique, additive=additive, index=index)
    if ranges:
      uniq = _drop_frozen(uniq, buf, ranges)
    g2 = jnp.sum(gsum * gsum, axis=1)                                 # (n,)
    if buf.kind == "column_wise" and plan.num_shards > 1:
      g2 = jnp.sum(jax.lax.all_gather(g2, "shard", axis=0), axis=0)    # full-width sum
    return apply_rows(opt, st, uniq, gsum, g2 / buf.dim, lr, enabled)

  def body(state, row_idx, grads, over, owner_index, lr, enabled):
    new = {}
    for name, buf in plan.buffers.items():
      units = [u for u in plan.units.values() if u.buffer == name]
      ranges = frozen.get(name, ())
      if not units or any(a <= 0 and b >= buf.rows for a, b in ranges):
        new[name] = state[name]
        continue
      width = buf.local_dim
      if buf.kind == "row_wise":   # requester-side gradients of distinct rows -> owners
        ragged_ex = plan.rw_exchange == "ragged"
        # A managed table's rows come with their owner's distinct index (`ctx`): the
        # owner sums their gradients by it instead of sorting them.
        indexed = buf.sync != "dense" and all(u.name in owner_index for u in units)
        pairs = [(row_idx[u.name][0, 0], grads[u.name][0, 0].astype(jnp.float32),
                  plan.recv_capacity(u) if ragged_ex else plan.capacity(u),
                  owner_index[u.name][0, 0] if indexed else None)
                 for u in units]
        native = ragged.is_native(plan.mesh)
        by_owner = ((lambda q, g, rps, c, i: _rw_ragged(q, g, rps, plan.num_shards, c, native,
                                                         i))
                    if ragged_ex else
                    (lambda q, g, rps, c, i: _rw_a2a(q, g, rps, plan.num_shards, c, i)))
        # One shard: the owner's rows are its own requests, distinct within a unit, so
        # with one unit (feature) on the buffer there are no duplicates to sum.
        unique = plan.num_shards == 1 and len(units) == 1

        def routed(route, st, lr, enabled, buf=buf, name=name, units=units, pairs=pairs,
                   unique=unique):
          rows, g, index = zip(*(route(q, gq, buf.local_rows, c, i) for q, gq, c, i in pairs))
          index = None if index[0] is None else jnp.concatenate(index)
          return update(name, buf, units, st, jnp.concatenate(rows), jnp.concatenate(g),
                        unique, lr, enabled, index)
        by_broadcast = lambda q, g, rps, c, i: _rw_broadcast(q, g, rps)  # noqa: E731
        if plan.rw_exchange == "broadcast":
          new[name] = routed(by_broadcast, state[name], lr, enabled)
          continue
        # The by-owner route in place, its writes dropped in an overflow step, which the
        # broadcast route redoes in a loop taken once or never: a `lax.cond` over the two
        # routes made XLA copy the table shard and its slots every step.
        over_any = jnp.any(jnp.stack([over[u.name][0, 0] for u in units]))
        st = routed(by_owner, state[name], lr, enabled & ~over_any)
        _, new[name] = jax.lax.while_loop(
            lambda c: c[0],
            lambda c, r=routed, b=by_broadcast: (jnp.bool_(False), r(b, c[1], lr, enabled)),
            (over_any, st))
        continue
      rows = jnp.concatenate([row_idx[u.name][0, 0] for u in units])  # (n,) distinct per unit
      g = jnp.concatenate([grads[u.name][0, 0].reshape(-1, width).astype(jnp.float32)
                           for u in units])                                     # (n, Dl)
      new[name] = update(name, buf, units, state[name], rows, g,
                         len(units) == 1 and units[0].dedup, lr, enabled)
    return new

  enabled = jnp.asarray(True if enabled is None else enabled, bool)
  over = ctx.get("overflow", {})
  owner_index = ctx.get("owner_index", {})
  in_specs = (specs, {n: DEV for n in plan.units}, {n: DEV for n in plan.units},
              {n: DEV for n in over}, {n: DEV for n in owner_index}, P(), P())
  # check_vma=False: the outputs are replicated over 'replica' (and, for the
  # column-wise accumulator, over 'shard') by construction: every holder of a
  # block computes on identical gathered inputs (tested bitwise).
  fn = jax.shard_map(body, mesh=plan.mesh, in_specs=in_specs, out_specs=specs, check_vma=False)
  return fn(state, ctx["row"], row_grads, over, owner_index, lr, enabled)
