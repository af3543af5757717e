"""Managed-collision tables against the plain-Python model (tests/managed_reference.py).

A stream of known ids (inserts, hits, evictions, TTL expiry, full windows) is resolved
and trained on one mesh, exported, imported onto another mesh and continued: rows,
counters and the map must equal the reference's at every step.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_mesh
from gem_jax.embedding import (FeatureConfig, SparseOptimizerConfig, TableConfig, export_state,
                               gather_rows, hash_ids, id_stats, import_state, init_embedding_state,
                               managed, normal_init, plan_embeddings, pool_rows, prepare_ids,
                               apply_sparse_updates)
from gem_jax.embedding import distinct_ids
from gem_jax.embedding import update as update_lib
from managed_reference import RefMap

ROWS, K, B = 64, 4, 16


def _plan(mesh, eviction, ttl, exchange="a2a", distinct=1.0):
  """`distinct` < 1: routes sized for that share of distinct ids (as from id statistics),
  so busy steps overflow them and take the broadcast path."""
  t = TableConfig("u", rows=ROWS, dim=4, id_policy="managed", probe=K, eviction=eviction,
                  ttl_steps=ttl)
  feats = [FeatureConfig("u", "u", bag=2), FeatureConfig("u_hist", "u", bag=3, pooling="none")]
  return plan_embeddings([t], feats, mesh, batch_size=B, rw_exchange=exchange,
                         optimizer=SparseOptimizerConfig("rowwise_adagrad", lr=0.1),
                         distinct_share={"u": distinct, "u_hist": distinct})


def _step_fn(plan, distinct=True, f=lambda e: e):
  """The trainer's step on managed tables: resolve, lookup (by default with the resolve's
  distinct rows, as the trainer does), loss sum(f(embeddings)), the sparse update."""
  def step(state, ids, step):
    state, rows, counters, known = managed.resolve(plan, state, ids, step, jax.random.key(7),
                                                   distinct=True)
    r, ctx = gather_rows(plan, state, rows, known if distinct else None)
    loss = lambda r: sum(jnp.sum(f(e)) for e in pool_rows(plan, r, ctx).values())  # noqa: E731
    g = jax.grad(loss)(r)
    return apply_sparse_updates(plan, state, ctx, g), rows, counters
  return jax.jit(step, donate_argnums=0)


def _stream(seed, steps):
  """Batches of raw 64-bit ids drawn from a population that drifts (new ids every step),
  with padding; the ids are spread over the whole 63-bit range."""
  rng = np.random.default_rng(seed)
  pop = rng.integers(0, 1 << 62, 400, dtype=np.int64) * 2 + 1
  out = []
  for s in range(steps):
    live = pop[5 * s: 5 * s + 60]                       # a window sliding over the population
    b = {"u": rng.choice(live, (B, 2)), "u_hist": rng.choice(live, (B, 3))}
    b["u_hist"][rng.random((B, 3)) < 0.3] = -1
    out.append(b)
  return out


def _check(plan, state, host, rows, counters, ref, step, table="u"):
  """Rows, counters and map of managed `table` (its features' ids in `host`) against `ref`."""
  fs = [f for f, c in plan.features.items() if c.table == table]
  flat = np.concatenate([host[f].ravel() for f in fs])
  want, want_c = ref.step(flat, step)
  got = {k: int(v) for k, v in counters[table].items()}
  route = got.pop("broadcast")                      # the route, not the policy: not in ref
  assert got == want_c, (table, step)
  for f in fs:
    exp = np.vectorize(lambda x: -1 if x == -1 or want[int(x)] is None else want[int(x)])(host[f])
    np.testing.assert_array_equal(np.asarray(rows[f]), exp, err_msg=f"step {step} {f}")
  canon = jax.tree.map(np.asarray, export_state(plan, state))[table]
  ids, last, count = ref.arrays()
  got = managed.join_ids(np.stack([canon["map_hi"], canon["map_lo"]], -1))
  np.testing.assert_array_equal(got, ids)
  occ = ids >= 0
  np.testing.assert_array_equal(canon["map_last"][occ], last[occ])
  np.testing.assert_array_equal(canon["map_count"][occ], count[occ])
  return want, {**want_c, "broadcast": route}


@pytest.mark.parametrize("first,second,eviction,ttl,exchange,distinct", [
    pytest.param((1, 8), (2, 4), "lru", 0, "a2a", 1.0, marks=pytest.mark.slow),
    ((2, 4), (4, 2), "lfu", 3, "a2a", 1.0),
    ((2, 4), (1, 8), "lru", 3, "ragged", 1.0),
    ((1, 1), (2, 4), "lru", 3, "a2a", 1.0),
    pytest.param((1, 8), (4, 2), "lfu", 0, "ragged", 0.3, marks=pytest.mark.slow),
    pytest.param((4, 2), (1, 8), "lru", 3, "a2a", 0.2, marks=pytest.mark.slow),
    pytest.param((4, 2), (1, 8), "lru", 3, "broadcast", 1.0, marks=pytest.mark.slow)])
def test_stream_matches_reference_across_restore(first, second, eviction, ttl, exchange,
                                                 distinct):
  """Ids routed to their owners (padded a2a, or ragged as on GPU, emulated on CPU), through
  routes sized for fewer distinct ids (0.2-0.3), so that about half or most of the steps
  overflow them, or by broadcast (the overflow path, forced); on one device (1 x 1) no
  route: the device resolves its distinct ids itself."""
  ref = RefMap(ROWS, K, eviction, ttl)
  stream = _stream(hash((first, eviction)) % 1000, 8)
  totals = dict.fromkeys(managed.COUNTERS, 0)
  plan = _plan(make_mesh(*first), eviction, ttl, exchange, distinct)
  state = init_embedding_state(plan, jax.random.key(0))
  step_fn = _step_fn(plan)
  for step, host in enumerate(stream):
    if step == 4:                                        # checkpoint -> another mesh
      canon = jax.tree.map(np.asarray, export_state(plan, state))
      plan = _plan(make_mesh(*second), eviction, ttl, exchange, distinct)
      state, step_fn = import_state(plan, canon), _step_fn(plan)
    ids = jax.device_put(prepare_ids(plan, host), plan.ids_shardings())
    state, rows, counters = step_fn(state, ids, step)
    want, c = _check(plan, state, host, rows, counters, ref, step)
    totals = {k: totals[k] + c[k] for k in totals}
    # Rows taken this step start fresh: the accumulator of a just-inserted id is its one
    # update's g^2 (sum loss: g = 1 per slot, mean over the 4 columns of count^2).
    acc = np.asarray(export_state(plan, state)["u"]["accumulator"])
    flat = np.concatenate([host[f].ravel() for f in plan.features])
    for x, r in want.items():
      if x in ref.inserted:
        n = int(np.sum(flat == x))
        assert acc[r] == pytest.approx(n * n), (step, x)
  assert totals["evictions"] > 0 and totals["hits"] > 0
  if exchange == "broadcast":                 # every step, counted
    assert totals["broadcast"] == len(stream)
  elif distinct < 1:                          # routes sized too small: some steps, counted
    assert totals["broadcast"] > 0
  else:                                       # routes for every slot: never
    assert totals["broadcast"] == 0
  if ttl:
    assert totals["expired"] > 0



@pytest.mark.parametrize("exchange", ["a2a", "ragged"])
def test_tables_of_one_exchange_match_their_references(exchange):
  """Four managed tables of different windows, policies, TTLs, sizes and route sizes travel
  in one exchange (`_route_a2a`: side by side in each (device, owner) row; ragged: one
  exchange each) and are resolved together (`_owner_resolve`: "u" with "w" and "v" with
  "x" in one policy pass each, concatenated); "v"'s routes are sized for 2 distinct ids per
  (device, owner) on the padded route, so its odd steps (up to 6) overflow them and every
  table takes the broadcast path, its even ones (2) do not (ragged: routes of full size,
  never overflowing): each table's rows, counters and map equal its own reference's."""
  tables = [TableConfig("u", rows=ROWS, dim=4, id_policy="managed", probe=K, ttl_steps=3),
            TableConfig("v", rows=2 * ROWS, dim=4, id_policy="managed", probe=8,
                        eviction="lfu"),
            TableConfig("w", rows=3 * ROWS, dim=4, id_policy="managed", probe=K, ttl_steps=5),
            TableConfig("x", rows=ROWS, dim=4, id_policy="managed", probe=8, eviction="lfu")]
  feats = [FeatureConfig(t.name, t.name, bag=3 if t.eviction == "lfu" else 2) for t in tables]
  plan = plan_embeddings(tables, feats, make_mesh(2, 4), batch_size=B, rw_exchange=exchange,
                         optimizer=SparseOptimizerConfig("rowwise_adagrad", lr=0.1),
                         distinct_share={"v": 0.02} if exchange == "a2a" else {})
  if exchange == "a2a":
    assert plan.managed_capacity("u")[0] == 4 and plan.managed_capacity("v")[0] == 2
  refs = {t.name: RefMap(t.rows, t.probe, t.eviction, t.ttl_steps) for t in tables}
  state, step_fn = init_embedding_state(plan, jax.random.key(0)), _step_fn(plan)
  rng = np.random.default_rng(5)
  pops = {t: rng.integers(0, 1 << 62, 400, dtype=np.int64) * 2 + 1 for t in refs}
  seen, by_broadcast = dict.fromkeys(["evictions", "hits", "expired"], 0), []
  for step in range(8):
    live = {t: p[5 * step: 5 * step + 60] for t, p in pops.items()}
    if step % 2 == 0:                  # 2 distinct ids of "v": no route overflows
      live["v"] = live["v"][:2]
    host = {f.name: rng.choice(live[f.table], (B, f.bag)) for f in feats}
    for f in ("v", "x"):
      host[f][rng.random((B, 3)) < 0.2] = -1
    ids = jax.device_put(prepare_ids(plan, host), plan.ids_shardings())
    state, rows, counters = step_fn(state, ids, step)
    routes = set()
    for t, ref in refs.items():
      c = _check(plan, state, host, rows, counters, ref, step, t)[1]
      seen = {k: seen[k] + c[k] for k in seen}
      routes.add(c["broadcast"])
    assert len(routes) == 1                   # one route for every table of the step
    by_broadcast.append(routes.pop())
  assert seen["evictions"] > 0 and seen["hits"] > 0 and seen["expired"] > 0
  assert not any(by_broadcast[::2]) and (any(by_broadcast[1::2]) or exchange == "ragged")


@pytest.mark.parametrize("force", ["sort", "fingerprint_ties", "refined_ties"])
def test_every_dedup_path_matches_reference(force, monkeypatch):
  """The exact sort (always, or after ties in both single-key sorts), the refining second
  sort (after ties in the first) and the single-key path give the reference's rows and maps:
  all order a window's misses by (fingerprint, id)."""
  if force == "sort":
    monkeypatch.setattr(distinct_ids, "key_bits", lambda leads: None)
  else:                               # 2-bit fingerprints: ties in most steps
    monkeypatch.setattr(distinct_ids, "key_bits", lambda leads: 2)
  if force == "refined_ties":         # and 1 more bit: ties left for the exact sort
    monkeypatch.setattr(distinct_ids, "refine_bits", lambda slots, bits: 1)
  ref = RefMap(ROWS, K, "lru", 3)
  plan = _plan(make_mesh(2, 4), "lru", 3)
  state, step_fn = init_embedding_state(plan, jax.random.key(0)), _step_fn(plan)
  for step, host in enumerate(_stream(11, 6)):
    ids = jax.device_put(prepare_ids(plan, host), plan.ids_shardings())
    state, rows, counters = step_fn(state, ids, step)
    _check(plan, state, host, rows, counters, ref, step)


@pytest.mark.parametrize("bits,refine,taken", [(None, None, "first"), (9, None, "refined"),
                                               (9, 1, "sort")])
def test_dedup_paths_equal_the_exact_sort(bits, refine, taken, monkeypatch):
  """`_distinct` on 20,000 Zipf ids (5 % padding, occurrence weights) over 50 leads equals
  the 6-operand sort bit for bit on each of its paths, each shown taken: the first key
  exact (32 - 6 bits of fingerprint), its ties split by the refining key (9 bits: the 9,495
  distinct ids, ~190 a lead, tie in most leads), and ties left after both (1 refining
  bit)."""
  rng = np.random.default_rng(1)
  g, hi, lo, valid, lead = _zipf_ids(rng, 50)
  w = jnp.asarray(rng.integers(1, 4, g.shape[0]).astype(np.int32))
  if bits:
    monkeypatch.setattr(distinct_ids, "key_bits", lambda leads: bits)
  if refine:
    monkeypatch.setattr(distinct_ids, "refine_bits", lambda slots, bits: refine)
  b = distinct_ids.key_bits(50)
  fp = distinct_ids.fingerprint(hi, lo)
  first, exact1 = distinct_ids.distinct_keyed(hi, lo, lead, w,
                                              distinct_ids.first_key(fp, lead, valid, b))
  r = distinct_ids.refine_bits(g.shape[0], b)
  exact2 = distinct_ids.distinct_keyed(hi, lo, lead, w,
                                       distinct_ids.refined_key(fp, first[0], valid, b, r))[1]
  assert taken == ("first" if exact1 else "refined" if exact2 else "sort")
  _assert_equal(distinct_ids.distinct(g, lead, 50, w),
                distinct_ids.distinct_sorted(hi, lo, lead, w))


@pytest.mark.parametrize("leads", [1 << 25, 1 << 30])
def test_dedup_with_few_key_bits_equals_the_exact_sort(leads):
  """A shard with millions of windows leaves the key 6 fingerprint bits (2^25 leads) or
  one (2^30): the single-key sorts still give the exact sort's result (before, fewer than
  8 bits always took the exact sort)."""
  assert distinct_ids.key_bits(leads) == (6 if leads == 1 << 25 else 1)
  g, hi, lo, _, lead = _zipf_ids(np.random.default_rng(2), leads)
  _assert_equal(distinct_ids.distinct(g, lead, leads),
                distinct_ids.distinct_sorted(hi, lo, lead, jnp.ones(g.shape[:1], jnp.int32)))


def _zipf_ids(rng, leads: int):
  """20,000 Zipf raw ids (5 % padding) as (g (M, 2), hi, lo, valid, lead = window_of over
  `leads`, `_BIG` at padding), for `_distinct`."""
  raw = hash_ids(rng.zipf(1.1, 20_000).astype(np.int64), 1 << 62)
  raw[rng.random(raw.shape) < 0.05] = -1
  g = jnp.asarray(managed.split_ids(raw, "f", "t"))
  valid = g[:, 0] >= 0
  hi, lo = g[:, 0], jnp.where(valid, g[:, 1], 0)
  return g, hi, lo, valid, jnp.where(valid, managed.window_of(hi, lo, leads), managed._BIG)


def _assert_equal(got, want):
  for a, e in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def _most_per_owner(plan, host) -> int:
  """The most distinct raw ids of table u in batch `host` that one owner's windows hold."""
  rps = plan.buffers[plan.buffer_of["u"]].local_rows
  flat = np.unique(np.concatenate([host[f].ravel() for f in plan.features]))
  pairs = managed.split_ids(flat[flat >= 0], "u", "u")
  return np.bincount(managed.window_of(pairs[:, 0], pairs[:, 1], ROWS // K, xp=np) * K // rps).max()


@pytest.mark.parametrize("exchange,mesh,cap", [
    ("a2a", (2, 4), 14),  # the stream's most distinct ids per owner: 14, 13, 16, 13, 16, 14
    ("ragged", (2, 4), 14),
    ("a2a", (1, 1), 40)],   # one device, the batch's distinct ids: 39, 37, 43, 41, 43, 38
    ids=["a2a-2x4", "ragged-2x4", "one_device"])
def test_owner_past_its_distinct_cap_redoes_the_step(exchange, mesh, cap, monkeypatch):
  """An owner resolves at most `_distinct_cap` distinct ids (either route, or one device
  resolving its own); in a step where some owner holds more, no write of the capped resolve
  lands and every table is resolved again by broadcast: rows and maps still equal the
  reference's."""
  monkeypatch.setattr(managed, "_distinct_cap", lambda plan, t, x: cap)
  ref = RefMap(ROWS, K, "lru", 3)
  plan = _plan(make_mesh(*mesh), "lru", 3, exchange)
  state, step_fn = init_embedding_state(plan, jax.random.key(0)), _step_fn(plan)
  over = []
  for step, host in enumerate(_stream(13, 6)):
    ids = jax.device_put(prepare_ids(plan, host), plan.ids_shardings())
    state, rows, counters = step_fn(state, ids, step)
    route = _check(plan, state, host, rows, counters, ref, step)[1]["broadcast"]
    over.append(_most_per_owner(plan, host) > cap)
    assert route == over[-1], step            # the redo is counted, and only it
  assert any(over) and not all(over)


def test_id_stats_of_a_managed_table_count_raw_ids_and_cap_the_owners():
  """Id statistics count a managed table's distinct raw ids (not rows hashed into it: a small
  table merges them), per device and per global batch; the owner's cap (`_distinct_cap`)
  follows the batch's distinct ids, holds every owner's distinct ids of a stream planned
  from its own statistics, and the stream still matches the reference."""
  t = TableConfig("u", rows=ROWS, dim=4, id_policy="managed", probe=K, eviction="lru")
  feats = [FeatureConfig("u", "u", bag=2), FeatureConfig("u_hist", "u", bag=3, pooling="none")]
  stream = _stream(17, 6)
  st = id_stats([t], feats, stream, num_devices=8, num_shards=4)
  want = max(np.unique(h["u"][h["u"] >= 0]).size / h["u"].size for h in stream)
  assert st["u"].batch_distinct_share == pytest.approx(want)
  per_dev = np.mean([np.unique(d[d >= 0]).size / d.size for h in stream
                     for d in np.split(h["u"], 8)])
  assert st["u"].distinct_share == pytest.approx(per_dev)
  distinct = np.arange(B * 2, dtype=np.int64).reshape(B, 2) * 7919 + 1   # 32 ids, 64 rows
  many = id_stats([t], feats[:1], [{"u": distinct}], num_devices=8, num_shards=4)["u"]
  assert many.batch_distinct_share == 1.0 and many.distinct_share == 1.0  # not hashed

  plan = plan_embeddings([t], feats, make_mesh(2, 4), B, rw_exchange="a2a", id_stats=st,
                         optimizer=SparseOptimizerConfig("rowwise_adagrad", lr=0.1))
  x = jnp.zeros((B // 8 * 5, 2), jnp.int32)                               # one device's ids
  cap = managed._distinct_cap(plan, t, x)
  assert cap < managed._distinct_cap(_plan(make_mesh(2, 4), "lru", 0), t, x)
  ref = RefMap(ROWS, K, "lru", 0)
  state, step_fn = init_embedding_state(plan, jax.random.key(0)), _step_fn(plan)
  for step, host in enumerate(stream):
    ids = jax.device_put(prepare_ids(plan, host), plan.ids_shardings())
    state, rows, counters = step_fn(state, ids, step)
    _check(plan, state, host, rows, counters, ref, step)
    assert _most_per_owner(plan, host) <= cap                             # no redo needed


def _one_feature_each_plan(mesh, exchange):
  """Tables "u" and "v", one feature each (the resolve's distinct rows of a table's only
  feature: `managed._feature_distinct` without its membership scatter); "v"'s routes are
  sized for 2 distinct ids per (device, owner), so busy steps take the broadcast path."""
  tables = [TableConfig("u", rows=ROWS, dim=4, id_policy="managed", probe=K),
            TableConfig("v", rows=ROWS, dim=4, id_policy="managed", probe=K)]
  return plan_embeddings(tables, [FeatureConfig("u", "u", bag=2), FeatureConfig("v", "v", bag=3)],
                         mesh, batch_size=B, rw_exchange=exchange,
                         optimizer=SparseOptimizerConfig("rowwise_adagrad", lr=0.1),
                         distinct_share={"v": 0.02})


@pytest.mark.parametrize("tables", ["shared", "one_feature_each"])
@pytest.mark.parametrize("exchange,mesh", [("a2a", (2, 4)), ("ragged", (2, 4)), ("a2a", (1, 8)),
                                           ("a2a", (1, 1))],
                         ids=["a2a-2x4", "ragged-2x4", "a2a-1x8", "one_device"])
def test_lookup_with_the_resolves_distinct_rows_equals_its_own_dedup(exchange, mesh, tables,
                                                                      monkeypatch):
  """`gather_rows` with the resolve's distinct rows (no sort, owner order) gives the same
  embeddings, gradients and updated tables, bit for bit, as with its own deduplication
  (`rw_distinct`), over a stream with inserts, evictions and ids left without a row: two
  features of one table, or one feature per table with steps redone by broadcast (on one
  device: the one resolve's distinct rows). By owner, the update sums the rows' gradients
  by the resolve's owner index (replicas gathering it, 2 x 4; two features of one table,
  1 x 8; steps redone by broadcast fall back to the sort)."""
  if mesh == (1, 1) and tables != "shared":   # one device: "v" resolves at most 27 distinct
    cap = managed._distinct_cap    # ids; it gets 30, 26, 25, 27, 23, 28: steps 0, 5 are redone
    monkeypatch.setattr(managed, "_distinct_cap",
                        lambda p, t, x: min(cap(p, t, x), 27) if t.name == "v" else cap(p, t, x))
  mesh = make_mesh(*mesh)
  plan = _plan(mesh, "lru", 0, exchange) if tables == "shared" else _one_feature_each_plan(
      mesh, exchange)
  f = lambda e: e * jnp.cos(e)  # noqa: E731  (a gradient that differs per row)
  fast, slow = _step_fn(plan, f=f), _step_fn(plan, distinct=False, f=f)
  a, b = (init_embedding_state(plan, jax.random.key(0)) for _ in range(2))
  by_index = []   # the owners sum by the resolve's index (by owner) instead of sorting
  sum_by_index = update_lib._sum_by_index
  monkeypatch.setattr(update_lib, "_sum_by_index",
                      lambda *a: (by_index.append(1), sum_by_index(*a))[1])
  collisions, broadcast = 0, 0
  for step, host in enumerate(_stream(19, 6)):
    if tables != "shared":
      host = {"u": host["u"], "v": host["u_hist"]}
    ids = jax.device_put(prepare_ids(plan, host), plan.ids_shardings())
    a, rows_a, counters = fast(a, ids, step)
    if step == 0:
      summed_by_owner = plan.num_shards > 1 and any(   # (a 'dense' replica sync sums anyway)
          plan.buffers[t].sync != "dense" for t in plan.managed_tables())
      assert bool(by_index) == summed_by_owner
      traced = len(by_index)
    b, rows_b, _ = slow(b, ids, step)
    assert len(by_index) == traced            # the lookup's own dedup: no owner index
    collisions += sum(int(c["collisions"]) for c in counters.values())
    broadcast += int(counters["u"]["broadcast"])
    assert all(np.array_equal(rows_a[f], rows_b[f]) for f in rows_a)
    for buf in a:
      for k in a[buf]:
        np.testing.assert_array_equal(np.asarray(a[buf][k]), np.asarray(b[buf][k]), err_msg=k)
  assert collisions > 0
  assert (broadcast > 0) == (tables != "shared")


def test_sum_by_owner_index_equals_the_sorted_dedup():
  """`update._sum_by_index` sums duplicate rows by their owner index, in index order, as
  `dedup_rows` sums them (the same order of additions: bit-identical sums); a row without
  an index in range (a step redone by broadcast) sends the owner to `dedup_rows`."""
  g = jnp.asarray(np.random.default_rng(0).normal(size=(5, 3)), jnp.float32)
  rows = jnp.asarray([3, 7, 3, -1, 9], jnp.int32)
  uniq, summed = update_lib._sum_by_index(rows, g, jnp.asarray([1, 0, 1, -1, 2], jnp.int32))
  np.testing.assert_array_equal(np.asarray(uniq), [7, 3, 9, -1, -1])
  want = np.stack([g[1], g[0] + g[2], g[4], 0 * g[0], 0 * g[0]])
  np.testing.assert_array_equal(np.asarray(summed), want)
  sorted_rows, sorted_sums = update_lib.dedup_rows(rows, g)
  np.testing.assert_array_equal(np.asarray(sorted_rows), [3, 7, 9, -1, -1])
  for bad in ([1, -1, 1, -1, 2], [1, 0, 1, -1, 5]):   # no index; an index past the slots
    got = update_lib._sum_by_index(rows, g, jnp.asarray(bad, jnp.int32))
    for x, y in zip(got, (sorted_rows, sorted_sums)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_fresh_rows_follow_the_initializer_per_row():
  """Fresh rows: the initializer's distribution, a function of (key, row) only."""
  t = TableConfig("u", rows=10_000, dim=64, id_policy="managed")
  key = jax.random.key(3)
  rows = jnp.arange(4096, dtype=jnp.int32)
  w = np.asarray(managed._fresh_rows(t, key, rows))                       # (4096, 64)
  s = 1 / np.sqrt(t.rows)
  assert np.abs(w).max() <= s and abs(w.mean()) < 0.01 * s
  assert w.std() == pytest.approx(s / np.sqrt(3), rel=0.01)
  assert abs(np.corrcoef(w[:-1].ravel(), w[1:].ravel())[0, 1]) < 0.01     # rows r, r + 1
  assert abs(np.corrcoef(w[:, :-1].ravel(), w[:, 1:].ravel())[0, 1]) < 0.01
  again = np.asarray(managed._fresh_rows(t, key, rows[::-1][:7]))
  np.testing.assert_array_equal(again, w[::-1][:7])                       # any order, any batch
  other = np.asarray(managed._fresh_rows(t, jax.random.fold_in(key, 1), rows[:7]))
  assert not np.any(other == w[:7])
  tn = TableConfig("u", rows=10_000, dim=64, id_policy="managed", initializer=normal_init(0.02))
  wn = np.asarray(managed._fresh_rows(tn, key, rows))
  assert wn.std() == pytest.approx(0.02, rel=0.01) and abs(wn.mean()) < 0.001


def test_an_expired_id_takes_its_own_row_back():
  """An id seen again after its TTL re-enters its own (re-initialised) row, not a second
  row: the map never holds a key twice, so inference (which reads any id in the map)
  reads the row training uses."""
  plan = _plan(make_mesh(1, 2), "lru", 2)
  state = init_embedding_state(plan, jax.random.key(0))
  ref = RefMap(ROWS, K, "lru", 2)
  step = _step_fn(plan)
  x = np.array([[11, -1]] * B, np.int64)
  batch = {"u": x, "u_hist": np.full((B, 3), -1, np.int64)}
  rows = {}
  for s in (0, 3):                                # 3 - 0 >= ttl: expired at step 3
    host = prepare_ids(plan, batch)
    state, rows[s], counters = step(state, host, s)
    want, want_c = _check(plan, state, batch, rows[s], counters, ref, s)
  assert int(rows[0]["u"][0, 0]) == int(rows[3]["u"][0, 0]) == want[11]
  assert want_c["expired"] == want_c["inserts"] == 1 and want_c["used"] == 1
  ids = managed.join_ids(np.stack([np.asarray(export_state(plan, state)["u"][k])
                                   for k in ("map_hi", "map_lo")], -1))
  assert (ids == 11).sum() == 1
  _, got, _ = jax.jit(lambda st, i: managed.resolve(plan, st, i, 0, update=False))(
      state, prepare_ids(plan, batch))
  np.testing.assert_array_equal(np.asarray(got["u"]), np.asarray(rows[3]["u"]))


def test_native_ragged_route_lowers_with_ragged_all_to_all(monkeypatch):
  """What a GPU/TPU mesh runs for the map route: the owner runs of distinct ids out into
  (M, 3) receive buffers and their rows back, 2 `ragged_all_to_all` (XLA:CPU emulates them)."""
  from gem_jax.embedding import ragged
  monkeypatch.setattr(ragged, "is_native", lambda mesh: True)
  plan = _plan(make_mesh(2, 4), "lru", 0, "ragged")
  _, M = plan.managed_capacity("u")
  state = init_embedding_state(plan, jax.random.key(0))
  ids = jax.device_put(prepare_ids(plan, _stream(0, 1)[0]), plan.ids_shardings())
  fn = jax.jit(lambda st, i: managed.resolve(plan, st, i, 0, jax.random.key(7)))
  calls = [line for line in fn.lower(state, ids).as_text().splitlines()
           if "@ragged_all_to_all(" in line]
  assert len(calls) == 2, calls
  assert any(f"tensor<{M}x3xi32>" in c for c in calls), calls
  # the whole step: the update's (local row, owner index) pairs travel by it too
  plan = _one_feature_each_plan(make_mesh(2, 4), "ragged")
  state = init_embedding_state(plan, jax.random.key(0))
  ids = jax.device_put(prepare_ids(plan, {"u": _stream(0, 1)[0]["u"], "v": _stream(0, 1)[0][
      "u_hist"]}), plan.ids_shardings())
  calls = [line for line in _step_fn(plan).lower(state, ids, 0).as_text().splitlines()
           if "@ragged_all_to_all(" in line]
  for u in plan.units.values():
    assert any(f"-> tensor<{plan.recv_capacity(u)}x2xi32>" in c for c in calls), calls
