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
  2. a miss whose own entry is still in the window, expired, takes that row back
     (re-initialised as below, counted as an expired insert): a raw id is never the
     key of two rows. The other misses of the window, in ascending (fp(x), x) order
     (fp: a 32-bit hash of the id independent of the window's, `distinct_ids.fingerprint`), take
     the window's free rows in the order (empty, expired, live by eviction priority,
     row): LRU = oldest `last` first, LFU = lowest `count`, then oldest; rows hit or
     taken back in this step are not free. The i-th miss takes the i-th free row; the
     row and its optimizer slots
     are re-initialised (fresh draw, default slots) and key = x, last = step,
     count = occurrences;
  3. a miss beyond the window's free rows (more new ids in one window and step than
     it has rows not hit this step) gets no row: it is looked up as padding (zero
     embedding, no update) and counted in `collisions`. No two ids ever share a row.

Routing (the row-wise lookup's owners, `_route_a2a`). Each device deduplicates its ids
grouped by owner (`distinct`, below), so each owner's run is sent by one `all_to_all`
of (S, C, 3) = (hi, lo, occurrences) per table, all managed tables' side by side in one
exchange (S, sum C, 3), C per (device, owner) from the plan
(`EmbeddingPlan.managed_capacity`: the table's expected distinct ids, from the id
statistics when the plan has them, else every id slot). With `rw_exchange='ragged'`
(`_route_ragged`; the default on GPU/TPU) the runs travel by `ragged_all_to_all` into M
slots per owner instead (M ~ distinct + 4 sqrt(distinct) of its group, flat in S, where
S C grows with S), and the owner resolves M slots. On the padded route the owner keeps,
of its R S C slots deduplicated (the same id from several requesters and the padding go),
as many as the global batch's distinct ids of its windows need (`_distinct_cap`: from the
id statistics' distinct ids per batch, else R M), so its work past the one sort is flat in S
there too and follows the batch's real distinct ids.
Each owner all-gathers what its
replicas received over 'replica', so every copy of a map sees every id of its windows in
the global batch, in the same order, and applies the same update without exchanging it.
It resolves its windows (above) and the rows go back by the reverse exchange, each with
its id's distinct index at the owner (`_with_owner_index`): the lookup and the update
carry it with the row, and the owner sums the row's gradients from all its requesters by
it (`update._sum_by_index`) instead of sorting them again.
  Worked example (R = 1, S = 2 shards, rows 8, K = 2: windows 0-1 on shard 0, 2-3 on
  shard 1; b = 2, bag 1): device 0 holds ids [7, 9], device 1 [9, 4]; say w(7) = 1,
  w(9) = 1, w(4) = 3. Device 0 sends [7, 9] to shard 0 and nothing to shard 1; device 1
  sends [9] to shard 0 and [4] to shard 1. Shard 0 sees 7 (once) and 9 (twice): it
  finds 9 in row 3 (a hit, count += 2) and inserts 7 into the free row 2; shard 1
  inserts 4 into row 6. Back: device 0 gets [2, 3], device 1 [3, 6], and looks them
  up by the ordinary row-wise exchange. With them come the owners' distinct indices,
  say 7 -> 0 and 9 -> 1 at shard 0, 4 -> 0 at shard 1: in the update shard 0 receives
  row 3 from both devices with index 1 and adds their two gradients into slot 1.
When some pair of some table has more than C distinct ids anywhere (the padded route
sends its first C and the device flags the step; ragged: some owner more than M, one
`pmax` before the route), or some owner more distinct ids than it keeps (flagged after
the route, when some table's cap is below its slots), the step is resolved by broadcast
for every table instead (`_route_broadcast`, exact for any skew): the global batch's ids
all-gathered, every owner resolves its windows, one `psum` over 'shard' gives every
device the row of every id. It runs in a `while_loop` taken once or never, after the
by-owner route's writes (dropped in such a step), so the common step carries no
fallback-sized buffers. Both paths give the same rows and maps (tested). One `psum` (the
flags and the counters; ragged: and the `pmax`) serves all managed tables.
With one shard (S = 1: every device holds whole tables) there is no route: each device
resolves the global batch's ids (its own when R = 1) with one deduplication, at most as
many distinct ids as the id statistics allow for (`EmbeddingPlan.managed_owner_distinct`;
more: the step is redone by broadcast, as above), and on a single device the lookup takes
its distinct rows as from the routes.

Deduplication (`distinct_ids.distinct`, requester grouped by owner, owner by its local
window): single-key sorts of a uint32 key, exact, each window's distinct ids in the
policy's (fp(x), x) order, so a miss's rank (step 2) is a running count of the misses before
it. Per device and step: two single-key sorts of about b x bag ids, K map entries read per
id, and writes by the count of rows written (`_apply_writes`): bounded by the batch, not the
table.

Fresh rows: row r is drawn by the table's initializer from the key (step key, table, r)
of `ROW_PRNG`, a counter-based hash generator (murmur3's finaliser of key and counter, ~10
integer ops per word against threefry's ~60): the initializer's distribution, values that
depend on the seed, step, table, row and column only (not on the mesh or the route).

Counters per table and step (int32, identical on every device): ids (distinct raw
ids in the batch), hits, inserts, evictions (inserts that displaced a live id),
expired (inserts into a slot whose id outlived its TTL), collisions (ids left
without a row, step 3), used (occupied rows after the step), broadcast (1: the step was
resolved by the broadcast route, the overflow fallback or `rw_exchange='broadcast'`; the
same for every table: a run whose routes are sized too small shows it here, in time
rather than in rows).
"""
from __future__ import annotations

import jax
import jax.extend.random
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from gem_jax import vma
from gem_jax.embedding import distinct_ids, ragged
from gem_jax.embedding.config import TableConfig
from gem_jax.embedding.distinct_ids import fmix32
from gem_jax.embedding.layout import NO_ROW
from gem_jax.embedding.plan import BATCH, MAP_LEAVES, EmbeddingPlan

COUNTERS = ("ids", "hits", "inserts", "evictions", "expired", "collisions", "used",
            "broadcast")
_RESOLVED = COUNTERS[:6]   # counted by `_owner_resolve`, summed over the owners
_BIG = NO_ROW   # padding of keys, leads and distinct rows (`gather_rows` takes NO_ROW padding)
_SIGN = np.int64(1 << 31)
_GOLD = 0x9E3779B9
_MAP_ROWS = tuple(k for k in MAP_LEAVES if k != "map_used")   # the per-row map leaves


# ---- the window hash, identical in numpy (host, reference) and jnp (device) ----------
def window_of(hi, lo, windows: int, xp=jnp):
  """Window of the ids (hi, lo) (int32 halves, see `split_ids`): mix32 mod `windows`.

  mix32 = fmix32(lo ^ fmix32(hi ^ 0x9E3779B9)), murmur3's finaliser on uint32.
  """
  if xp is jnp:
    u = lambda x: jax.lax.bitcast_convert_type(x.astype(jnp.int32), jnp.uint32)  # noqa: E731
  else:
    u = lambda x: np.asarray(x, np.int32).view(np.uint32)  # noqa: E731
  h = fmix32(u(lo) ^ fmix32(u(hi) ^ xp.uint32(0x9E3779B9), xp), xp)
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
  """(occupied rows, rows whose id is outside its window, rows whose id another row holds
  too, one such id's (hi, lo)) of a canonical map."""
  occ = hi >= 0
  misplaced = occ & (window_of(hi, lo, windows) != rows_iota // probe)
  s_hi, s_lo = jax.lax.sort((hi, lo), num_keys=2)                          # empty (-1) first
  dup = (s_hi[1:] >= 0) & (s_hi[1:] == s_hi[:-1]) & (s_lo[1:] == s_lo[:-1])
  first = jnp.argmax(dup)
  return jnp.sum(occ), jnp.sum(misplaced), used, jnp.sum(dup), s_hi[1:][first], s_lo[1:][first]


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
  occ, misplaced, used, dup, d_hi, d_lo = (int(v) for v in _map_faults(
      jnp.asarray(src["map_hi"]), jnp.asarray(src["map_lo"]), jnp.asarray(src["map_used"]),
      jnp.arange(t.rows, dtype=jnp.int32), t.probe, t.rows // t.probe))
  if misplaced:
    raise ValueError(f"table {name!r}: {misplaced} map entries lie outside their probe window "
                     f"(a map saved with another rows or probe={t.probe} than this table)")
  if dup:
    raw = int(join_ids(np.array([d_hi, d_lo], np.int32)))
    raise ValueError(f"table {name!r}: {dup} map entries repeat a raw id another row holds "
                     f"(e.g. id {raw}); a raw id keys at most one row")
  if occ != used:
    raise ValueError(f"table {name!r}: map_used = {used} but {occ} rows hold an id "
                     "(map and table disagree)")
  return {k: src[k] for k in MAP_LEAVES}


# ---- the in-step resolution ---------------------------------------------------------
def _row_bits_seed(seed):
  s = jnp.asarray(seed).astype(jnp.uint32)
  return jnp.stack([fmix32(s ^ jnp.uint32(0x243F6A88), jnp),
                    fmix32(s ^ jnp.uint32(0x85A308D3), jnp)])


def _row_bits_fold_in(key, data):
  d = jnp.asarray(data).astype(jnp.uint32)
  a = fmix32(key[0] ^ fmix32(d ^ key[1], jnp), jnp)
  return jnp.stack([a, fmix32(key[1] + d * jnp.uint32(_GOLD) + a, jnp)])


def _row_bits_split(key, shape):
  n = int(np.prod(shape))
  keys = jax.vmap(lambda i: _row_bits_fold_in(key, i))(jnp.arange(n, dtype=jnp.uint32))
  return keys.reshape(tuple(shape) + (2,))


def _row_bits(key, bit_width, shape):
  """Counter-based bits: word c of the draw is fmix32(fmix32(c GOLD + k0) ^ k1)."""
  n = int(np.prod(shape)) * max(bit_width // 32, 1)
  c = jnp.arange(n, dtype=jnp.uint32)
  x = fmix32(fmix32(c * jnp.uint32(_GOLD) + key[0], jnp) ^ key[1], jnp)
  if bit_width == 64:
    x = x.reshape(-1, 2).astype(jnp.uint64)
    return ((x[:, 0] << 32) | x[:, 1]).reshape(shape)
  return x.astype(jnp.dtype(f"uint{bit_width}")).reshape(shape)


# The PRNG of fresh rows: each row's key is the table's step key folded with the global row;
# the words are a murmur3-finaliser hash of (key, counter) (about 10 integer ops per word,
# against threefry's ~60): the initializer draws from it as from any key, so the values
# keep its distribution and depend on (seed, step, table, row, column) only.
ROW_PRNG = jax.extend.random.define_prng_impl(
    key_shape=(2,), seed=_row_bits_seed, split=_row_bits_split, random_bits=_row_bits,
    fold_in=_row_bits_fold_in, name="gem_jax_row_hash")


def _fresh(t: TableConfig, key, n: int):
  """(n, D) fresh rows from the table's initializer, scaled for its `rows`."""
  try:
    return t.initializer(key, (n, t.dim), t.dtype, rows=t.rows)
  except TypeError:   # an initializer without the `rows` keyword
    return t.initializer(key, (n, t.dim), t.dtype)


def _fresh_rows(t: TableConfig, key, rows):
  """(M, D) fresh rows for global rows `rows` (M,): row r drawn by the initializer from the
  `ROW_PRNG` key (key, r), so the values depend on the row and the step only (not on the
  mesh or the route)."""
  data = jax.random.key_data(key).reshape(-1).astype(jnp.uint32)
  base = jax.random.wrap_key_data(_row_bits_fold_in(data[:2] if data.shape[0] > 1 else
                                                    jnp.concatenate([data, data]), 0),
                                  impl=ROW_PRNG)
  return jax.vmap(lambda r: _fresh(t, jax.random.fold_in(base, r), 1)[0])(rows)


def _segments(d_lead, starts=None):
  """Segment index of each distinct id's lead run (M,) (runs are contiguous); `starts` (M,)
  bool, optional: where a new segment begins whatever the leads (a table's first id in
  `_owner_resolve`'s concatenation)."""
  new = jnp.concatenate([jnp.ones((1,), bool), d_lead[1:] != d_lead[:-1]])
  if starts is not None:
    new = new | starts
  return (jnp.cumsum(new) - 1).astype(jnp.int32)


def _victim_keys(t: TableConfig, cls, last, count):
  """Sort keys (M, K) each of a window's candidate rows in the policy's (class, priority)
  order (class 0 empty, 1 expired, 2 live, 3 hit or taken back this step: not free;
  empty rows in row order), as few as the policy allows. LRU: one key, the row's `last`
  (empty -1, not free int32 max): expired iff last <= step - ttl_steps, so the class of a
  free row is monotone in `last`. LFU without TTL: (count, last) with empty (-1, 0).
  LFU with TTL: (class, count, last)."""
  top, empty = jnp.int32(_BIG), cls == 0
  if t.eviction == "lru":
    return (jnp.where(cls == 3, top, jnp.where(empty, -1, jnp.clip(last, 0, _BIG - 1))),)
  count, last = jnp.where(empty, 0, count), jnp.where(empty, 0, last)
  if not t.ttl_steps:
    return jnp.where(cls == 3, top, jnp.where(empty, -1, count)), last
  return cls, count, last


def _placed_before(keys, K: int):
  """before (M, K, K): candidate j comes before candidate k in the lexicographic order of
  `keys` (each (M, K)), ties by row (j < k). Pairwise comparison (K^2 per id) is cheaper
  than a sort along K on XLA:CPU; a candidate's place is its row's count."""
  kk = jnp.arange(K, dtype=jnp.int32)
  earlier = kk[None, None, :] < kk[None, :, None]                          # (1, K, K) j < k
  if len(keys) == 1:   # one key: j before k iff v_j < v_k, or v_j <= v_k for j < k
    a, b = keys[0][:, :, None], keys[0][:, None, :]                        # k, j
    return jnp.where(earlier, b <= a, b < a)
  before = earlier
  for v in reversed(keys):
    a, b = v[:, :, None], v[:, None, :]                                    # k, j
    before = (b < a) | ((b == a) & before)
  return before


def _only_index(mask):
  """k of the one True in each row of mask (M, K) (0 where none): sum_k k [mask_k], a plain
  sum where argmax is a variadic (value, index) reduce. Rows hold at most one True (a raw id
  keys at most one row of its window: `check_canonical_map`; places are distinct)."""
  return jnp.sum(jnp.where(mask, jnp.arange(mask.shape[1], dtype=jnp.int32), 0), axis=1)


def _window_or(claimed, wseg):
  """taken (M, K) bool: candidate k of the window is claimed by some distinct id of it. The
  claims of a window's ids are disjoint (a row keys one id), so they travel as bit masks:
  one uint32 word per 32 candidates, summed per window (a sum of disjoint bits is their
  or): a segment sum of (M, ceil(K / 32)) words instead of a segment max of (M, K).
    Example (K = 4): claims [0100] and [0001] in one window -> masks 2 + 8 = 10 -> both
    ids read [0101]."""
  M, K = claimed.shape
  W = -(-K // 32)
  bits = jnp.pad(claimed, ((0, 0), (0, 32 * W - K))).reshape(M, W, 32).astype(jnp.uint32)
  masks = jnp.sum(bits << jnp.arange(32, dtype=jnp.uint32), axis=2, dtype=jnp.uint32)  # (M, W)
  masks = jax.ops.segment_sum(masks, wseg, M, indices_are_sorted=True)[wseg]
  unpacked = (masks[:, :, None] >> jnp.arange(32, dtype=jnp.uint32)) & 1  # (M, W, 32)
  return unpacked.reshape(M, 32 * W)[:, :K] > 0


def _local_windows(plan: EmbeddingPlan, t: TableConfig, g):
  """The local window of each id g (M, 2) at this owner (M,), `_BIG` for padding and other
  owners' ids; this owner's window count."""
  K, rps = t.probe, plan.buffers[plan.buffer_of[t.name]].local_rows
  valid = g[:, 0] >= 0
  lw = window_of(g[:, 0], jnp.where(valid, g[:, 1], 0), t.rows // K) \
      - jax.lax.axis_index("shard") * (rps // K)
  return jnp.where(valid & (lw >= 0) & (lw < rps // K), lw, _BIG), rps // K


def _owner_read(t: TableConfig, st: dict, dedup, M: int, cap: int | None):
  """`_owner_resolve`'s part per table: its M ids deduplicated by local window (`dedup`:
  `distinct`'s outputs), the first D kept, their windows read from the map `st` -> (inv
  (M,), D, fits, the policy's inputs per distinct id {name: (D,) or (D, K)})."""
  K = t.probe
  inv, d_lw, d_hi, d_lo, occ = dedup
  D = M if cap is None else min(cap, M)
  fits = jnp.bool_(True) if D == M else d_lw[D] == _BIG    # distinct ids first, padding last
  d_lw, d_hi, d_lo, occ = d_lw[:D], d_hi[:D], d_lo[:D], occ[:D]            # (D,) each
  mine = d_lw != _BIG
  win = lambda v: v.reshape(-1, K)[jnp.where(mine, d_lw, 0)]  # noqa: E731  (D, K) its window
  m_hi, m_lo, m_last, m_cnt = (win(st[k]) for k in _MAP_ROWS)              # (D, K) each
  return inv, D, fits, {"lw": d_lw, "hi": d_hi, "lo": d_lo, "occ": occ, "mine": mine,
                        "base": jnp.where(mine, d_lw * K, 0), "m_hi": m_hi, "m_lo": m_lo,
                        "m_last": m_last, "m_cnt": m_cnt}


def _decide(t: TableConfig, x: dict, step, update: bool, starts, ttl, rps):
  """The policy (module doc, steps 1-3) on the distinct ids `x` (`_owner_read`'s, or several
  tables' of t's probe, eviction and TTL kind concatenated: `starts` (N,) marks each table's
  first id (None: one table), `ttl` and `rps` (N,) give each id's table's TTL and local rows)
  -> (local row (N,), -1: none; the writes (upd, cnt, reset) (N,) each, rps: none; the
  counters' indicators (N, 7); both None without `update`). Window by window, so tables
  concatenated get each its own results."""
  K = t.probe
  mine, base, m_hi, m_last = x["mine"], x["base"], x["m_hi"], x["m_last"]
  live = m_hi >= 0
  if t.ttl_steps:
    live = live & (step - m_last < ttl[:, None])
  same = (mine[:, None] & (m_hi >= 0) & (m_hi == x["hi"][:, None])
          & (x["m_lo"] == x["lo"][:, None]))
  match = same & live                                                      # (N, K)
  hit = jnp.any(match, axis=1)
  hit_k = _only_index(match)
  if not update:
    return jnp.where(hit, base + hit_k, -1), None, None
  own = same & ~live                             # the id's own expired entry (TTL only)
  back = jnp.any(own, axis=1) & ~hit             # it takes that row back: no duplicate key
  own_k = _only_index(own)
  N = mine.shape[0]
  wseg = _segments(x["lw"], starts)
  taken = _window_or(match | (own & back[:, None]), wseg)                   # (N, K)
  miss = mine & ~hit & ~back

  ahead = jnp.cumsum(miss) - miss            # distinct ids in (window, fp, id) order:
  rank = ahead - jax.ops.segment_min(ahead, wseg, N, indices_are_sorted=True)[wseg]  # misses before
  cls = jnp.where(taken, 3, jnp.where(m_hi < 0, 0, jnp.where(live, 2, 1)))  # (N, K)
  # the victim of the miss ranked i is the free candidate placed i
  place = jnp.sum(_placed_before(_victim_keys(t, cls, m_last, x["m_cnt"]), K), axis=2)  # (N, K)
  free = jnp.sum(cls < 3, axis=1)
  put = miss & (rank < free)
  vic = place == rank[:, None]                  # (N, K) one candidate per miss put
  vic_k, vic_cls = _only_index(vic), jnp.sum(jnp.where(vic, cls, 0), axis=1)
  local = jnp.where(hit, base + hit_k, jnp.where(
      back, base + own_k, jnp.where(put, base + vic_k, -1)))              # (N,)

  new = put | back
  upd = jnp.where(hit | new, local, rps)                                   # rps: dropped
  cnt = jnp.sum(jnp.where(match, x["m_cnt"], 0), axis=1) + x["occ"]
  reset = jnp.where(new, local, rps)                                       # rows re-initialised
  counted = jnp.stack([mine, hit, new, put & (vic_cls == 2), back | (put & (vic_cls == 1)),
                       miss & ~put, put & (vic_cls == 0)], 1).astype(jnp.int32)  # (N, 7)
  return local, (upd, cnt, reset), counted


def _owner_resolve(plan: EmbeddingPlan, ts, sts, gs, step, update: bool, ws=None, caps=None,
                   distinct: bool = False):
  """This owner's part of ids gs[i] (M, 2) of each table ts[i] (every id of its windows in
  the global batch must be among them; ws[i] (M,): occurrences of each, default 1), read
  against its map sts[i] -> per table (global row per input position (M,), -1 for other
  owners' ids and ids left without a row; local counts (7,): ids, hits, inserts, evictions,
  expired, collisions, inserts into empty rows; the writes (map rows (D,), rps = none, their
  hi, lo, count; rows to re-initialise (D,), rps = none: `_apply_writes`); fits). No
  collective inside. With `distinct` the rows come per distinct id instead, as (rows (M,),
  the distinct index of each input position (M,)): rows[inv] are the rows per position.

  After the deduplication only the first D = min(caps[i], M) distinct ids are resolved (a
  padded route's M slots hold far fewer distinct ids: the same id from several requesters,
  padding); `fits` (bool scalar) says they were all of them. Where it is False the results
  are wrong and the caller resolves the step another way (`_resolve_all`).

  Table-batched policy: each table is deduplicated and read on its own (`_owner_read`), the
  policy runs once per group of tables with the same probe, eviction and TTL kind, on their
  distinct ids concatenated (`_decide`): every op on sum D ids instead of one op per table
  on D, so XLA's per-op cost is paid once per group, and a GPU launches its kernels per
  group, not per table. Each table's results are those it gets alone (bit for bit).
  Measured (XLA:CPU, docs/PERFORMANCE.md): the managed step 4 % faster on one device, 3 % on
  the simulated 1 x 8 group. The deduplication stays per table: one sort of all tables' ids
  at once was 14 % slower on one device (8 x 16k ids -> 131k: out of cache) and no faster on
  1 x 8."""
  T = len(ts)
  ws, caps = ws or [None] * T, caps or [None] * T
  shard = jax.lax.axis_index("shard")
  reads = [_owner_read(t, st, distinct_ids.distinct(g, *_local_windows(plan, t, g), w),
                       g.shape[0], c) for t, st, g, w, c in zip(ts, sts, gs, ws, caps)]
  rpss = [plan.buffers[plan.buffer_of[t.name]].local_rows for t in ts]
  groups: dict[tuple, list[int]] = {}
  for i, t in enumerate(ts):
    groups.setdefault((t.probe, t.eviction, bool(t.ttl_steps)), []).append(i)
  decided = [None] * T
  for members in groups.values():
    Ds = [reads[i][1] for i in members]
    offs = np.cumsum([0, *Ds])
    x = jax.tree.map(lambda *v: jnp.concatenate(v), *[reads[i][3] for i in members])
    per_id = lambda v: jnp.asarray(np.repeat(np.asarray(v, np.int32), Ds))  # noqa: E731
    starts = np.zeros(offs[-1], bool)
    starts[offs[:-1]] = True
    t0 = ts[members[0]]
    local, writes, counted = _decide(
        t0, x, step, update, jnp.asarray(starts) if len(members) > 1 else None,
        per_id([ts[i].ttl_steps for i in members]), per_id([rpss[i] for i in members]))
    if update:
      counts = jax.ops.segment_sum(counted, per_id(range(len(members))), len(members),
                                   indices_are_sorted=True)                # (tables, 7)
    for j, i in enumerate(members):
      cut = lambda v: v[offs[j]:offs[j + 1]]  # noqa: E731
      decided[i] = ((cut(local), tuple(cut(v) for v in writes), counts[j]) if update
                    else (cut(local), None, None))
  out = []
  for i, t in enumerate(ts):
    inv, D, fits, x = reads[i]
    local, writes, counts = decided[i]
    rps, M = rpss[i], gs[i].shape[0]
    rows = jnp.pad(jnp.where(local >= 0, shard * rps + local, -1), (0, M - D),
                   constant_values=-1)                                     # (M,) per distinct id
    rows = (rows, inv) if distinct else rows[inv]
    if not update:
      nothing = jnp.full((D,), rps, jnp.int32)
      out.append((rows, jnp.zeros((7,), jnp.int32), (nothing, x["hi"], x["lo"], x["occ"],
                                                      nothing), fits))
    else:
      upd, cnt, reset = writes
      out.append((rows, counts, (upd, x["hi"], x["lo"], cnt, reset), fits))
  return out


def _route_broadcast(plan, ts, sts, xs, step, update):
  """Every device resolves the whole global batch's ids of its windows (any skew), for all
  tables `ts` at once -> [(rows (n,) of the device's id slots, counts, writes)] per table."""
  gs = [jax.lax.all_gather(x, BATCH, axis=0, tiled=True) for x in xs]     # (N, 2) global
  out = []
  for x, (row, counts, dec, _) in zip(xs, _owner_resolve(plan, ts, sts, gs, step, update)):
    row = jax.lax.psum(row + 1, "shard") - 1                               # (N,) one owner each
    n = x.shape[0]
    out.append((jax.lax.dynamic_slice(row, (jax.lax.axis_index(BATCH) * n,), (n,)), counts,
                dec))
  return out


def _owners(plan, t, x):
  """Requester side: its distinct ids (`distinct` grouped by owner), the owner of each (S:
  padding) and where each owner's run starts in them (S + 1 edges)."""
  rps, S = plan.buffers[plan.buffer_of[t.name]].local_rows, plan.num_shards
  valid = x[:, 0] >= 0
  win = window_of(x[:, 0], jnp.where(valid, x[:, 1], 0), t.rows // t.probe)
  lead = jnp.where(valid, win * t.probe // rps, _BIG)                      # (n,) owner
  inv, d_own, d_hi, d_lo, occ = distinct_ids.distinct(x, lead, S)
  owner = jnp.where(d_own != _BIG, d_own, S)
  edges = jnp.searchsorted(owner, jnp.arange(S + 1, dtype=jnp.int32)).astype(jnp.int32)
  return (inv, d_hi, d_lo, occ, owner), edges


def _route_a2a(plan, ts, maps, xs, step, update, Cs, owned):
  """Each device's distinct ids to the owners of their windows, for all tables `ts` at
  once: one all_to_all of (S, sum C, 3) (table t's C per (device, owner) pair side by
  side), gathered over 'replica' (each owner sees its windows' ids of the whole batch),
  resolved (`_owner_resolve`, all tables in one call), rows sent back by one all_to_all of
  (S, sum C, 2) (row, owner index) along the same routes. `owned`: `_owners(plan, t, x)` per
  table. Returns [(rows (n,) of the device's distinct ids in `_owners` order (-1: none; `rows[inv]`
  per id slot), counts, writes, fits, owner index (n,))] per table, the writes
  (`_owner_resolve`'s) over the R S C slots resolved.
    Example (S = 2, tables u with C = 3 and v with C = 2): device 0 sends owner 1 the
    row [u0 u1 u2 v0 v1] of (hi, lo, count) triples (its runs padded with hi = -1); owner 1
    resolves slots [:, 0:3] against u's map and [:, 3:5] against v's."""
  S = plan.num_shards
  sends = []
  for x, C, ((inv, d_hi, d_lo, occ, owner), edges) in zip(xs, Cs, owned):
    start, j = edges[:-1], jnp.arange(C, dtype=jnp.int32)
    slot = jnp.minimum(start[:, None] + j[None, :], x.shape[0] - 1)        # (S, C)
    ok = j[None, :] < jnp.diff(edges)[:, None]
    sends.append(jnp.stack([jnp.where(ok, d_hi[slot], -1), jnp.where(ok, d_lo[slot], 0),
                            jnp.where(ok, occ[slot], 0)], -1))             # (S, C, 3)
  recv = jax.lax.all_to_all(jnp.concatenate(sends, 1), "shard", 0, 0, tiled=True)  # asked of me
  every = jax.lax.all_gather(recv, "replica", axis=0, tiled=False)         # (R, S, sum C, 3)
  offs = np.cumsum([0, *Cs])
  flats = [every[:, :, offs[i]:offs[i + 1]].reshape(-1, 3) for i in range(len(ts))]  # (R S C, 3)
  got, mine = [], []
  for i, (row, counts, dec, fits) in enumerate(_owner_resolve(
      plan, ts, maps, [f[:, :2] for f in flats], step, update, [f[:, 2] for f in flats],
      [_distinct_cap(plan, t, x) for t, x in zip(ts, xs)], distinct=True)):
    got.append((counts, dec, fits))
    mine.append(_with_owner_index(*row).reshape(-1, S, Cs[i], 2)[jax.lax.axis_index("replica")])
  back = jax.lax.all_to_all(jnp.concatenate(mine, 1), "shard", 0, 0, tiled=True)  # (S, sum C, 2)
  out = []
  for i, (x, ((inv, _, _, _, owner), edges)) in enumerate(zip(xs, owned)):
    o = jnp.minimum(owner, S - 1)
    pos = jnp.arange(x.shape[0], dtype=jnp.int32) - edges[o]               # (n,) place in run
    d = jnp.where((owner < S)[:, None], back[o, offs[i] + jnp.clip(pos, 0, Cs[i] - 1)], -1)
    out.append((d[:, 0], *got[i], d[:, 1]))
  return out


def _with_owner_index(rows, inv):
  """The owner's (rows per distinct id (M,), distinct index per position (M,)) -> (M, 2):
  each position's row and, where it has one, its distinct index at this owner (-1: none),
  which every requester of that id gets back: the update sums the id's gradients by it
  (`resolve(..., distinct=True)`, `update.apply_sparse_updates`) without sorting them."""
  row = rows[inv]
  return jnp.stack([row, jnp.where(row >= 0, inv, -1)], -1)


def _route_ragged(plan, ts, sts, xs, step, update, Ms, owned, native: bool):
  """`_route_a2a` by `ragged_all_to_all` (module `ragged`), an exchange per table: each
  device's owner runs of distinct ids travel as they are into a receive buffer of M slots per owner
  (`EmbeddingPlan.managed_capacity`), so the owner resolves M slots, not S x C (M ~ the
  group's distinct ids of its windows + 4 sqrt of them: flat in S), all tables' at once;
  rows go back along the same routes. Returns `_route_a2a`'s."""
  R = plan.num_replicas
  routes, every = [], []
  for M, ((inv, d_hi, d_lo, occ, owner), edges) in zip(Ms, owned):
    r = ragged.routes(edges[:-1], jnp.diff(edges))
    sent = jnp.stack([d_hi, d_lo, occ], -1)                                # (n, 3) owner runs
    recv = ragged.to_owners(r, sent, -1, M, native)                        # (M, 3) hi -1: none
    routes.append(r)
    every.append(jax.lax.all_gather(recv, "replica", axis=0, tiled=True))  # (R M, 3)
  got = _owner_resolve(plan, ts, sts, [e[:, :2] for e in every], step, update,
                           [e[:, 2] for e in every],
                           [_distinct_cap(plan, t, x) for t, x in zip(ts, xs)], distinct=True)
  out = []
  for x, M, r, ((*_, owner), _), (row, counts, dec, fits) in zip(xs, Ms, routes, owned, got):
    mine = _with_owner_index(*row).reshape(R, M, 2)[jax.lax.axis_index("replica")]  # my group's
    back = ragged.to_requesters(r, mine, x.shape[0], native)               # (n, 2) per distinct id
    d = jnp.where((owner < plan.num_shards)[:, None], back, -1)
    out.append((d[:, 0], counts, dec, fits, d[:, 1]))
  return out


def _distinct_cap(plan: EmbeddingPlan, t: TableConfig, x) -> int:
  """Distinct ids an owner resolves (`_owner_resolve`'s cap): its R S C (padded) or R M
  (ragged) slots carry the same id from several requesters and padding, so it keeps what
  the global batch's distinct ids of its windows need (`EmbeddingPlan.managed_owner_distinct`,
  from the id statistics), at most R M (M: the ragged route's ids per owner,
  `EmbeddingPlan.managed_capacity`) and at most all of its slots."""
  C, M = plan.managed_capacity(t.name)
  S, n = plan.num_shards, x.shape[0]
  per_owner = min(M, S * n) if plan.rw_exchange == "ragged" else min(M, S * min(C, n))
  return min(plan.managed_owner_distinct(t.name), plan.num_replicas * per_owner)


def _by_owner(plan: EmbeddingPlan) -> bool:
  return plan.num_shards > 1 and plan.rw_exchange != "broadcast"


def _one_shard(plan: EmbeddingPlan) -> bool:
  """Every device holds whole tables (S = 1): each resolves the global batch's ids itself
  (`_resolve_all`), with no route."""
  return plan.num_shards == 1 and plan.rw_exchange != "broadcast"


def _device_distinct(plan: EmbeddingPlan) -> bool:
  """The resolve deduplicates each device's own ids, so the lookup can take its distinct
  rows (`resolve(..., distinct=True)`): by owner, or on a single device."""
  return _by_owner(plan) or (_one_shard(plan) and plan.num_replicas == 1)


def _capacity(plan: EmbeddingPlan, t: TableConfig, x) -> int:
  """Distinct ids per (device, owner) of the padded route (`_route_a2a`), or per owner from
  its whole group (M) of the ragged one (`_route_ragged`)."""
  C, M = plan.managed_capacity(t.name)
  n = x.shape[0]
  return min(M, plan.num_shards * n) if plan.rw_exchange == "ragged" else min(C, n)


def _resolve_all(plan: EmbeddingPlan, ts, subs, xs, step, keys, update: bool):
  """One device: the buffers `subs` and ids (n, 2) of managed tables `ts` -> (the buffers
  with the writes applied (unchanged unless `update`), [(rows (n,), counts (7,) summed over
  the owners)] per table, [the device's distinct index of each id (n,)] per table or None
  when the resolve does not deduplicate the device's own ids (`_device_distinct`), [the
  owner's distinct index of each of the device's distinct ids (n,), -1: none or a step
  redone by broadcast (`_with_owner_index`)] per table or None when there is no route,
  whether the step was resolved by broadcast (bool scalar, the same on every device)). The
  rows are those of the device's distinct ids (`rows[inv]` per id slot) when it does, else
  of its id slots.

  One shard (`_one_shard`): the device resolves the global batch's ids itself, capped at
  `_distinct_cap` distinct ids; past the cap the step is redone by broadcast, as below.

  By owner (`_route_a2a`, all tables in one exchange; `_route_ragged`, an exchange per table)
  unless some (device, owner) pair of some table has more than its C distinct ids anywhere
  in the mesh, or some owner more distinct ids than it keeps (`_distinct_cap`), then every
  table by broadcast (`_route_broadcast`): both give the same rows and maps. The padded
  route runs whatever the counts (a pair's ids past its C are not sent: that device flags
  the step), so both flags and the counters travel in one `psum` after it; the ragged
  route cannot take more than its M slots per owner, so a `pmax` decides before it (one
  `lax.cond`). The routes only read the maps and return batch-sized writes, applied
  outside any lax.cond (XLA:CPU copied table-sized buffers updated inside a cond branch
  whole), and dropped in a step to redo. The broadcast fallback, whose writes span the
  R S n ids of the global batch against the owner route's R S C, runs in a loop taken
  once or never (`lax.while_loop` updates its carried buffers in place), so the common
  step neither pads its writes to the fallback's size nor scans them.
  """
  def maps_of(subs):
    return [{k: sub[k] for k in _MAP_ROWS} for sub in subs]

  def apply(subs, got, chunk_map):
    if not update:
      return subs
    return [_apply_writes(plan, t, sub, got_t[2], step, key, _write_width(got_t[2][0].shape[0]),
                          chunk_map) for t, sub, got_t, key in zip(ts, subs, got, keys)]

  def broadcast(subs):
    got = _route_broadcast(plan, ts, maps_of(subs), xs, step, update)
    counts = jax.lax.psum(jnp.stack([c for _, c, _ in got]), "shard")    # (T, 7)
    return apply(subs, got, True), [(r, c) for (r, _, _), c in zip(got, counts)]

  rps = [plan.buffers[plan.buffer_of[t.name]].local_rows for t in ts]

  def masked(got, redo):   # a step to redo: the first attempt's writes dropped
    return [(r, c, (jnp.where(redo, p, upd), hi, lo, cnt, jnp.where(redo, p, reset)), f)
            for (r, c, (upd, hi, lo, cnt, reset), f), p in zip(got, rps)]

  def finish(got, redo, invs, chunk_map, idxs=None):   # the writes, then the redo if needed
    subs_, out = apply(subs, masked(got, redo), chunk_map), [(r, c) for r, c, *_ in got]
    if idxs is not None:   # a redone step's rows come from the broadcast: no owner index
      idxs = [jnp.where(redo, -1, i) for i in idxs]

    def redo_by_broadcast(c):   # the broadcast's rows per slot -> per distinct id
      subs, out = broadcast(c[1])
      if invs is None:
        return False, subs, out
      return False, subs, [(jnp.full(r0.shape, -1, r.dtype).at[inv].set(r), n)
                           for (r, n), inv, (r0, _) in zip(out, invs, c[2])]
    _, subs_, out = jax.lax.while_loop(lambda c: c[0], redo_by_broadcast, (redo, subs_, out))
    return subs_, out, invs, idxs, redo

  if _one_shard(plan):   # whole tables on every device: its resolve on the batch's distinct ids
    R, got = plan.num_replicas, []
    gs = [x if R == 1 else jax.lax.all_gather(x, BATCH, axis=0, tiled=True) for x in xs]  # (R n, 2)
    caps = [min(_distinct_cap(plan, t, x), g.shape[0]) for t, x, g in zip(ts, xs, gs)]
    for x, (r, c, dec, fits) in zip(xs, _owner_resolve(
        plan, ts, maps_of(subs), gs, step, update, caps=caps, distinct=R == 1)):
      if R > 1:   # this device's slots of the global batch
        r = jax.lax.dynamic_slice(r, (jax.lax.axis_index(BATCH) * x.shape[0],), (x.shape[0],))
      got.append((r, c, dec, fits))
    redo = ~jnp.all(jnp.stack([f for *_, f in got]))   # the same ids, so the same on every device
    invs = [inv for (_, inv), *_ in got] if R == 1 else None
    got = [((r[0] if R == 1 else r), c, dec, f) for r, c, dec, f in got]
    return finish(got, redo, invs, False)
  if not _by_owner(plan):
    return (*broadcast(subs), None, None, jnp.bool_(True))
  owned = [_owners(plan, t, x) for t, x in zip(ts, xs)]
  caps = [_capacity(plan, t, x) for t, x in zip(ts, xs)]
  runs = jnp.stack([jnp.diff(e) for _, e in owned])                        # (T, S) my owner runs
  if plan.rw_exchange == "ragged":   # what each owner of my group receives, against M
    over = vma.pmax(jnp.any(jax.lax.psum(runs, "shard") > jnp.asarray(caps)[:, None])
                    .astype(jnp.int32), BATCH) > 0
    native = ragged.is_native(plan.mesh)

    def by_owner(maps):
      return _route_ragged(plan, ts, maps, xs, step, update, caps, owned, native)

    def nothing(maps):   # overflow: the fallback below resolves; same shapes, no writes
      out = jax.eval_shape(by_owner, maps)
      return [(jnp.full(r.shape, -1, r.dtype), jnp.zeros(c.shape, c.dtype),
               tuple(jnp.full(d.shape, v, d.dtype) for d, v in zip(dec, (p, 0, 0, 0, p))),
               jnp.bool_(True), jnp.full(i.shape, -1, i.dtype))
              for (r, c, dec, _, i), p in zip(out, rps)]

    got = jax.lax.cond(over, nothing, by_owner, maps_of(subs))
    flag = jnp.bool_(False)
  else:   # the padded route: a pair past its C sends its first C ids; flagged, redone
    got = _route_a2a(plan, ts, maps_of(subs), xs, step, update, caps, owned)
    over, flag = jnp.bool_(False), jnp.any(runs > jnp.asarray(caps)[:, None])
  slots = [plan.num_replicas * (c if plan.rw_exchange == "ragged" else plan.num_shards * c)
           for c in caps]                                                  # per owner
  if any(_distinct_cap(plan, t, x) < k for t, x, k in zip(ts, xs, slots)):
    flag = flag | jnp.any(jnp.stack([~f for _, _, _, f, _ in got]))   # an owner past its cap
  # one psum: the counters (the same on every replica: divided by R) and the flags
  both = jnp.concatenate([jnp.stack([c for _, c, *_ in got]).reshape(-1),
                          flag.astype(jnp.int32)[None]])
  both = jax.lax.psum(vma.to_varying(both, BATCH), BATCH)
  counts = both[:-1].reshape(len(ts), -1) // plan.num_replicas             # (T, 7)
  redo = over | (both[-1] > 0)
  idxs = [i for *_, i in got]
  got = [(r, c, dec, f) for (r, _, dec, f, _), c in zip(got, counts)]
  return finish(got, redo, [inv for (inv, *_), _ in owned], False, idxs)


def _feature_distinct(d_row, inv, start: int, size: int, d_idx=None):
  """One feature's distinct rows from its table's resolved ids, for `gather_rows` (what
  `exchange.rw_distinct` gives, without its sorts). d_row (n,): global row of each of the
  table's distinct ids on this device (-1: none; `d_row[inv]` = the rows of its id slots),
  inv (n,): each slot's distinct id (`_owners`, grouped by owner), the feature's slots
  [start, start + size) -> (uniq (size,): the rows
  of the feature's distinct ids in owner order (a row keys one id, so they are distinct
  rows; not ascending within an owner, which the row-wise routes do not need), `_BIG`
  (`layout.NO_ROW`) padded; the position in uniq of each of its slots (size,)).
    Example: d_row [9, 2, -1, -1], inv [0, 1, 0, 2], one feature (slot rows [9, 2, 9, -1])
    -> uniq [9, 2, _BIG, _BIG], positions [0, 1, 0, 2].
  With `d_idx` (n,) (the owner's distinct index of each distinct id, `_with_owner_index`)
  also those of uniq (size,), -1 padded, as a third output."""
  n = d_row.shape[0]
  mine = inv[start:start + size]                                           # (size,)
  used = d_row >= 0
  if size < n:   # else the table's only feature: every distinct id is one of its
    used = jnp.zeros((n,), bool).at[mine].set(True) & used
  pos = (jnp.cumsum(used) - 1).astype(jnp.int32)                           # place in uniq
  at = jnp.where(used, pos, size)                                          # size: dropped
  uniq = jnp.full((size,), _BIG, jnp.int32).at[at].set(d_row, mode="drop")
  none = jnp.minimum(pos[-1] + 1, size - 1)    # the first padding slot (exists if any is used)
  out = uniq, jnp.where(used, pos, none)[mine]
  if d_idx is None:
    return out
  return *out, jnp.full((size,), -1, jnp.int32).at[at].set(d_idx, mode="drop")


def _write_width(slots: int) -> int:
  """Writes per chunk of `_apply_writes` for a route of `slots` resolved ids: half of them
  (usually one chunk: the owner route's slots are sized with room over the distinct ids
  expected), 64 to 4,096."""
  return int(min(4096, max(64, slots // 2)))


def _chunks(valid, width: int, body, carry):
  """carry = body(sel, carry) over the positions where `valid` (N,) holds, `width` at a
  time (sel (width,) int32: the next `width` of them in order, N past the last): a while
  loop of ceil(count / width) chunks. A scatter on XLA:CPU costs every update slot, real
  or dropped, so the writes go by the count, not by the route's N padded slots.
    Example: valid = [0, 1, 1, 0, 1], width 2: csum = [0, 1, 2, 2, 3], chunk 0 selects
    the 1st and 2nd valid positions, searchsorted(csum, [1, 2]) = [1, 2]; chunk 1
    [3, 4] -> [4, 5] (5 = N: none); then 2 x 2 >= 3 stops."""
  csum = jnp.cumsum(valid.astype(jnp.int32))                               # (N,)
  j = jnp.arange(1, width + 1, dtype=jnp.int32)

  def step(c):
    i, carry = c
    return i + 1, body(jnp.searchsorted(csum, i * width + j).astype(jnp.int32), carry)
  return jax.lax.while_loop(lambda c: c[0] * width < csum[-1], step, (jnp.int32(0), carry))[1]


def _apply_writes(plan: EmbeddingPlan, t: TableConfig, st: dict, dec, step, key, width: int,
                  chunk_map: bool):
  """The route's writes (`_owner_resolve`, padded to N slots, rps: none) into this owner's
  buffers: the map rows written (key, last = step, count), and the rows taken by new ids
  restarted (fresh weights from `_fresh_rows`, default optimizer slots), `width` at a time
  by their count (`_chunks`): a step of hits draws no fresh rows. The map writes go in one
  scatter per leaf over the N slots (the owner route: N ~ its distinct ids, most of them
  written: hits and inserts), or by the count too with `chunk_map` (the broadcast route: N
  = the global batch's slots, ~1/S of them this owner's)."""
  upd, hi, lo, cnt, reset = dec          # (N,) each; a row re-initialised is also a map write
  rps = plan.buffers[plan.buffer_of[t.name]].local_rows
  shard = jax.lax.axis_index("shard")
  at = lambda v, sel, fill=0: jnp.take(v, sel, mode="fill", fill_value=fill)  # noqa: E731

  acc0 = plan.buffers[plan.buffer_of[t.name]].optimizer.initial_accumulator
  default = {"weight": None, "accumulator": acc0, "m": 0.0, "v": 0.0}

  def map_write(u, h, lo_, c, b):   # u (w,): map rows (rps: drop)
    return {"map_hi": b["map_hi"].at[u].set(h, mode="drop"),
            "map_lo": b["map_lo"].at[u].set(lo_, mode="drop"),
            "map_last": b["map_last"].at[u].set(jnp.broadcast_to(step, u.shape), mode="drop"),
            "map_count": b["map_count"].at[u].set(c, mode="drop")}

  def map_chunk(sel, b):
    return map_write(at(upd, sel, rps), at(hi, sel), at(lo, sel), at(cnt, sel), b)

  def row_chunk(sel, b):   # sel: the next `width` rows re-initialised
    r = at(reset, sel, rps)                                                # (width,) rps: drop
    fresh = _fresh_rows(t, key, shard * rps + jnp.minimum(r, rps - 1))     # (width, D)
    return {k: b[k].at[r].set(fresh.astype(b[k].dtype) if default[k] is None else default[k],
                              mode="drop") for k in b}

  maps = {k: st[k] for k in _MAP_ROWS}
  maps = (_chunks(upd != rps, width, map_chunk, maps) if chunk_map
          else map_write(upd, hi, lo, cnt, maps))
  rows = _chunks(reset != rps, width, row_chunk, {k: st[k] for k in default if k in st})
  return {**st, **maps, **rows}


def resolve(plan: EmbeddingPlan, state: dict, ids: dict, step, key=None, update: bool = True,
            distinct: bool = False):
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
    distinct: also return the managed features' distinct rows per device, as
      `gather_rows(..., distinct=)` takes them: the lookup then skips its own
      deduplication (two sorts per feature and device), which the resolve did already.
  Returns:
    (state, ids with every managed feature as int32 (B, bag) global rows, -1 at padding
    and at ids left without a row, {table: {counter: int32 ()}}, see the module doc),
    and with `distinct` a fourth: {feature: (uniq (R S n,), inverse (B, bag))} (n = b x
    bag per device; `_feature_distinct`), {} when the resolve does not deduplicate each
    device's ids (several replicas of whole tables, or `rw_exchange='broadcast'`). By
    owner (S > 1) each also carries a third entry (R S n,): the owner's distinct index of
    each uniq row, -1 at padding and in a step redone by broadcast, which the update uses
    to sum the rows' gradients without sorting them (`update.apply_sparse_updates`).
  """
  names = plan.managed_tables()
  if not names:
    return (state, ids, {}, {}) if distinct else (state, ids, {})
  specs = plan.state_specs()
  bufs = [plan.buffer_of[t] for t in names]
  feats = {t: [f for f, c in plan.features.items() if c.table == t] for t in names}
  key = jax.random.fold_in(jax.random.key(0) if key is None else key, step)

  with_distinct = distinct and _device_distinct(plan)
  by_owner = _by_owner(plan)   # the distinct rows come with their owner's index

  def body(sub, raw, step, key):
    rows, counters, dist = {}, {}, {}
    xs = [jnp.concatenate([raw[f].reshape(-1, 2) for f in feats[t]]) for t in names]  # (n, 2)
    ts = [plan.tables[t] for t in names]
    keys = [jax.random.fold_in(key, i) for i in range(len(ts))]
    subs, got, invs, idxs, redo = _resolve_all(plan, ts, [dict(sub[b]) for b in bufs], xs,
                                               step, keys, update)
    new = dict(zip(bufs, subs))
    for i, t in enumerate(names):
      fs, (r, c) = feats[t], got[i]
      if update:
        new[bufs[i]]["map_used"] = sub[bufs[i]]["map_used"] + c[6]
        counters[t] = dict(zip(_RESOLVED, c[:6]), used=new[bufs[i]]["map_used"],
                           broadcast=redo.astype(jnp.int32))
      d_row, r = (r, r[invs[i]]) if invs else (None, r)     # (n,) per distinct id, per slot
      off = 0
      for f in fs:
        b, bag = raw[f].shape[:2]
        rows[f] = r[off:off + b * bag].reshape(b, bag)
        if with_distinct:
          uniq, inv, *idx = _feature_distinct(d_row, invs[i], off, b * bag,
                                              idxs[i] if idxs else None)
          dist[f] = (uniq, inv.reshape(b, bag), *idx)
        off += b * bag
    return new, rows, counters, dist

  mfeats = [f for t in names for f in feats[t]]
  sub_specs = {b: specs[b] for b in bufs}
  in_specs = (sub_specs, {f: P(BATCH, None, None) for f in mfeats}, P(), P())
  out_specs = (sub_specs, {f: P(BATCH, None) for f in mfeats},
               {t: {c: P() for c in COUNTERS} for t in names} if update else {},
               {f: (P(BATCH), P(BATCH, None), *(P(BATCH),) * by_owner) for f in mfeats}
               if with_distinct else {})
  # check_vma=False: the maps and counters are replicated over 'replica' (and the counters
  # over 'shard') by construction: every device resolves the same global ids.
  fn = jax.shard_map(body, mesh=plan.mesh, in_specs=in_specs, out_specs=out_specs,
                     check_vma=False)
  sub, rows, counters, dist = fn({b: state[b] for b in bufs}, {f: ids[f] for f in mfeats},
                                 jnp.asarray(step, jnp.int32), key)
  out = ({**state, **sub} if update else state), {**ids, **rows}, (counters if update else {})
  return (*out, dist) if distinct else out


def step_metrics(plan: EmbeddingPlan, counters: dict) -> dict:
  """Float32 metrics of `resolve`'s counters: per table `mc_<counter>/<table>` (ids, hits,
  inserts, evictions, expired, collisions per step) and `mc_occupancy/<table>` (used /
  rows); over all managed tables `mc_hit_rate` (hits / ids), `mc_collisions` and
  `mc_broadcast` (1 in a step resolved by broadcast: averaged over a log interval, the
  share of such steps)."""
  out = {}
  for t, c in counters.items():
    for k in _RESOLVED:
      out[f"mc_{k}/{t}"] = c[k].astype(jnp.float32)
    out[f"mc_occupancy/{t}"] = c["used"].astype(jnp.float32) / plan.tables[t].rows
  if counters:
    ids = sum(c["ids"] for c in counters.values())
    out["mc_hit_rate"] = (sum(c["hits"] for c in counters.values()).astype(jnp.float32)
                          / jnp.maximum(ids, 1).astype(jnp.float32))
    out["mc_collisions"] = sum(c["collisions"] for c in counters.values()).astype(jnp.float32)
    out["mc_broadcast"] = next(iter(counters.values()))["broadcast"].astype(jnp.float32)
  return out


# ---- host side (serving) -------------------------------------------------------------
def host_map(map_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """A canonical map's raw ids (rows,) int64 (-1 = empty, `join_ids` of map_hi/map_lo) ->
  (its ids ascending, their rows): the lookup table of `host_rows`."""
  map_ids = np.asarray(map_ids, np.int64)
  rows = np.flatnonzero(map_ids >= 0)
  order = np.argsort(map_ids[rows], kind="stable")
  return map_ids[rows][order], rows[order].astype(np.int32)


def host_rows(raw: np.ndarray, lookup: tuple[np.ndarray, np.ndarray], feature: str,
              table: str) -> np.ndarray:
  """Raw ids -> int32 rows by a `host_map` lookup: the map's row, -1 for padding and for ids
  not in the map (never seen or evicted: zero embeddings). Bad ids raise as `split_ids`."""
  x = join_ids(split_ids(raw, feature, table))
  keys, rows = lookup
  if not len(keys):
    return np.full(x.shape, -1, np.int32)
  pos = np.minimum(np.searchsorted(keys, x), len(keys) - 1)
  return np.where((x >= 0) & (keys[pos] == x), rows[pos], -1).astype(np.int32)
