"""Managed-collision tables: raw 64-bit ids -> rows of their own, through a map owned with the rows.

A table with `id_policy='managed'` keeps, next to its rows, a map (int32 per row):
`map_hi`, `map_lo` (the raw id whose row it is, two halves; hi = -1: empty),
`map_last` (the step it was last seen) and `map_count` (its lookups), plus `map_used`
(occupied rows). It is row-wise sharded like the table, so each owner holds the map
of its rows, and it is part of the embedding state: donated, checkpointed in the
canonical unpadded form and restored onto any mesh like the slots.

Policy (bounded probe, as TorchRec's MPZCH). The rows form windows of K = `probe`
consecutive rows; raw id x may live only in window w(x) = mix32(x) mod (rows / K), the
rows [w K, w K + K). Windows never straddle shards (the planner rounds the rows per
shard up to whole windows), so the policy does not depend on the mesh: a map restores
onto any mesh as it is. Per step, on the global batch's distinct ids, window by window:
  1. hit: x is in its window and live (ttl_steps = 0, or step - last < ttl_steps):
     last = step, count += its occurrences in the batch;
  2. the misses of the window, in ascending raw-id order, take the window's free rows
     in the order (empty, expired, live by eviction priority, row): LRU = oldest
     `last` first, LFU = lowest `count`, then oldest; rows hit in this step are not
     free. The i-th miss takes the i-th free row; the row and its optimizer slots
     are re-initialised (fresh draw, default slots) and key = x, last = step,
     count = occurrences;
  3. a miss beyond the window's free rows (more new ids in one window and step than
     it has rows not hit this step) gets no row: it is looked up as padding (zero
     embedding, no update) and counted in `collisions`. No two ids ever share a row.

Routing (the row-wise lookup's owners). Every device all-gathers the ids of the
global batch (B x bag raw ids of the table's features, as (hi, lo) int32 pairs) and
sorts them by (window, id): every owner then sees, in the same order, every id of
the windows it owns, so replicas apply identical map updates without exchanging
them. Each owner resolves its windows (above) and a `psum` over 'shard' gives every
device the row of every distinct id (exactly one owner contributes each).
  Worked example (S = 2 shards, R = 1, rows 8, K = 2: windows 0-1 on shard 0, 2-3
  on shard 1; b = 2, bag 1): device 0 holds ids [7, 9], device 1 [9, 4]. After the
  all-gather both see [7, 9, 9, 4]; say w(7) = 1, w(9) = 1, w(4) = 3: sorted by
  (window, id) the distinct ids are 7, 9 (window 1, shard 0), 4 (window 3, shard 1).
  Shard 0 finds 9 in row 3 (a hit), inserts 7 into the free row 2; shard 1 inserts 4
  into row 6. After the psum both devices know 7 -> 2, 9 -> 3, 4 -> 6: device 0
  looks up rows [2, 3], device 1 rows [3, 6], by the ordinary row-wise exchange.
Per device and step: B bag ids gathered (8 bytes each), one sort of them, K map
entries read per distinct owned id: bounded by the batch, not the table.

Counters per table and step (int32, identical on every device): ids (distinct raw
ids in the batch), hits, inserts, evictions (inserts that displaced a live id),
expired (inserts into a slot whose id outlived its TTL), collisions (ids left
without a row, step 3), used (occupied rows after the step).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from gem_jax.embedding.config import TableConfig
from gem_jax.embedding.plan import BATCH, MAP_LEAVES, EmbeddingPlan

COUNTERS = ("ids", "hits", "inserts", "evictions", "expired", "collisions", "used")
_BIG = np.iinfo(np.int32).max
_SIGN = np.int64(1 << 31)


# ---- the window hash, identical in numpy (host, reference) and jnp (device) ----------
def _fmix32(h, xp):
  h = h ^ (h >> 16)
  h = h * xp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * xp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def window_of(hi, lo, windows: int, xp=jnp):
  """Window of the ids (hi, lo) (int32 halves, see `split_ids`): mix32 mod `windows`.

  mix32 = fmix32(lo ^ fmix32(hi ^ 0x9E3779B9)), murmur3's finaliser on uint32.
  """
  if xp is jnp:
    u = lambda x: jax.lax.bitcast_convert_type(x.astype(jnp.int32), jnp.uint32)  # noqa: E731
  else:
    u = lambda x: np.asarray(x, np.int32).view(np.uint32)  # noqa: E731
  h = _fmix32(u(lo) ^ _fmix32(u(hi) ^ xp.uint32(0x9E3779B9), xp), xp)
  w = h % xp.uint32(windows)
  return w.astype(xp.int32)


def split_ids(ids: np.ndarray, feature: str, table: str) -> np.ndarray:
  """Raw ids (any int dtype) -> int32 (..., 2) [hi, lo]: hi = x >> 32, lo = (x mod 2^32) -
  2^31 (so (hi, lo) compare like x); -1 -> [-1, 0] (padding).

  Raises ValueError naming the feature and the position for a negative id other than -1
  or an id >= 2^63 (the map keeps 63-bit ids).
  """
  ids = np.asarray(ids)
  if not np.issubdtype(ids.dtype, np.integer):
    raise TypeError(f"feature {feature!r}: ids must be integers, got {ids.dtype}")
  if np.issubdtype(ids.dtype, np.unsignedinteger):
    bad = ids >= np.uint64(1 << 63) if ids.dtype == np.uint64 else np.zeros(ids.shape, bool)
    why = "ids >= 2^63 do not fit the managed map (63-bit raw ids)"
    pad = np.zeros(ids.shape, bool)
  else:
    pad = ids == -1
    bad = ids < -1
    why = "-1 is the only padding id of a managed table"
  if bad.any():
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(f"feature {feature!r} (table {table!r}, id_policy='managed'): id "
                     f"{int(ids[where])} at position {where}: {why}")
  x = np.where(pad, 0, ids).astype(np.int64)
  hi = np.where(pad, -1, x >> 32).astype(np.int32)
  lo = np.where(pad, 0, (x & 0xFFFFFFFF) - _SIGN).astype(np.int32)
  return np.stack([hi, lo], axis=-1)


def join_ids(pairs: np.ndarray) -> np.ndarray:
  """Inverse of `split_ids`: int32 (..., 2) -> int64 raw ids (-1 where hi < 0)."""
  pairs = np.asarray(pairs).astype(np.int64)
  x = (pairs[..., 0] << 32) + (pairs[..., 1] + _SIGN)
  return np.where(pairs[..., 0] < 0, -1, x)


# ---- map state ----------------------------------------------------------------------
def empty_map(rows: int) -> dict:
  """The canonical map of an empty table: {leaf: (rows,) int32, 'map_used': ()}."""
  return {"map_hi": jnp.full((rows,), -1, jnp.int32), "map_lo": jnp.zeros((rows,), jnp.int32),
          "map_last": jnp.zeros((rows,), jnp.int32), "map_count": jnp.zeros((rows,), jnp.int32),
          "map_used": jnp.zeros((), jnp.int32)}


@jax.jit
def _map_faults(hi, lo, used, rows_iota, probe, windows):
  """(occupied rows, rows whose id is outside its window) of a canonical map."""
  occ = hi >= 0
  misplaced = occ & (window_of(hi, lo, windows) != rows_iota // probe)
  return jnp.sum(occ), jnp.sum(misplaced), used


def check_canonical_map(name: str, t: TableConfig, src) -> dict:
  """The map leaves of canonical table `src` ({} for other policies), checked against the
  table: present exactly for managed tables, (rows,) each, every id in its window, and
  `map_used` = occupied rows. Raises ValueError naming the table otherwise."""
  has = [k for k in MAP_LEAVES if k in src]
  if t.id_policy != "managed":
    if has:
      raise ValueError(f"table {name!r}: the checkpoint holds a managed-collision map but the "
                       f"table's id_policy is {t.id_policy!r}; restore it as 'managed'")
    return {}
  if len(has) != len(MAP_LEAVES):
    raise ValueError(f"table {name!r} is managed but the checkpoint has no (or a partial) map "
                     f"(leaves {has}); it was saved under another id_policy")
  for k in MAP_LEAVES:
    want = () if k == "map_used" else (t.rows,)
    if tuple(src[k].shape) != want:
      raise ValueError(f"table {name!r}: map leaf {k!r} of shape {tuple(src[k].shape)}, the "
                       f"table expects {want}")
  occ, misplaced, used = (int(v) for v in _map_faults(
      jnp.asarray(src["map_hi"]), jnp.asarray(src["map_lo"]), jnp.asarray(src["map_used"]),
      jnp.arange(t.rows, dtype=jnp.int32), t.probe, t.rows // t.probe))
  if misplaced:
    raise ValueError(f"table {name!r}: {misplaced} map entries lie outside their probe window "
                     f"(a map saved with another rows or probe={t.probe} than this table)")
  if occ != used:
    raise ValueError(f"table {name!r}: map_used = {used} but {occ} rows hold an id "
                     "(map and table disagree)")
  return {k: src[k] for k in MAP_LEAVES}


# ---- the in-step resolution ---------------------------------------------------------
def _fresh(t: TableConfig, key, n: int):
  """(n, D) fresh rows from the table's initializer, scaled for its `rows`."""
  try:
    return t.initializer(key, (n, t.dim), t.dtype, rows=t.rows)
  except TypeError:   # an initializer without the `rows` keyword
    return t.initializer(key, (n, t.dim), t.dtype)


