"""Sharded lookups and sparse training steps against dense single-device references.

Matrix: meshes 1x1 1x2 1x4 1x8 2x4 4x2 x sharding types (every plan holds all
four) x id distributions (each a different batch through the same compiled
function). References are plain numpy / single-device jnp written here.
"""
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_mesh
from gem_jax.embedding import update as update_lib
from gem_jax.embedding import (FeatureConfig, SparseOptimizerConfig, TableConfig,
                               apply_sparse_updates, export_state, gather_rows,
                               import_state, init_embedding_state, lookup, plan_embeddings,
                               pool_rows, prepare_ids)

MESHES = [(1, 1), (1, 2), (1, 4), (1, 8), (2, 4), (4, 2)]
B = 16
TABLES = [
    TableConfig("tw_a", 37, 8, sharding="table_wise"),   # by columns (by nothing: tw_c on 1x8)
    TableConfig("tw_b", 48, 8, sharding="table_wise"),   # canonical split by rows
    TableConfig("tw_c", 23, 4, sharding="table_wise"),   # a second table-wise group
    TableConfig("rw", 45, 8, sharding="row_wise"),
    TableConfig("cw", 30, 6, sharding="column_wise"),   # 6 columns do not split evenly
    TableConfig("rep", 20, 8, sharding="replicated"),
]


def _features():
  out = []
  for t in TABLES:
    out += [FeatureConfig(f"{t.name}.sum", t.name, 3, "sum"),
            FeatureConfig(f"{t.name}.mean", t.name, 2, "mean"),
            FeatureConfig(f"{t.name}.seq", t.name, 4, "none")]
  return out


FEATURES = _features()
# Training uses a subset (faster compiles) that still has two features on one table
# per sharding type, pooled and sequence units, and every pooling.
TRAIN_FEATURES = ("tw_a.sum", "tw_a.seq", "tw_b.mean", "tw_c.sum", "rw.sum", "rw.seq",
                  "cw.sum", "cw.mean", "rep.sum", "rep.seq")
TRAIN_FEATS = [f for f in FEATURES if f.name in TRAIN_FEATURES]
WEIGHTED = ("tw_a.sum", "rw.sum", "cw.sum", "rep.sum", "tw_b.seq", "rw.seq")


