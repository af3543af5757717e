"""Managed-collision tables: bad input, checkpoint checks, config and read-only lookups."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_mesh
from gem_jax.embedding import (FeatureConfig, TableConfig, apply_id_policy, export_state,
                               import_state, init_embedding_state, lookup, managed,
                               plan_embeddings, prepare_ids)
from gem_jax.train import setup
from gem_jax.train.validate import ConfigError


def test_split_ids_round_trip_and_order():
  x = np.array([0, 1, (1 << 32) - 1, 1 << 32, (1 << 63) - 1, -1, 12345678901234], np.int64)
  pairs = managed.split_ids(x, "f", "t")
  assert pairs.dtype == np.int32 and pairs.shape == (7, 2)
  np.testing.assert_array_equal(managed.join_ids(pairs), x)
  valid = x >= 0   # (hi, lo) in lexicographic int32 order = raw id order
  order = np.lexsort((pairs[valid, 1], pairs[valid, 0]))
  np.testing.assert_array_equal(x[valid][order], np.sort(x[valid]))
  u = np.array([0, (1 << 63) - 1], np.uint64)
  np.testing.assert_array_equal(managed.join_ids(managed.split_ids(u, "f", "t")),
                                u.astype(np.int64))


def test_bad_raw_ids_name_feature_and_position():
  with pytest.raises(ValueError, match=r"feature 'f' .*id -2 at position \(1, 0\).*padding"):
    managed.split_ids(np.array([[3, -1], [-2, 4]]), "f", "t")
  with pytest.raises(ValueError, match=r"id 9223372036854775808 at position \(1,\).*2\^63"):
    managed.split_ids(np.array([5, 1 << 63], np.uint64), "f", "t")
  with pytest.raises(ValueError, match="is managed"):
    apply_id_policy(np.array([1]), 8, "managed", "f", "t")


def test_table_config_errors():
  with pytest.raises(ValueError, match="multiple of probe=8"):
    TableConfig("t", rows=100, dim=4, id_policy="managed")
  with pytest.raises(ValueError, match="row_wise"):
    TableConfig("t", rows=64, dim=4, id_policy="managed", sharding="table_wise")
  with pytest.raises(ValueError, match="eviction 'fifo'"):
    TableConfig("t", rows=64, dim=4, id_policy="managed", eviction="fifo")
  with pytest.raises(ValueError, match="ttl_steps"):
    TableConfig("t", rows=64, dim=4, id_policy="managed", ttl_steps=-1)


def _plan(mesh, policy="managed", rows=64):
  t = TableConfig("u", rows=rows, dim=4, id_policy=policy, probe=4)
  return plan_embeddings([t], [FeatureConfig("u", "u", bag=2)], mesh, batch_size=8)


def test_planner_rounds_rows_per_shard_to_whole_windows():
  plan = _plan(make_mesh(1, 8), rows=40)     # 10 windows of 4 over 8 shards: 2 per shard
  buf = plan.buffers["u"]
  assert buf.kind == "row_wise" and buf.local_rows == 8 and buf.rows == 64
  assert plan.device_bytes()["u"] == 8 * (4 * 4 + 4 + 16)   # weights, accumulator, map


def test_checkpoint_map_mismatches_are_refused():
  plan = _plan(make_mesh(1, 2))
  state = init_embedding_state(plan, jax.random.key(0))
  ids = jax.device_put(prepare_ids(plan, {"u": np.arange(16).reshape(8, 2) * 977}),
                       plan.ids_shardings())
  state, _, _ = jax.jit(lambda s, i: managed.resolve(plan, s, i, 0))(state, ids)
  canon = jax.tree.map(np.asarray, export_state(plan, state))
  import_state(plan, canon)                                       # consistent: accepted
  no_map = {"u": {k: v for k, v in canon["u"].items() if not k.startswith("map_")}}
  with pytest.raises(ValueError, match="managed but the checkpoint has no"):
    import_state(plan, no_map)
  with pytest.raises(ValueError, match="holds a managed-collision map"):
    import_state(_plan(make_mesh(1, 2), policy="hash"), canon)
  bad = {"u": dict(canon["u"], map_used=np.int32(3))}
  with pytest.raises(ValueError, match="map_used = 3 but 16 rows"):
    import_state(plan, bad)
  hi = canon["u"]["map_hi"]
  r = int(np.flatnonzero(hi >= 0)[0])
  e = int(next(i for i in np.flatnonzero(hi < 0) if i // 4 != r // 4))
  moved = {k: v.copy() for k, v in canon["u"].items()}
  for k in ("map_hi", "map_lo"):                                  # an id out of its window
    moved[k][e] = moved[k][r]
  moved["map_hi"][r] = -1
  with pytest.raises(ValueError, match="1 map entries lie outside their probe window"):
    import_state(plan, {"u": moved})
  twice = {k: v.copy() for k, v in canon["u"].items()}             # one id keying two rows
  w = r // 4 * 4
  r2 = next(i for i in range(w, w + 4) if i != r and twice["map_hi"][i] < 0)
  for k in ("map_hi", "map_lo"):
    twice[k][r2] = twice[k][r]
  twice["map_used"] = np.int32(canon["u"]["map_used"] + 1)
  raw = int(managed.join_ids(np.array([hi[r], canon["u"]["map_lo"][r]])))
  with pytest.raises(ValueError, match=f"1 map entries repeat a raw id .*id {raw}"):
    import_state(plan, {"u": twice})
  short = {"u": dict(canon["u"], map_last=canon["u"]["map_last"][:32])}
  with pytest.raises(ValueError, match="map leaf 'map_last' of shape"):
    import_state(plan, short)


def test_read_only_lookup_finds_seen_ids_and_zeros_unseen():
  plan = _plan(make_mesh(2, 2))
  state = init_embedding_state(plan, jax.random.key(0))
  seen = np.arange(16).reshape(8, 2) * 31 + 5
  ids = jax.device_put(prepare_ids(plan, {"u": seen}), plan.ids_shardings())
  state, rows, _ = jax.jit(lambda s, i: managed.resolve(plan, s, i, 0))(state, ids)
  w = np.asarray(export_state(plan, state)["u"]["weight"])
  query = seen.copy()
  query[:, 1] = 10 ** 12 + np.arange(8)                          # never seen
  q = jax.device_put(prepare_ids(plan, {"u": query}), plan.ids_shardings())
  before = jax.tree.map(np.asarray, export_state(plan, state))
  emb = np.asarray(jax.jit(lambda s, i: lookup(plan, s, i))(state, q)["u"])
  r0 = np.asarray(rows["u"])[:, 0]
  np.testing.assert_allclose(emb, np.where(r0[:, None] >= 0, w[r0], 0.0), rtol=1e-6)
  after = jax.tree.map(np.asarray, export_state(plan, state))
  for k in before["u"]:
    np.testing.assert_array_equal(before["u"][k], after["u"][k])


def test_per_table_managed_settings():
  class Emb(dict):
    __getattr__ = dict.get
  cfg = Emb(per_table="a|b: id_policy=managed, rows=100, eviction=lfu, ttl_steps=5, probe=4")
  out = setup.per_table_settings(cfg, ["a", "b", "c"])
  assert out["a"] == {"id_policy": "managed", "rows": 100, "eviction": "lfu", "ttl_steps": 5,
                      "probe": 4}
  with pytest.raises(ConfigError, match="eviction='fifo'"):
    setup.per_table_settings(Emb(per_table="a: id_policy=managed, eviction=fifo"), ["a"])
  with pytest.raises(ConfigError, match="id_policy='mch'"):
    setup.per_table_settings(Emb(per_table="a: id_policy=mch"), ["a"])


def test_step_metrics():
  plan = _plan(make_mesh(1, 1))
  c = {"u": {k: jnp.int32(i + 1) for i, k in enumerate(managed.COUNTERS)}}
  m = managed.step_metrics(plan, c)
  assert float(m["mc_occupancy/u"]) == 7 / 64 and float(m["mc_hit_rate"]) == 2.0
  assert float(m["mc_collisions"]) == 6 and float(m["mc_evictions/u"]) == 4
