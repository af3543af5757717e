"""Sharded lookups: ids -> owners -> dedup + local gather (`gather_rows`) -> pool -> back (`pool_rows`).

Everything runs inside one `jax.shard_map` over the mesh ('replica', 'shard'):
the batch is split over both axes (b = B / (R S) examples per device), tables
over 'shard' and replicated over 'replica', so every exchange below happens
inside one replica group, along 'shard'. `rows` (what the owners gathered) is
the differentiable leaf: d loss / d rows lands on the owner of each row, where
`apply_sparse_updates` consumes it; no table-sized gradient exists anywhere.

Exchange per sharding type (S = 3 shards, b = 2 examples per device, bag 2;
device s holds examples e(s,0), e(s,1); '.' = padding id -1):

table_wise (`_tw_*`). Features are laid out in send slots per owner
(`layout.slot_table`): f and g on shard 0, h on shard 2 gives slots
[[f, g], [., .], [h, .]], P = 2. Each device sends slot row j to shard j:
  device 1 sends  to 0: [ids_f(e10,e11), ids_g(...)]   to 1: [., .]   to 2: [ids_h(...), .]
  `all_to_all` (split 0, concat 0): shard 0 receives, per source s = 0, 1, 2,
  the f and g ids of e(s, .), i.e. a (S, P, b, bag) block, already turned into
  rows of its packed block (id + table offset) by the sender;
  shard 0 gathers (S, P, b, bag, D), pools over bag -> (S, P, b, D) and a
  second `all_to_all` returns slot (j, p) to its requester: device 1 gets
  [[f(e10,e11), g(...)], [pad], [h(...), pad]] and unpacks its features.
  Padding slots cost traffic only when shards own unequal feature counts.

row_wise (`_rw_*`): ids sent to their owners by `all_to_all`, rows sent back.
Rows [0, 4) of a 10-row table are on shard 0, [4, 8) on 1, [8, 10) on 2
(rps = 4); capacity C = 2 ids per (source, owner). Device 1 holds bags
e10 = [5, 9], e11 = [0, 5]:
  distinct sorted rows [0, 5, 9] (inverse e10 -> [1, 2], e11 -> [0, 1]); they
  group by owner since owner = row // rps: shard 0 gets [0], 1 gets [5], 2 [9];
  send buffer (S, C) of owner-local rows [[0, .], [1, .], [1, .]];
  `all_to_all` (split 0, concat 0): shard s receives (S, C), the rows every
  source asks of it, gathers (S, C, D) and a second `all_to_all` returns them:
  device 1 holds w0, w5, w9 and pools its bags itself (e10 = w5 + w9,
  e11 = w0 + w5). Per device: S C ids and S C rows each way, C ~ n / S: flat
  in S. The gathered rows (n, D) of the device's distinct ids are the
  differentiable leaf; `apply_sparse_updates` sends their gradients to the
  owners along the same routes. Exact for any skew: when one (source, owner)
  pair has more than C distinct ids anywhere in the mesh (`overflow`, the same
  decision on every device), the step takes the broadcast path instead: ids
  all-gathered over 'shard', every owner gathers the rows it owns (zeros
  elsewhere) and a `psum_scatter` hands each device its rows, the same values.
  `rw_exchange='ragged'` (the default on GPU/TPU) sends each owner's run as it is
  with `ragged_all_to_all` instead of C-wide blocks: n ids on the wire and a receive
  buffer of M ~ n + 4 sqrt(n) slots per owner (worked example in `ragged`); it
  overflows only when an owner's total from its group exceeds M.

column_wise (`_cw_*`): every shard holds columns [j cps, (j+1) cps) of all
rows. Ids are all-gathered (each shard needs all of them), each shard gathers
and pools its column block for all S b bags, and an `all_to_all` (split over
the source batch blocks) gives device s the S column blocks of its own b
examples, concatenated back to width D.

replicated (`_rep_*`): local gather and pool, no exchange.
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from gem_jax.embedding import managed, ragged
from gem_jax import vma
from gem_jax.embedding.optimizers import distinct_rows
from gem_jax.embedding.plan import BATCH, EmbeddingPlan, Unit
from gem_jax.embedding.layout import NO_ROW

DEV = P("replica", "shard")   # spec of per-device leaves (rows, ctx): (R, S, ...)


def _masked_take(w, rows):
  """w[rows] with zero rows where rows < 0.  rows (...,) int32, w (N, D) -> (..., D)."""
  valid = rows >= 0
  out = jnp.take(w, jnp.where(valid, rows, 0), axis=0)
  return jnp.where(valid[..., None], out, jnp.zeros((), w.dtype))


def _pad_bag(x, bag, fill):
  """(b, n) -> (b, bag), padded on the right with `fill`."""
  return jnp.pad(x, ((0, 0), (0, bag - x.shape[1])), constant_values=fill)


def _bag_weights(plan: EmbeddingPlan, f: str, ids, weights):
  """Per-id pooling weights (b, bag) of feature f: given weights or 1, 0 at padding."""
  w = weights.get(f) if weights else None
  w = jnp.ones(ids.shape, jnp.float32) if w is None else w.astype(jnp.float32)
  return jnp.where(ids >= 0, w, 0.0)


# ---- table_wise --------------------------------------------------------------------
def _tw_send(plan, u: Unit, per_feature, fill, dtype):
  """Stacks per-feature (b, bag_f) arrays into the (S, P, b, bag) send buffer."""
  b = plan.local_batch
  blocks = []
  for slot_row in u.slots:
    row = []
    for i in slot_row:
      if i < 0:
        row.append(jnp.full((b, u.bag), fill, dtype))
      else:
        row.append(_pad_bag(per_feature[u.features[i]].astype(dtype), u.bag, fill))
    blocks.append(jnp.stack(row))
  return jnp.stack(blocks)   # (S, P, b, bag)


def _tw_rows(plan, u: Unit, ids):
  buf = plan.buffers[u.buffer]
  local_rows = {}
  for f in u.features:
    i = buf.tables.index(plan.features[f].table)
    local_rows[f] = jnp.where(ids[f] >= 0, ids[f] + buf.offsets[i], -1)
  send = _tw_send(plan, u, local_rows, -1, jnp.int32)        # (S, P, b, bag)
  return jax.lax.all_to_all(send, "shard", 0, 0, tiled=True)  # (S, P, b, bag) from each source


def _tw_pool(plan, u: Unit, rows, row_idx, weights):
  if weights and any(f in weights for f in u.features):
    wl = {f: weights.get(f, jnp.ones((plan.local_batch, plan.features[f].bag), jnp.float32))
          for f in u.features}
    wr = jax.lax.all_to_all(_tw_send(plan, u, wl, 0.0, jnp.float32), "shard", 0, 0, tiled=True)
  else:
    wr = jnp.ones(row_idx.shape, jnp.float32)
  wr = jnp.where(row_idx >= 0, wr, 0.0).astype(rows.dtype)    # (S, P, b, bag)
  if u.pooled:
    out = jnp.einsum("spbl,spbld->spbd", wr, rows)           # (S, P, b, D)
  else:
    out = rows * wr[..., None]                                # (S, P, b, L, D)
  back = jax.lax.all_to_all(out, "shard", 0, 0, tiled=True)  # slot (j, p) of my examples
  # One split instead of S*P indexing ops: the backward of per-slot `back[j, p]`
  # builds S*P zero-padded copies of `back` and adds them; the backward of a
  # split is a single concatenate (measured: -20% CPU time per dlrm_peer step).
  n_slots = back.shape[0] * back.shape[1]
  pieces = jnp.split(back.reshape((n_slots,) + back.shape[2:]), n_slots)  # S*P x (1, b, ...)
  res = {}
  for j, slot_row in enumerate(u.slots):
    for p, i in enumerate(slot_row):
      if i >= 0:
        f = u.features[i]
        piece = pieces[j * back.shape[1] + p][0]              # (b, D) or (b, L, D)
        res[f] = piece if u.pooled else piece[:, :plan.features[f].bag]
  return res


# ---- row_wise ----------------------------------------------------------------------


def rw_distinct(ids):
  """(b, bag) rows, -1 = padding -> (distinct rows ascending (n,), NO_ROW padded; inverse)."""
  flat = jnp.where(ids >= 0, ids, NO_ROW).reshape(-1).astype(jnp.int32)
  uniq, inv = distinct_rows(flat, NO_ROW)
  return uniq, inv.reshape(ids.shape)


def rw_routes(uniq, rps: int, num_shards: int, capacity: int):
  """Where each distinct row goes: (start (S,), count (S,) of each owner's run in `uniq`,
  send slots (S, C) into uniq (clamped), their validity (S, C))."""
  n = uniq.shape[0]
  edges = jnp.searchsorted(uniq, jnp.arange(num_shards + 1, dtype=jnp.int32) * rps)  # (S+1,)
  start, count = edges[:-1].astype(jnp.int32), jnp.diff(edges).astype(jnp.int32)
  j = jnp.arange(capacity, dtype=jnp.int32)
  slot = jnp.minimum(start[:, None] + j[None, :], n - 1)                            # (S, C)
  return start, count, slot, j[None, :] < count[:, None]


def _rw_fetch_a2a(w, uniq, rps: int, S: int, C: int):
  """Rows of `uniq` from their owners, `all_to_all` both ways (no overflow anywhere)."""
  start, _, slot, valid = rw_routes(uniq, rps, S, C)
  base = (jnp.arange(S, dtype=jnp.int32) * rps)[:, None]
  send = jnp.where(valid, jnp.take(uniq, slot) - base, -1)                 # (S, C) owner rows
  recv = jax.lax.all_to_all(send, "shard", 0, 0, tiled=True)               # (S, C) asked of me
  back = jax.lax.all_to_all(_masked_take(w, recv), "shard", 0, 0, tiled=True)  # (S, C, D)
  owner = jnp.minimum(uniq // rps, S - 1)
  pos = owner * C + jnp.arange(uniq.shape[0], dtype=jnp.int32) - start[owner]   # (n,)
  ok = uniq != NO_ROW
  rows = jnp.take(back.reshape(S * C, -1), jnp.where(ok, pos, 0), axis=0)
  return jnp.where(ok[:, None], rows, jnp.zeros((), w.dtype))             # (n, D)


def _rw_fetch_ragged(w, uniq, rps: int, S: int, M: int, native: bool):
  """The same rows by `ragged_all_to_all` both ways (module `ragged`): only real ids and
  rows travel; each owner receives at most M ids (no overflow anywhere)."""
  start, count, _, _ = rw_routes(uniq, rps, S, 1)
  r = ragged.routes(start, count)
  local = jnp.where(uniq != NO_ROW, uniq - jnp.minimum(uniq // rps, S - 1) * rps, -1)  # (n,)
  asked = ragged.to_owners(r, local, -1, M, native)                        # (M,) rows asked of me
  return ragged.to_requesters(r, _masked_take(w, asked), uniq.shape[0], native)  # (n, D)


def _rw_fetch_broadcast(w, uniq, rps: int):
  """The same rows by all-gather + owner gather + `psum_scatter` (exact for any skew)."""
  g = jax.lax.all_gather(uniq, "shard", axis=0, tiled=True)               # (S n,)
  local = g - jax.lax.axis_index("shard") * rps
  own = (g != NO_ROW) & (local >= 0) & (local < rps)
  part = _masked_take(w, jnp.where(own, local, -1))                        # (S n, D) zeros elsewhere
  return jax.lax.psum_scatter(part, "shard", scatter_dimension=0, tiled=True)  # (n, D)


def rw_overflow(plan, ids_by_unit):
  """{unit: bool scalar}: does any (source, owner) pair of the mesh exceed the unit's
  capacity? One `pmax` over every device for all row-wise units: the same answer everywhere."""
  names = list(ids_by_unit)
  if not names:
    return {}
  counts = [rw_routes(ids_by_unit[n], plan.buffers[plan.units[n].buffer].local_rows,
                      plan.num_shards, 1)[1] for n in names]                # U x (S,)
  if plan.rw_exchange == "ragged":   # each owner's total from its group, against M
    totals = jax.lax.psum(jnp.stack(counts), "shard")                      # (U, S)
    local = [jnp.any(totals[i] > plan.recv_capacity(plan.units[n])) for i, n in enumerate(names)]
  else:                              # each (source, owner) pair against C
    local = [jnp.any(c > plan.capacity(plan.units[n])) for c, n in zip(counts, names)]
  over = vma.pmax(jnp.stack(local).astype(jnp.int32), ("replica", "shard")) > 0
  if plan.rw_exchange == "broadcast":
    over = jnp.ones_like(over)
  return {name: over[i] for i, name in enumerate(names)}


def _rw_pool(plan, u: Unit, rows, row_idx, weights):
  """Local pooling of the fetched rows (requester side): like replicated tables."""
  return _rep_pool(plan, u, rows, row_idx, weights)


# ---- column_wise -------------------------------------------------------------------
def _cw_rows(plan, u: Unit, ids):
  g = jax.lax.all_gather(ids[u.features[0]], "shard", axis=0, tiled=True)  # (S b, bag)
  return jnp.where(g >= 0, g, -1)


def _cw_pool(plan, u: Unit, rows, row_idx, weights):
  f = u.features[0]
  S, b, D = plan.num_shards, plan.local_batch, plan.buffers[u.buffer].dim
  wts = weights.get(f) if weights else None
  if wts is None:
    wts = jnp.ones(row_idx.shape, jnp.float32)
  else:
    wts = jax.lax.all_gather(wts.astype(jnp.float32), "shard", axis=0, tiled=True)
  wts = jnp.where(row_idx >= 0, wts, 0.0).astype(rows.dtype)
  if u.pooled:
    part = jnp.einsum("nl,nld->nd", wts, rows).reshape(S, b, -1)        # (S, b, cps)
    back = jax.lax.all_to_all(part, "shard", 0, 0, tiled=True)         # [j] = cols j, my b
    return {f: jnp.moveaxis(back, 0, 1).reshape(b, -1)[:, :D]}        # (b, D)
  part = (rows * wts[..., None]).reshape(S, b, u.bag, -1)             # (S, b, L, cps)
  back = jax.lax.all_to_all(part, "shard", 0, 0, tiled=True)
  return {f: jnp.moveaxis(back, 0, 2).reshape(b, u.bag, -1)[..., :D]}  # (b, L, D)


# ---- replicated --------------------------------------------------------------------
def _rep_rows(plan, u: Unit, ids):
  return ids[u.features[0]]                                  # (b, bag)


def _rep_pool(plan, u: Unit, rows, row_idx, weights):
  f = u.features[0]
  wts = _bag_weights(plan, f, row_idx, weights).astype(rows.dtype)
  if u.pooled:
    return {f: jnp.einsum("bl,bld->bd", wts, rows)}
  return {f: rows * wts[..., None]}


_ROWS = {"table_wise": _tw_rows, "column_wise": _cw_rows, "replicated": _rep_rows}
_POOL = {"table_wise": _tw_pool, "row_wise": _rw_pool, "column_wise": _cw_pool,
         "replicated": _rep_pool}


# ---- public ------------------------------------------------------------------------
def _dev(x):
  return x[None, None]


def _undev(x):
  return x[0, 0]


def _unique(idx, dedup: bool = True):
  """Local rows per slot (any shape, -1 = none) -> (rows to gather (n,), inverse (same
  shape as idx): position of each slot's row in them). dedup: sorted distinct rows,
  -1 padded; else the slots themselves, inverse = arange."""
  flat = idx.reshape(-1)
  if not dedup:
    return flat.astype(jnp.int32), jnp.arange(flat.shape[0], dtype=jnp.int32).reshape(idx.shape)
  uniq, inv = distinct_rows(flat.astype(jnp.int32), -1)
  return uniq, inv.reshape(idx.shape)


def gather_rows(plan: EmbeddingPlan, state, ids, distinct=None):
  """ids -> owners -> deduplicated local gather. Call inside or outside jit.

  For units with `dedup` (owners holding large tables, see the planner), each
  owner gathers every distinct row it serves once, in ascending row order
  (Zipf ids: about half the slots are repeats), and the gradient of the lookup
  arrives per distinct row (the backward of `pool_rows`' expansion sums the
  repeats in a small (n, D) buffer). Other units gather one row per slot.

  Args:
    plan: the embedding plan.
    state: the embedding state (only the 'weight' leaves are read).
    ids: {feature: int32 (B, bag)} from `prepare_ids`, -1 = padding, sharded
      like `plan.ids_shardings()`.
    distinct: optional {feature: (uniq, inverse[, owner index])} of row-wise features whose
      distinct rows are known already (`managed.resolve(..., distinct=True)`): used instead
      of `rw_distinct` (uniq need not be ascending, only grouped by owner, NO_ROW last); the
      owner index, where given, goes to `ctx['owner_index']` for the update.
  Returns:
    rows: {unit: (R, S, n, D_local)}, the rows each device gathered (n = the
      unit's id slots per device, zero rows at padding): the differentiable leaf;
    ctx: {'row': {unit: int32 (R, S, n)} those rows' indices in the owner's local
      buffer (-1: none; distinct and ascending with dedup), 'inv': {unit: int32 (R, S, ...slots)} the
      position in `row` of every id slot, 'count': {feature: float32 (B,)}
      valid ids of 'mean' features, 'owner_index': {unit: int32 (R, S, n)} each row's
      distinct index at its owner, for units whose `distinct` gave one}.
  """
  weights_in = {name: state[name]["weight"] for name in plan.buffers}
  w_specs = {name: buf.weight_spec() for name, buf in plan.buffers.items()}
  id_specs = {f: P(BATCH, None) for f in plan.features}
  mean_feats = [f for f, c in plan.features.items() if c.pooling == "mean"]

  rw_units = [n for n, u in plan.units.items() if u.kind == "row_wise"]
  rw_feature = {name: plan.units[name].features[0] for name in rw_units}
  distinct = {f: d for f, d in (distinct or {}).items() if f in rw_feature.values()}
  indexed = [n for n in rw_units if len(distinct.get(rw_feature[n], ())) == 3]  # owner index

  def body(weights, ids, known):
    rows, uniq_rows, inverse = {}, {}, {}
    rw = {name: known[f][:2] if f in known else rw_distinct(ids[f])
          for name, f in rw_feature.items()}
    over = rw_overflow(plan, {name: uniq for name, (uniq, _) in rw.items()})
    for name, u in plan.units.items():
      if u.kind == "row_wise":
        uniq, inv = rw[name]
        w, rps, S, C = (weights[u.buffer], plan.buffers[u.buffer].local_rows, plan.num_shards,
                        plan.capacity(u))
        if plan.rw_exchange == "ragged":
          M, native = plan.recv_capacity(u), ragged.is_native(plan.mesh)
          by_owner = lambda w, q: _rw_fetch_ragged(w, q, rps, S, M, native)  # noqa: E731
        else:
          by_owner = lambda w, q: _rw_fetch_a2a(w, q, rps, S, C)  # noqa: E731
        got = jax.lax.cond(over[name], lambda w, q: _rw_fetch_broadcast(w, q, rps),
                           by_owner, w, uniq)
        rows[name] = _dev(got)                                        # (1, 1, n, D)
        uniq = jnp.where(uniq == NO_ROW, -1, uniq)                    # requester: global rows
      else:
        uniq, inv = _unique(_ROWS[u.kind](plan, u, ids), u.dedup)
        rows[name] = _dev(_masked_take(weights[u.buffer], uniq))     # (1, 1, n, Dl)
      uniq_rows[name], inverse[name] = _dev(uniq), _dev(inv)
    count = {f: jnp.sum(ids[f] >= 0, axis=1).astype(jnp.float32) for f in mean_feats}
    return rows, {"row": uniq_rows, "inv": inverse, "count": count,
                  "overflow": {name: _dev(over[name]) for name in rw_units},
                  "owner_index": {name: _dev(known[rw_feature[name]][2]) for name in indexed}}

  per_unit = {n: DEV for n in plan.units}
  out_specs = (per_unit, {"row": per_unit, "inv": per_unit,
                          "count": {f: P(BATCH) for f in mean_feats},
                          "overflow": {n: DEV for n in rw_units},
                          "owner_index": {n: DEV for n in indexed}})
  known_specs = {f: (P(BATCH), P(BATCH, None), *(P(BATCH),) * (len(d) - 2))
                 for f, d in distinct.items()}
  fn = jax.shard_map(body, mesh=plan.mesh, in_specs=(w_specs, id_specs, known_specs),
                     out_specs=out_specs)
  return fn(weights_in, {f: ids[f] for f in plan.features}, distinct)


def pool_rows(plan: EmbeddingPlan, rows, ctx, weights=None):
  """Pools gathered rows on their owners and sends the results back to the requesters.

  Args:
    rows, ctx: from `gather_rows` (rows may be replaced by anything of the same
      structure, e.g. inside `jax.grad`).
    weights: optional {feature: float (B, bag)} per-id weights (absent: 1).
  Returns:
    {feature: (B, D)} for 'sum'/'mean' features, {feature: (B, L, D)} with zero
    rows at padding for 'none' features; mean = sum_i w_i e_i / n_valid (0 if empty).
  """
  weights = {f: w for f, w in (weights or {}).items() if f in plan.features}
  w_specs = {f: P(BATCH, None) for f in weights}

  def body(rows, uniq, inv, count, weights):
    out = {}
    for name, u in plan.units.items():
      slot_inv = _undev(inv[name])
      if u.dedup or u.kind == "row_wise":   # rows of distinct ids: expand to the slots
        slot_rows = jnp.take(_undev(rows[name]), slot_inv, axis=0)     # (...slots, Dl)
        slot_idx = jnp.take(_undev(uniq[name]), slot_inv, axis=0)      # (...slots)
      else:                                                            # one row per slot
        slot_rows = _undev(rows[name]).reshape(slot_inv.shape + (-1,))
        slot_idx = _undev(uniq[name]).reshape(slot_inv.shape)
      out.update(_POOL[u.kind](plan, u, slot_rows, slot_idx, weights))
    for f, c in count.items():
      out[f] = out[f] / jnp.maximum(c, 1.0)[:, None].astype(out[f].dtype)
    return out

  out_specs = {f: (P(BATCH, None) if c.pooling != "none" else P(BATCH, None, None))
               for f, c in plan.features.items()}
  per_unit = {n: DEV for n in plan.units}
  in_specs = (per_unit, per_unit, per_unit, {f: P(BATCH) for f in ctx["count"]}, w_specs)
  fn = jax.shard_map(body, mesh=plan.mesh, in_specs=in_specs, out_specs=out_specs)
  return fn(rows, ctx["row"], ctx["inv"], ctx["count"], weights)


def lookup(plan: EmbeddingPlan, state, ids, weights=None):
  """`pool_rows(plan, *gather_rows(plan, state, ids), weights)`: {feature: embeddings}.

  Managed tables' raw ids are looked up in their maps first, without inserting
  (`managed.resolve(..., update=False)`: an id not in the map pools as padding)."""
  if plan.managed_tables():
    _, ids, _ = managed.resolve(plan, state, ids, 0, update=False)
  rows, ctx = gather_rows(plan, state, ids)
  return pool_rows(plan, rows, ctx, weights)


def valid_mask(ids):
  """{feature: bool (B, L)}: True at real ids (the validity mask of sequence lookups)."""
  return {f: x >= 0 for f, x in ids.items()}