def _ids(dist, rng, rows, shape, num_shards):
  """Host ids of one distribution, -1 = padding."""
  if dist == "uniform":
    return rng.integers(0, rows, shape)
  if dist == "zipf":
    return (rng.zipf(1.1, shape) - 1) % rows
  if dist == "one_shard":   # all in the first row-wise block
    return rng.integers(0, -(-rows // num_shards), shape)
  if dist == "identical":
    return np.full(shape, 7)
  if dist == "empty":
    return np.full(shape, -1)
  if dist == "padded":      # ragged bags: a random number of valid ids, then -1
    ids = rng.integers(0, rows, shape)
    n = rng.integers(0, shape[1] + 1, shape[0])
    return np.where(np.arange(shape[1])[None] < n[:, None], ids, -1)
  raise ValueError(dist)


def _batch(plan, dist, seed):
  rng = np.random.default_rng(seed)
  host = {f.name: _ids(dist, rng, plan.tables[f.table].rows, (B, f.bag), plan.num_shards)
          for f in plan.features.values()}
  ids = prepare_ids(plan, host)
  wts = {f: rng.uniform(0.5, 1.5, (B, plan.features[f].bag)).astype(np.float32)
         for f in WEIGHTED if f in plan.features}
  return ids, wts


def _ref_lookup(tables, ids, wts):
  """Unsharded reference: jnp.take + pooling on one device."""
  out = {}
  for f in (f for f in FEATURES if f.name in ids):
    x = jnp.asarray(ids[f.name])
    valid = x >= 0
    e = jnp.take(tables[f.table], jnp.where(valid, x, 0), axis=0) * valid[..., None]
    if f.name in wts:
      e = e * jnp.asarray(wts[f.name])[..., None]
    if f.pooling == "sum":
      e = e.sum(1)
    elif f.pooling == "mean":
      e = e.sum(1) / jnp.maximum(valid.sum(1), 1)[:, None]
    out[f.name] = e
  return out


# (mesh, owners deduplicate before gathering, row-wise exchange): the test tables are
# tiny, so the planner's size rule alone would never dedup them; dedup_min_bytes=0
# forces it. 'ragged' runs ragged_all_to_all's contract on padded blocks (XLA:CPU).
LOOKUP_CASES = ([(m, True, "a2a") for m in MESHES]
                + [((1, 1), False, "a2a"), ((2, 4), False, "a2a"), ((1, 8), False, "a2a"),
                   ((2, 4), True, "ragged"), ((1, 8), False, "ragged")])


@pytest.fixture(scope="module", params=LOOKUP_CASES,
                ids=lambda c: f"{c[0][0]}x{c[0][1]}-{'dedup' if c[1] else 'plain'}-{c[2]}")
def setup(request):
  mesh_shape, dedup, exchange = request.param
  plan = plan_embeddings(TABLES, FEATURES, make_mesh(*mesh_shape), B, SparseOptimizerConfig(),
                         dedup_min_bytes=0 if dedup else 1 << 62, rw_exchange=exchange)
  assert all(u.dedup == dedup for u in plan.units.values())
  state = init_embedding_state(plan, jax.random.key(0))
  return plan, state


DISTS = ["uniform", "zipf", "one_shard", "identical", "empty", "padded"]


@pytest.fixture(scope="module")
def canon_1x1():
  ref = plan_embeddings(TABLES, FEATURES, make_mesh(1, 1), B)
  return {t: np.asarray(c["weight"])
          for t, c in export_state(ref, init_embedding_state(ref, jax.random.key(0))).items()}


def test_lookup_matches_unsharded_reference(setup, canon_1x1):
  plan, state = setup
  # Every leaf is created in its planned sharding, with the same values on any mesh.
  shardings = plan.state_shardings()
  for b in state:
    for k, x in state[b].items():
      assert x.sharding == shardings[b][k], (b, k)
  assert {plan.sharding[t.name] for t in TABLES} == {
      "table_wise", "row_wise", "column_wise", "replicated"}
  canon = export_state(plan, state)
  tables = {t: np.asarray(c["weight"]) for t, c in canon.items()}
  for t in tables:
    np.testing.assert_array_equal(tables[t], canon_1x1[t], err_msg=t)
  fn = jax.jit(lambda s, i, w: lookup(plan, s, i, w))
  for seed, dist in enumerate(DISTS):
    ids, wts = _batch(plan, dist, seed)
    got = fn(state, jax.device_put(ids, plan.ids_shardings()), wts)
    want = _ref_lookup(tables, ids, wts)
    for f in FEATURES:
      g = np.asarray(got[f.name])
      assert g.shape == want[f.name].shape, (dist, f.name)
      np.testing.assert_allclose(g, want[f.name], rtol=0, atol=1e-6, err_msg=f"{dist} {f.name}")
      if dist == "empty":
        assert not g.any(), f.name
    assert np.abs(np.asarray(got["rw.sum"])).max() > 0 or dist == "empty"


# ---- training ------------------------------------------------------------------------
LOSS_SCALE = 0.01   # keeps accumulators O(1), so 1e-5 is a tight (not ulp-level) bound


def _touched(ids):
  out = {t.name: np.zeros(t.rows, bool) for t in TABLES}
  for f in (f for f in FEATURES if f.name in ids):
    x = np.asarray(ids[f.name])
    out[f.table][x[x >= 0]] = True
  return out


@jax.jit(static_argnums=0)
def _ref_step(opt, tables, slots, ids, wts, targets, touched, lr):
  """Dense single-device reference: full gradients, optimizer on the touched rows."""
  def loss(tabs):
    emb = _ref_lookup(tabs, ids, wts)
    return LOSS_SCALE * sum(jnp.sum((emb[f] - targets[f]) ** 2) for f in emb)
  grads = jax.grad(loss)(tables)
  new_t, new_s = {}, {}
  for t, w in tables.items():
    g = grads[t]
    touched_t = touched[t]
    tm = touched_t[:, None]
    s = dict(slots[t])
    if opt.kind == "sgd":
      nw = w - lr * g
    elif opt.kind == "rowwise_adagrad":
      acc = s["accumulator"] + jnp.mean(g * g, axis=1)
      s["accumulator"] = jnp.where(touched_t, acc, s["accumulator"])
      nw = w - lr * g / (jnp.sqrt(acc)[:, None] + opt.eps)
    else:
      step = s["step"] + 1
      m = opt.beta1 * s["m"] + (1 - opt.beta1) * g
      v = opt.beta2 * s["v"] + (1 - opt.beta2) * g * g
      mh, vh = m / (1 - opt.beta1 ** step), v / (1 - opt.beta2 ** step)
      s["m"], s["v"], s["step"] = jnp.where(tm, m, s["m"]), jnp.where(tm, v, s["v"]), step
      nw = w - lr * mh / (jnp.sqrt(vh) + opt.eps)
    new_t[t] = jnp.where(tm, nw, w)
    new_s[t] = s
  return new_t, new_s


def _train_batches(plan, n):
  out = []
  for k in range(n):
    ids, wts = _batch(plan, ["uniform", "zipf", "padded", "identical", "one_shard"][k % 5], 100 + k)
    rng = np.random.default_rng(200 + k)
    targets = {f.name: rng.normal(size=(B, 4, plan.tables[f.table].dim)
                                  if f.pooling == "none" else (B, plan.tables[f.table].dim))
               .astype(np.float32) for f in plan.features.values()}
    out.append((ids, wts, targets))
  return out


def _random_canonical(opt, seed):
  """Canonical tables and slots drawn on the host (cheaper to compile than init)."""
  rng = np.random.default_rng(seed)
  out = {}
  for t in TABLES:
    c = {"weight": rng.uniform(-0.5, 0.5, (t.rows, t.dim)).astype(np.float32)}
    if opt.kind == "rowwise_adagrad":
      c["accumulator"] = rng.uniform(0.05, 0.2, t.rows).astype(np.float32)
    elif opt.kind == "adam":
      c["m"] = rng.normal(0, 0.01, (t.rows, t.dim)).astype(np.float32)
      c["v"] = rng.uniform(0, 1e-3, (t.rows, t.dim)).astype(np.float32)
      c["step"] = np.int32(3)
    out[t.name] = c
  return out


def _make_step(plan):
  def loss_fn(dense, rows, ctx, wts, targets):
    emb = pool_rows(plan, rows, ctx, wts)
    return dense * LOSS_SCALE * sum(jnp.sum((emb[f] - targets[f]) ** 2) for f in emb)

  def step(state, ids, wts, targets, lr):
    rows, ctx = gather_rows(plan, state, ids)
    loss, (_, g_rows) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
        jnp.float32(1.0), rows, ctx, wts, targets)
    return apply_sparse_updates(plan, state, ctx, g_rows, lr=lr), loss
  return jax.jit(step, donate_argnums=0)


def _assert_replicas_identical(state):
  for b, leaves in state.items():
    for k, x in leaves.items():
      seen = {}
      for sh in x.addressable_shards:
        key = str(sh.index)
        data = np.asarray(sh.data)
        if key in seen:
          np.testing.assert_array_equal(data, seen[key], err_msg=f"{b}/{k} differs across replicas")
        seen[key] = data


# (mesh, optimizer, replica sync, dedup before gather, row-wise exchange): 'rows'
# all-gathers row gradients, 'dense' reduce-scatters + all-gathers the shard's gradient
# (update.py).
OPT_CASES = [(m, "rowwise_adagrad", "rows", m in ((1, 1), (2, 4)), "a2a") for m in MESHES] + [
    ((1, 4), "rowwise_adagrad", "dense", True, "a2a"),
    ((2, 4), "rowwise_adagrad", "dense", False, "a2a"),
    ((4, 2), "rowwise_adagrad", "dense", True, "a2a"),
    ((2, 4), "sgd", "rows", True, "a2a"), ((2, 4), "sgd", "dense", False, "a2a"),
    ((4, 2), "adam", "rows", False, "a2a"), ((4, 2), "adam", "dense", True, "a2a"),
    ((1, 8), "adam", "rows", True, "a2a"),
    # the ragged row-wise exchange (ragged_all_to_all's contract on padded blocks on CPU)
    ((2, 4), "rowwise_adagrad", "dense", False, "ragged"), ((4, 2), "adam", "rows", True, "ragged"),
] + [pytest.param(*c, "a2a", marks=pytest.mark.slow) for c in [
    ((2, 4), "adam", "rows", False), ((1, 8), "rowwise_adagrad", "dense", True),
    ((1, 8), "sgd", "rows", False), ((1, 1), "sgd", "rows", True), ((1, 1), "adam", "rows", False),
    ((1, 4), "adam", "dense", False), ((4, 2), "sgd", "dense", True)]]


@pytest.mark.parametrize("mesh_shape,kind,sync,dedup,exchange", OPT_CASES)
def test_five_steps_match_dense_optimizer(mesh_shape, kind, sync, dedup, exchange):
  _five_steps_match_dense_optimizer(mesh_shape, kind, sync, dedup, exchange, TRAIN_FEATS)


@pytest.mark.parametrize("mesh_shape,kind", [((1, 1), "rowwise_adagrad"), ((1, 1), "adam"),
                                             ((1, 2), "rowwise_adagrad")])
def test_row_wise_update_dedups_only_what_can_repeat(mesh_shape, kind, monkeypatch):
  """A row-wise table looked up by one feature: on one shard its owner's rows are its own
  distinct requests, so the update sums no duplicates (no sort); on two shards two
  requesters may send one row. Either way the steps match the dense reference."""
  seen = []
  sync = update_lib._sync
  monkeypatch.setattr(update_lib, "_sync", lambda plan, buf, rows, g, unique, additive,
                      index=None: (seen.append((buf.kind, unique)),
                                   sync(plan, buf, rows, g, unique, additive, index))[1])
  feats = [f for f in TRAIN_FEATS if f.name != "rw.seq"]
  _five_steps_match_dense_optimizer(mesh_shape, kind, "rows", False, "a2a", feats)
  assert {u for k, u in seen if k == "row_wise"} == {mesh_shape == (1, 1)}


def _five_steps_match_dense_optimizer(mesh_shape, kind, sync, dedup, exchange, feats):
  opt = SparseOptimizerConfig(kind, lr=0.05 if kind != "adam" else 0.01, eps=1e-6)
  plan = plan_embeddings(TABLES, feats, make_mesh(*mesh_shape), B, opt,
                         replica_sync=sync, dedup_min_bytes=0 if dedup else 1 << 62,
                         rw_exchange=exchange)
  assert plan.rw_exchange == exchange
  R, S = mesh_shape
  assert {b.sync for b in plan.buffers.values()} <= {"none", sync}
  if R * S > 1:
    assert plan.buffers["rep"].sync == sync
  canon = _random_canonical(opt, seed=1)
  state = import_state(plan, canon)     # non-trivial slots, too
  tables = {t: jnp.asarray(c["weight"]) for t, c in canon.items()}
  slots = {t: {k: jnp.asarray(v) for k, v in c.items() if k != "weight"} for t, c in canon.items()}
  step = _make_step(plan)
  with warnings.catch_warnings():
    warnings.simplefilter("error")   # e.g. "Some donated buffers were not usable"
    for k, (ids, wts, targets) in enumerate(_train_batches(plan, 5)):
      lr = jnp.float32(opt.lr * (1 + 0.1 * k))    # a traced schedule
      state, _ = step(state, jax.device_put(ids, plan.ids_shardings()), wts, targets, lr)
      tables, slots = _ref_step(opt, tables, slots, ids, wts, targets, _touched(ids), lr)
  _assert_replicas_identical(state)
  got = export_state(plan, state)
  moved = 0
  for t in tables:
    np.testing.assert_allclose(np.asarray(got[t]["weight"]), np.asarray(tables[t]),
                               rtol=0, atol=1e-5, err_msg=t)
    moved += np.abs(np.asarray(got[t]["weight"]) - np.asarray(canon[t]["weight"])).max() > 1e-3
    for k, v in slots[t].items():
      np.testing.assert_allclose(np.asarray(got[t][k]), np.asarray(v), rtol=0, atol=1e-5,
                                 err_msg=f"{t}/{k}")
  assert moved == len(tables)


def test_export_import_across_meshes():
  opt = SparseOptimizerConfig("adam", lr=0.01)
  src = plan_embeddings(TABLES, TRAIN_FEATS, make_mesh(2, 4), B, opt)
  state = import_state(src, _random_canonical(opt, seed=2))
  ids, wts, targets = _train_batches(src, 1)[0]
  state, _ = _make_step(src)(state, jax.device_put(ids, src.ids_shardings()), wts, targets,
                             jnp.float32(0.01))
  canon = export_state(src, state)
  assert canon["tw_a"]["weight"].shape == (37, 8)
  assert canon["rw"]["weight"].shape == (45, 8)
  assert canon["rw"]["weight"].sharding.spec == jax.sharding.PartitionSpec(None, "shard")
  assert len({s.device for s in canon["tw_b"]["weight"].addressable_shards}) == 8
  for shape in [(4, 2), (1, 1)]:
    dst = plan_embeddings(TABLES, TRAIN_FEATS, make_mesh(*shape), B, opt)
    back = export_state(dst, import_state(dst, canon))
    for t in canon:
      for k in canon[t]:
        np.testing.assert_array_equal(np.asarray(back[t][k]), np.asarray(canon[t][k]),
                                      err_msg=f"{shape} {t}/{k}")
  # Another optimizer's checkpoint: weights kept, missing slots start fresh.
  dst = plan_embeddings(TABLES, TRAIN_FEATS, make_mesh(1, 2), B, SparseOptimizerConfig())
  back = export_state(dst, import_state(dst, {t: {"weight": c["weight"]} for t, c in canon.items()}))
  np.testing.assert_array_equal(np.asarray(back["cw"]["weight"]), np.asarray(canon["cw"]["weight"]))
  assert not np.asarray(back["cw"]["accumulator"]).any()


@pytest.mark.parametrize("kind", ["adam", "rowwise_adagrad"])
def test_disabled_update_changes_nothing(kind):
  """enabled=False (a non-finite step): tables and slots, Adam's count included, stay put."""
  opt = SparseOptimizerConfig(kind, lr=0.05)
  plan = plan_embeddings(TABLES, TRAIN_FEATS, make_mesh(2, 4), B, opt)
  state = import_state(plan, _random_canonical(opt, seed=2))
  before = export_state(plan, state)
  ids, wts, targets = _train_batches(plan, 1)[0]

  @jax.jit
  def step(state, ids, enabled):
    rows, ctx = gather_rows(plan, state, ids)
    g_rows = jax.grad(lambda r: sum(jnp.sum(e ** 2) for e in pool_rows(plan, r, ctx, wts).values()))(rows)
    g_rows = jax.tree.map(lambda g: g * jnp.nan, g_rows)    # what a bad batch brings
    return apply_sparse_updates(plan, state, ctx, g_rows, enabled=enabled)

  after = export_state(plan, step(state, jax.device_put(ids, plan.ids_shardings()), False))
  for t in before:
    for k in before[t]:
      np.testing.assert_array_equal(np.asarray(after[t][k]), np.asarray(before[t][k]), f"{t}/{k}")


@pytest.mark.parametrize("kind", ["adam", "rowwise_adagrad"])
def test_frozen_rows_keep_their_bits_without_a_table_select(kind):
  """apply_sparse_updates(frozen=...) on a 2 x 4 mesh: a table of a packed table-wise
  buffer (part of it), a row-wise and a replicated buffer (whole) frozen. Equal, bit for
  bit, to updating everything and then selecting the old rows back, and the frozen
  tables are unchanged while the others move."""
  from gem_jax.transfer.student import frozen_row_ranges, keep_frozen_rows
  opt = SparseOptimizerConfig(kind, lr=0.05)
  plan = plan_embeddings(TABLES, TRAIN_FEATS, make_mesh(2, 4), B, opt)
  frozen_tables = ["tw_b", "rw", "rep"]
  ranges = frozen_row_ranges(plan, frozen_tables)
  assert plan.buffer_of["tw_b"] in ranges and len(plan.buffers[plan.buffer_of["tw_b"]].tables) > 1
  canon = _random_canonical(opt, seed=3)
  ids, wts, targets = _train_batches(plan, 1)[0]
  ids = jax.device_put(ids, plan.ids_shardings())

  @functools.partial(jax.jit, static_argnums=1)
  def step(state, frozen):
    rows, ctx = gather_rows(plan, state, ids)
    g_rows = jax.grad(lambda r: sum(jnp.sum((e - targets[f]) ** 2)
                                    for f, e in pool_rows(plan, r, ctx, wts).items()))(rows)
    new = apply_sparse_updates(plan, state, ctx, g_rows, frozen=ranges if frozen else None)
    return new if frozen else keep_frozen_rows(new, state, ranges)

  state = import_state(plan, canon)
  got = step(state, True)
  want = step(state, False)
  for b in want:
    for k in want[b]:
      np.testing.assert_array_equal(np.asarray(got[b][k]), np.asarray(want[b][k]), f"{b}/{k}")
  _assert_replicas_identical(got)
  after = export_state(plan, got)
  for t in canon:
    rows = [k for k in canon[t] if np.ndim(canon[t][k])]   # Adam's step counts per buffer
    same = all(np.array_equal(np.asarray(after[t][k]), canon[t][k]) for k in rows)
    assert same == (t in frozen_tables), t
