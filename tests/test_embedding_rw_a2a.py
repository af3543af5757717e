"""Row-wise exchanges by owner at their capacity edge, and the exact broadcast fallback.

A row-wise table read by three features (sum with weights, mean, sequence) with a
small capacity: the padded all_to_all ('a2a') has C per (source, owner) pair, the
ragged exchange ('ragged', run on CPU through its padded equivalent) M per owner
from its whole group. Batches are built so that every owner stays within capacity,
sits exactly at it with all ids owned by one shard, or goes one id over (on one
device): the lookups and a row-wise Adagrad step must equal the unsharded plan's
(1 x 1 mesh) within 1e-6 in every case, and `ctx['overflow']` says which path ran
(the same on every device).
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_mesh
from gem_jax.embedding import (FeatureConfig, SparseOptimizerConfig, TableConfig,
                               apply_sparse_updates, export_state, gather_rows,
                               init_embedding_state, plan_embeddings, pool_rows, prepare_ids)
from gem_jax.embedding.exchange import NO_ROW
from gem_jax.embedding.optimizers import distinct_rows

ROWS, DIM, B = 200, 8, 32
TABLES = [TableConfig("rw", ROWS, DIM, sharding="row_wise")]
FEATURES = [FeatureConfig("s", "rw", 4, "sum"), FeatureConfig("m", "rw", 3, "mean"),
            FeatureConfig("q", "rw", 5, "none")]
OPT = SparseOptimizerConfig("rowwise_adagrad", lr=0.1)


def make_plan(mesh_shape, distinct=0.125, exchange="a2a"):
  return plan_embeddings(TABLES, FEATURES, make_mesh(*mesh_shape), B, OPT, rw_exchange=exchange,
                         distinct_share={f.name: distinct for f in FEATURES})


def edge_sizes(plan):
  """Distinct rows of shard 0 that device d of each replica group sends at the capacity
  edge: C each (a2a), or M spread over the group's S devices (ragged)."""
  u, S = plan.units["row_wise.q"], plan.num_shards
  if plan.rw_exchange == "a2a":
    return [plan.capacity(u)] * S
  M = plan.recv_capacity(u)
  return [M // S + (s < M % S) for s in range(S)]


def device_rows(plan):
  """(R S, b) example indices of each device, in mesh order (batch split over both axes)."""
  n = plan.num_replicas * plan.num_shards
  return np.arange(B).reshape(n, B // n)


def batch(plan, case, seed):
  """Host ids {feature: (B, bag)} for `case`; per device every feature's ids are drawn
  from one pool of rows: 'within' 2 per owner, 'edge' `edge_sizes` rows all on shard 0,
  'over' one more on device 0 only, 'uniform' anything (capacities: feature q's)."""
  rng = np.random.default_rng(seed)
  rps = plan.buffers["rw"].local_rows
  S, edge = plan.num_shards, edge_sizes(plan)
  ids = {f.name: np.full((B, f.bag), -1, np.int64) for f in FEATURES}
  for dev, rows in enumerate(device_rows(plan)):
    if case == "uniform":
      pool = rng.integers(0, ROWS, 64)
    elif case == "within":
      pool = np.concatenate([s * rps + rng.choice(min(rps, ROWS - s * rps), min(edge + [2]),
                                                  replace=False) for s in range(S)])
    else:
      k = edge[dev % S] + (case == "over" and dev == 0)
      pool = rng.choice(rps, k, replace=False)
    for f in FEATURES:
      ids[f.name][rows] = rng.choice(pool, (len(rows), f.bag))
      ids[f.name][rows[0], -1] = -1                       # some padding
    if case in ("edge", "over"):   # every pool row appears once in the device's ids
      flat = ids["q"][rows].reshape(-1)
      flat[:len(pool)] = pool
      ids["q"][rows] = flat.reshape(len(rows), -1)
  return ids


def step(plan, state, ids, wts, targets):
  rows, ctx = gather_rows(plan, state, ids)

  def loss(r):
    emb = pool_rows(plan, r, ctx, wts)
    return 0.01 * sum(jnp.sum((emb[f] - targets[f]) ** 2) for f in emb), emb
  (_, emb), g = jax.value_and_grad(loss, has_aux=True)(rows)
  return apply_sparse_updates(plan, state, ctx, g), emb, ctx


@pytest.fixture(scope="module")
def reference():
  plan = make_plan((1, 1))
  return plan, jax.jit(lambda s, i, w, t: step(plan, s, i, w, t)[:2])


@pytest.mark.parametrize("exchange", ["a2a", "ragged"])
@pytest.mark.parametrize("mesh_shape", [(1, 4), (2, 4), (1, 8)])
def test_capacity_edge_and_overflow_match_unsharded(mesh_shape, exchange, reference):
  ref_plan, ref_fn = reference
  plan = make_plan(mesh_shape, exchange=exchange)
  u = plan.units["row_wise.q"]
  assert plan.capacity(u) < plan.local_batch * 5     # the buffers are narrower than the slots
  assert plan.recv_capacity(u) < plan.num_shards * plan.capacity(u)
  fn = jax.jit(lambda s, i, w, t: step(plan, s, i, w, t))
  expect = {"within": False, "edge": False, "over": True}
  for seed, case in enumerate(["within", "edge", "over", "uniform"]):
    host = batch(plan, case, seed)
    rng = np.random.default_rng(100 + seed)
    wts = {"s": rng.uniform(0.5, 1.5, (B, 4)).astype(np.float32)}
    targets = {f.name: rng.normal(size=(B, f.bag, DIM) if f.pooling == "none" else (B, DIM))
               .astype(np.float32) for f in FEATURES}
    state = init_embedding_state(plan, jax.random.key(seed))
    ref_state = init_embedding_state(ref_plan, jax.random.key(seed))
    new, emb, ctx = fn(state, jax.device_put(prepare_ids(plan, host), plan.ids_shardings()),
                       wts, targets)
    ref_new, ref_emb = ref_fn(ref_state, prepare_ids(ref_plan, host), wts, targets)
    over = {u: np.asarray(x) for u, x in ctx["overflow"].items()}
    for u, x in over.items():   # one decision, taken by every device
      assert x.min() == x.max(), (case, u)
    if case in expect:   # 'q' holds every pool row, at q's capacity (per-feature C differ)
      assert bool(over["row_wise.q"].max()) == expect[case], (case, over)
    if case == "within":
      assert not any(x.max() for x in over.values()), over
    for f in emb:
      np.testing.assert_allclose(np.asarray(emb[f]), np.asarray(ref_emb[f]), rtol=0,
                                 atol=1e-6, err_msg=f"{case} {f}")
    got, want = export_state(plan, new)["rw"], export_state(ref_plan, ref_new)["rw"]
    for k in want:
      np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=0, atol=1e-6,
                                 err_msg=f"{case} {k}")


def test_capacity_comes_from_the_distinct_ids():
  cap = lambda p: p.capacity(p.units["row_wise.s"])
  dense, sparse = make_plan((1, 8), distinct=1.0), make_plan((1, 8), distinct=0.125)
  assert cap(sparse) < cap(dense) <= 4 * 4            # b = 4 examples x bag 4 slots
  assert cap(sparse.with_batch_size(16 * B)) > cap(sparse)   # eval batches: it scales
  assert cap(make_plan((1, 1))) == B * 4              # one shard: every slot, no overflow


def test_tables_the_engine_cannot_address_are_refused():
  with pytest.raises(ValueError, match=r"table 'huge': 2,147,483,648 rows, more than the "
                                       r"engine can address \(2,147,483,646"):
    TableConfig("huge", 1 << 31, 1)
  TableConfig("edge", (1 << 31) - 2, 1)                # the largest addressable table
  # row-wise padding to S equal blocks may push the buffer past the limit (no memory used:
  # planning allocates nothing)
  t = TableConfig("edge", (1 << 31) - 3, 1, sharding="row_wise")
  with pytest.raises(ValueError, match=r"buffer 'edge' \(row_wise, tables \['edge'\]\) needs "
                                       r"2,147,483,648 global rows on 8 shards"):
    plan_embeddings([t], [FeatureConfig("f", "edge")], make_mesh(1, 8), 8)
  plan = plan_embeddings([t], [FeatureConfig("f", "edge")], make_mesh(1, 7), 7)
  assert plan.buffers["edge"].rows == 7 * -(-t.rows // 7) <= (1 << 31) - 2
  # the largest row id maps to its owner and local row without wrapping
  host = {"f": np.array([[t.rows - 1]] * 7, np.int64)}
  assert prepare_ids(plan, host)["f"].max() == t.rows - 1


def test_id_stats_and_the_capacity_they_set():
  from gem_jax.embedding import id_stats
  t = TableConfig("rw", ROWS, DIM, sharding="row_wise")    # id_policy 'error': ids are rows
  f = [FeatureConfig("s", "rw", 4)]
  # 4 devices x 8 examples x bag 4: row 7 in every bag, then 2 rows of shard 0, one padding
  ids = np.full((B, 4), -1, np.int64)
  ids[:, 0] = 7
  ids[:, 1:3] = np.arange(B * 2).reshape(B, 2) % 40
  st = id_stats([t], f, [{"s": ids}] * 3, num_devices=4, num_shards=4)["s"]
  assert st.batches == 3 and st.valid_share == 0.75
  per_device = [np.unique(d[d >= 0]).size / d.size for d in np.split(ids, 4)]
  assert st.distinct_share == pytest.approx(np.mean(per_device))
  assert st.top_share == pytest.approx(1.0)          # 41 rows < k = 100
  assert st.max_owner_share == 1.0                    # rps = 50: every row on shard 0
  plan = plan_embeddings([t], f, make_mesh(1, 4), B, OPT, id_stats={"s": st})
  u = plan.units["row_wise.s"]
  assert plan.capacity(u) >= np.unique(ids[:8][ids[:8] >= 0]).size   # all of device 0's
  assert "ids s: valid 75%" in plan.describe() and "capacity" in plan.describe()
  state = init_embedding_state(plan, jax.random.key(0))
  _, ctx = jax.jit(lambda s, i: gather_rows(plan, s, i))(
      state, jax.device_put(prepare_ids(plan, {"s": ids}), plan.ids_shardings()))
  assert not np.asarray(ctx["overflow"]["row_wise.s"]).any()   # skew measured: no fallback
  blind = plan_embeddings([t], f, make_mesh(1, 4), B, OPT, distinct_share={"s": 0.3})
  _, ctx = jax.jit(lambda s, i: gather_rows(blind, s, i))(
      init_embedding_state(blind, jax.random.key(0)),
      jax.device_put(prepare_ids(blind, {"s": ids}), blind.ids_shardings()))
  assert np.asarray(ctx["overflow"]["row_wise.s"]).all()      # unmeasured skew: exact fallback


@pytest.mark.parametrize("fill", [NO_ROW, -1])
def test_distinct_equals_jnp_unique(fill):
  """`distinct_rows` (two single-operand sorts + a binary search) against
  `jnp.unique(size=n, return_inverse=True)`: Zipf rows with repeats and the padding
  (`rw_distinct`: NO_ROW, filled with NO_ROW; `_unique`: -1, filled with -1), all equal,
  all distinct."""
  rng = np.random.default_rng(0)
  cases = [(rng.zipf(1.1, 2048) % 100_000).astype(np.int32),
           np.full(64, 7, np.int32), np.arange(64, dtype=np.int32)[::-1].copy()]
  cases[0][::17] = fill
  for x in cases:
    want_u, want_i = jnp.unique(x, size=x.size, fill_value=fill, return_inverse=True)
    got_u, got_i = jax.jit(distinct_rows, static_argnums=1)(jnp.asarray(x), fill)
    np.testing.assert_array_equal(got_u, want_u)
    np.testing.assert_array_equal(got_i, want_i.reshape(-1))


@pytest.mark.parametrize("exchange", ["a2a", "ragged"])
def test_the_update_never_copies_a_table(exchange):
  """The compiled lookup + update (state donated) holds no `copy` of a table-shaped buffer:
  its cost per step follows the batch, not the table. (A `lax.cond` choosing between the
  by-owner and the broadcast route with the table as operand made XLA copy every row-wise
  shard and its slots once per step.)"""
  rows = 4 * 1001                                   # local shards of 1,001 rows: no batch-sized
  tables = [TableConfig("rw", rows, DIM, sharding="row_wise"),    # buffer has that shape
            TableConfig("tw", 1003, DIM, sharding="table_wise"),
            TableConfig("cw", 1005, 2 * DIM, sharding="column_wise")]
  feats = [FeatureConfig("s", "rw", 4, "sum"), FeatureConfig("t", "tw", 2, "sum"),
           FeatureConfig("c", "cw", 3, "mean")]
  for opt in (OPT, SparseOptimizerConfig("adam", lr=0.01)):
    plan = plan_embeddings(tables, feats, make_mesh(1, 4), B, opt, rw_exchange=exchange)
    state = init_embedding_state(plan, jax.random.key(0))
    ids = prepare_ids(plan, {f.name: np.zeros((B, f.bag), np.int64) for f in feats})

    def train(state, ids):
      got, ctx = gather_rows(plan, state, ids)
      g = jax.grad(lambda r: sum(jnp.sum(e * e) for e in pool_rows(plan, r, ctx).values()))(got)
      return apply_sparse_updates(plan, state, ctx, g)

    hlo = jax.jit(train, donate_argnums=0).lower(state, ids).compile().as_text()
    table_shapes = {f"{x.dtype.name[0]}{x.dtype.itemsize * 8}[{','.join(map(str, s))}]"
                    for x in jax.tree.leaves(state) if x.ndim
                    for s in [x.sharding.shard_shape(x.shape)]}
    copied = set(re.findall(r"= (\w+\[[\d,]*\])\{[^}]*\} copy\(", hlo))
    assert table_shapes and not copied & table_shapes, (opt.kind, copied & table_shapes)