def _resolve_table(plan: EmbeddingPlan, t: TableConfig, st: dict, x, step, key, update=True):
  """One device: (its buffer state, its ids (n, 2)) -> (state, rows (n,), counters).
  update=False: lookups only (misses get no row, the state is returned as it is)."""
  buf = plan.buffers[plan.buffer_of[t.name]]
  K, rps, windows = t.probe, buf.local_rows, t.rows // t.probe
  shard = jax.lax.axis_index("shard")
  g = jax.lax.all_gather(x, BATCH, axis=0, tiled=True)                     # (N, 2) global
  N = g.shape[0]
  hi, valid = g[:, 0], g[:, 0] >= 0
  lo = jnp.where(valid, g[:, 1], 0)
  win = jnp.where(valid, window_of(hi, lo, windows), _BIG)
  win, hi, lo, src = jax.lax.sort((win, hi, lo, jnp.arange(N, dtype=jnp.int32)), num_keys=3)
  new = jnp.concatenate([jnp.ones((1,), bool),
                         (win[1:] != win[:-1]) | (hi[1:] != hi[:-1]) | (lo[1:] != lo[:-1])])
  did = jnp.cumsum(new) - 1                                                # (N,) distinct index
  d_win = jnp.full((N,), _BIG, jnp.int32).at[did].set(win)                 # (N,) per distinct id
  d_hi = jnp.full((N,), -1, jnp.int32).at[did].set(hi)
  d_lo = jnp.zeros((N,), jnp.int32).at[did].set(lo)
  occ = jax.ops.segment_sum((win != _BIG).astype(jnp.int32), did, N, indices_are_sorted=True)
  d_valid = d_win != _BIG
  first = jnp.where(d_valid, d_win, 0) * K                                 # window's first row
  mine = d_valid & (first // rps == shard)
  base = jnp.where(mine, first - shard * rps, 0)                           # local first row
  slots = base[:, None] + jnp.arange(K, dtype=jnp.int32)                   # (N, K) local rows
  m_hi, m_lo = st["map_hi"][slots], st["map_lo"][slots]                    # (N, K)
  m_last, m_cnt = st["map_last"][slots], st["map_count"][slots]
  live = m_hi >= 0
  if t.ttl_steps:
    live = live & (step - m_last < t.ttl_steps)
  match = mine[:, None] & live & (m_hi == d_hi[:, None]) & (m_lo == d_lo[:, None])  # (N, K)
  hit = jnp.any(match, axis=1)
  hit_k = jnp.argmax(match, axis=1).astype(jnp.int32)
  wseg = jnp.cumsum(jnp.concatenate([jnp.ones((1,), bool), d_win[1:] != d_win[:-1]])) - 1
  taken = jax.ops.segment_max(match.astype(jnp.int32), wseg, N, indices_are_sorted=True)[wseg]
  if not update:
    glob = jnp.where(hit, shard * rps + base + hit_k, -1)
    d_row = jax.lax.psum(glob + 1, "shard") - 1
    row = jnp.zeros((N,), jnp.int32).at[src].set(d_row[did])
    n = x.shape[0]
    return st, jax.lax.dynamic_slice(row, (jax.lax.axis_index(BATCH) * n,), (n,)), {}
  miss = mine & ~hit
  ahead = jnp.cumsum(miss) - miss                                          # misses before me
  rank = ahead - jax.ops.segment_min(ahead, wseg, N, indices_are_sorted=True)[wseg]
  cls = jnp.where(taken > 0, 3, jnp.where(m_hi < 0, 0, jnp.where(live, 2, 1)))  # (N, K)
  if t.eviction == "lru":
    p1, p2 = m_last, jnp.zeros_like(m_last)
  else:
    p1, p2 = m_cnt, m_last
  # Place of each candidate in the (cls, p1, p2, k) order, by pairwise comparison (K^2 per id:
  # cheaper than a sort along K on XLA:CPU); the victim is the candidate placed `rank`.
  a = lambda v: v[:, :, None]  # noqa: E731   candidate k
  b = lambda v: v[:, None, :]  # noqa: E731   candidate j
  kk = jnp.arange(K, dtype=jnp.int32)
  before = ((b(cls) < a(cls)) | ((b(cls) == a(cls)) & ((b(p1) < a(p1)) | ((b(p1) == a(p1)) & (
      (b(p2) < a(p2)) | ((b(p2) == a(p2)) & (kk[None, None, :] < kk[None, :, None])))))))
  place = jnp.sum(before, axis=2)                                          # (N, K)
  free = jnp.sum(cls < 3, axis=1)
  put = miss & (rank < free)
  vic_k = jnp.argmax(place == rank[:, None], axis=1).astype(jnp.int32)
  vic_cls = jnp.take_along_axis(cls, vic_k[:, None], axis=1)[:, 0]
  local = jnp.where(hit, base + hit_k, jnp.where(put, base + vic_k, -1))   # (N,)
  glob = jnp.where(local >= 0, shard * rps + local, -1)
  d_row = jax.lax.psum(glob + 1, "shard") - 1                              # (N,) every id's row

  upd = jnp.where(hit | put, local, rps)                                   # rps: dropped
  cnt = jnp.where(hit, jnp.take_along_axis(m_cnt, hit_k[:, None], axis=1)[:, 0], 0) + occ
  out = dict(st)
  out["map_hi"] = st["map_hi"].at[upd].set(d_hi, mode="drop")
  out["map_lo"] = st["map_lo"].at[upd].set(d_lo, mode="drop")
  out["map_last"] = st["map_last"].at[upd].set(jnp.broadcast_to(step, (N,)), mode="drop")
  out["map_count"] = st["map_count"].at[upd].set(cnt, mode="drop")
  reset = jnp.where(put, local, rps)                                       # rows re-initialised
  out["weight"] = st["weight"].at[reset].set(_fresh(t, key, N).astype(st["weight"].dtype),
                                             mode="drop")
  opt = buf.optimizer
  if "accumulator" in st:
    out["accumulator"] = st["accumulator"].at[reset].set(opt.initial_accumulator, mode="drop")
  for s in ("m", "v"):
    if s in st:
      out[s] = st[s].at[reset].set(0.0, mode="drop")
  local_counts = jnp.stack([jnp.sum(v.astype(jnp.int32)) for v in (
      mine, hit, put, put & (vic_cls == 2), put & (vic_cls == 1), miss & ~put,
      put & (vic_cls == 0))])
  c = jax.lax.psum(local_counts, "shard")                                  # (7,) one psum
  out["map_used"] = st["map_used"] + c[6]
  counters = dict(zip(COUNTERS[:-1], c[:6]), used=out["map_used"])
  row = jnp.zeros((N,), jnp.int32).at[src].set(d_row[did])                 # (N,) input order
  n = x.shape[0]
  dev = jax.lax.axis_index(BATCH)
  return out, jax.lax.dynamic_slice(row, (dev * n,), (n,)), counters


def resolve(plan: EmbeddingPlan, state: dict, ids: dict, step, key=None, update: bool = True):
  """Managed tables' raw ids -> rows; the maps updated and new ids' rows re-initialised.

  Args:
    plan: the embedding plan.
    state: the embedding state (donate it with the step).
    ids: {feature: int32 (B, bag)} rows for other tables, int32 (B, bag, 2) raw-id
      halves (`split_ids`, via `prepare_ids`) for features of managed tables.
    step: int32 scalar, the step the ids are seen at (`map_last`, TTL).
    key: PRNG key of the fresh rows (the same on every device; the step is folded in).
    update: False for inference (eval, export): ids found in the map get their rows,
      the others none (-1: zero embeddings); the state is not changed.
  Returns:
    (state, ids with every managed feature as int32 (B, bag) global rows, -1 at padding
    and at ids left without a row, {table: {counter: int32 ()}}, see the module doc).
  """
  names = plan.managed_tables()
  if not names:
    return state, ids, {}
  specs = plan.state_specs()
  bufs = [plan.buffer_of[t] for t in names]
  feats = {t: [f for f, c in plan.features.items() if c.table == t] for t in names}
  key = jax.random.fold_in(jax.random.key(0) if key is None else key, step)

  def body(sub, raw, step, key):
    new, rows, counters = {}, {}, {}
    for i, t in enumerate(names):
      fs = feats[t]
      x = jnp.concatenate([raw[f].reshape(-1, 2) for f in fs])             # (n, 2)
      new[bufs[i]], r, counters[t] = _resolve_table(
          plan, plan.tables[t], sub[bufs[i]], x, step, jax.random.fold_in(key, i), update)
      off = 0
      for f in fs:
        b, bag = raw[f].shape[:2]
        rows[f] = r[off:off + b * bag].reshape(b, bag)
        off += b * bag
    return new, rows, counters

  mfeats = [f for t in names for f in feats[t]]
  sub_specs = {b: specs[b] for b in bufs}
  in_specs = (sub_specs, {f: P(BATCH, None, None) for f in mfeats}, P(), P())
  out_specs = (sub_specs, {f: P(BATCH, None) for f in mfeats},
               {t: {c: P() for c in COUNTERS} if update else {} for t in names})
  # check_vma=False: the maps and counters are replicated over 'replica' (and the counters
  # over 'shard') by construction: every device resolves the same global ids.
  fn = jax.shard_map(body, mesh=plan.mesh, in_specs=in_specs, out_specs=out_specs,
                     check_vma=False)
  sub, rows, counters = fn({b: state[b] for b in bufs}, {f: ids[f] for f in mfeats},
                           jnp.asarray(step, jnp.int32), key)
  if not update:
    return state, {**ids, **rows}, {}
  return {**state, **sub}, {**ids, **rows}, counters


def step_metrics(plan: EmbeddingPlan, counters: dict) -> dict:
  """Float32 metrics of `resolve`'s counters: per table `mc_<counter>/<table>` (ids, hits,
  inserts, evictions, expired, collisions per step) and `mc_occupancy/<table>` (used /
  rows); over all managed tables `mc_hit_rate` (hits / ids) and `mc_collisions`."""
  out = {}
  for t, c in counters.items():
    for k in COUNTERS[:-1]:
      out[f"mc_{k}/{t}"] = c[k].astype(jnp.float32)
    out[f"mc_occupancy/{t}"] = c["used"].astype(jnp.float32) / plan.tables[t].rows
  if counters:
    ids = sum(c["ids"] for c in counters.values())
    out["mc_hit_rate"] = (sum(c["hits"] for c in counters.values()).astype(jnp.float32)
                          / jnp.maximum(ids, 1).astype(jnp.float32))
    out["mc_collisions"] = sum(c["collisions"] for c in counters.values()).astype(jnp.float32)
  return out
