"""Id policies at the ends of the 64-bit range, the default policy, collision counts."""
import numpy as np
import pytest

from conftest import make_mesh
from gem_jax.embedding import (FeatureConfig, TableConfig, apply_id_policy,
                               expected_collision_rate, hash_ids, id_collisions, plan_embeddings,
                               prepare_ids, table_collisions)
from gem_jax.train.report import IdCollisions

TOP = [2**63 - 1, 2**63, 2**63 + 1, 2**64 - 1]


def test_uint64_ids_above_2_63_are_ids_not_padding():
  u = np.array([TOP + [0]], np.uint64)
  h = hash_ids(u, 1000)
  assert h.dtype == np.int64 and ((h >= 0) & (h < 1000)).all()
  # The full 64 bits are hashed: unsigned x < 2^63 hashes as the signed x.
  assert h[0, 0] == hash_ids(np.array([2**63 - 1], np.int64), 1000)[0]
  assert h[0, 4] == hash_ids(np.array([0]), 1000)[0]
  assert len(set(h[0, :4].tolist())) == 4          # 2^63, 2^64 - 1 ... land apart
  np.testing.assert_array_equal(apply_id_policy(u, 1000, "hash", "f", "t"), h)
  np.testing.assert_array_equal(apply_id_policy(u, 1000, "clip", "f", "t"), [[999] * 4 + [0]])
  np.testing.assert_array_equal(apply_id_policy(np.array([[0, 7]], np.uint64), 10, "error",
                                                "f", "t"), [[0, 7]])
  for top in (2**63, 2**64 - 1):
    with pytest.raises(ValueError, match=rf"feature 'f': id {top} at position \(0, 0\) is out "
                                         r"of range .* use 'hash' or 'clip'"):
      apply_id_policy(np.array([[top, 1]], np.uint64), 10, "error", "f", "t")


def test_negative_signed_ids_stay_padding_under_every_policy():
  raw = np.array([[-1, -(2**63), 3]], np.int64)
  for policy in ("hash", "clip", "error"):
    out = apply_id_policy(raw, 10, policy, "f", "t")
    assert out[0, :2].tolist() == [-1, -1] and 0 <= out[0, 2] < 10, policy
  assert apply_id_policy(np.array([[-1, 3]], np.int8), 10, "error", "f", "t").tolist() == [[-1, 3]]


def test_default_policy_is_error_and_passes_in_range_ids_unchanged():
  assert TableConfig("t", 5000, 4).id_policy == "error"
  plan = plan_embeddings([TableConfig("t", 5000, 4)], [FeatureConfig("f", "t", 2)],
                         make_mesh(1, 2), 2500)
  raw = np.arange(5000).reshape(2500, 2)
  out = prepare_ids(plan, {"f": raw})
  assert out["f"].dtype == np.int32 and (out["f"] == raw).all()   # 5000 ids, 5000 rows
  assert table_collisions(plan, {"f": raw}, out) == {}             # 'error': never merges
  with pytest.raises(ValueError, match=r"id 5000 .* table 't' of 5000 rows \(id_policy='error'; "
                                       r"use 'hash' or 'clip'"):
    prepare_ids(plan, {"f": raw + 1})


def test_hash_collisions_counted_exactly_and_expected_rate():
  ids = np.arange(5000)
  rows = hash_ids(ids, 5000)
  assert id_collisions(ids, rows) == (5000, len(np.unique(rows))) == (5000, 3143)
  rate = expected_collision_rate(5000, 5000, "hash")    # 1 - (1 - (1 - 1/R)^V) R / V
  assert rate == pytest.approx(1 - (1 - (1 - 1 / 5000) ** 5000), rel=1e-9)
  assert abs(rate - (1 - 3143 / 5000)) < 0.01
  assert expected_collision_rate(10, 20, "clip") == 0.5
  assert expected_collision_rate(10, 5, "clip") == 0.0
  assert expected_collision_rate(10, None, "hash") is None
  assert expected_collision_rate(10, None, "error") == 0.0


def test_table_collisions_pool_the_features_of_a_table():
  tables = [TableConfig("c", 10, 4, id_policy="clip"), TableConfig("e", 10, 4),
            TableConfig("h", 7, 4, id_policy="hash")]
  feats = [FeatureConfig("c1", "c", 2), FeatureConfig("c2", "c", 1), FeatureConfig("e", "e", 1),
           FeatureConfig("h", "h", 2)]
  plan = plan_embeddings(tables, feats, make_mesh(1, 2), 2)
  host = {"c1": np.array([[0, 9], [10, -1]]),        # 10 -> 9, -1 padding
          "c2": np.array([[99], [9]], np.uint64),    # 99 -> 9, 9 again
          "e": np.array([[1], [2]]),
          "h": np.array([[5, 5], [2**64 - 1, 0]], np.uint64)}
  out = prepare_ids(plan, host)
  got = table_collisions(plan, host, out)
  # c: raw {0, 9, 10, 99} -> rows {0, 9}; h: raw {5, 2^64-1, 0} (uint64 0 is an id).
  n_h_rows = len(np.unique(hash_ids(np.array([5, 2**64 - 1, 0], np.uint64), 7)))
  assert got == {"c": (4, 2), "h": (3, n_h_rows)}


def test_id_collision_metric_follows_the_trained_batches():
  acc = IdCollisions()
  acc.add({"a": (10, 6), "b": (4, 4)})
  acc.add({"a": (10, 10), "b": (4, 2)})
  acc.add({"a": (100, 1)})           # prefetched, not trained yet
  acc.consume()
  acc.consume()
  m = acc.metrics()
  assert m == {"id_merged/a": 1 - 16 / 20, "id_merged/b": 1 - 6 / 8, "id_merged": 1 - 22 / 28}
  acc.consume()
  assert acc.metrics() == {"id_merged/a": 0.99, "id_merged": 0.99}
  assert acc.metrics() == {}


def test_trainer_host_batch_counts_collisions_of_each_batch():
  from gem_jax.train import setup  # pylint: disable=import-outside-toplevel
  tables = [TableConfig("c", 10, 4, id_policy="clip"), TableConfig("e", 10, 4)]
  plan = plan_embeddings(tables, [FeatureConfig("c", "c", 2), FeatureConfig("e", "e", 1)],
                         make_mesh(1, 2), 2)
  acc = IdCollisions()
  batches = [{"ids": {"c": np.array([[0, 12], [11, -1]]), "e": np.array([[1], [2]])}},
             {"ids": {"c": np.array([[3, 4], [5, 5]]), "e": np.array([[1], [2]])}}]
  for b in batches:
    out = setup.host_batch(plan, b, acc)
    assert out["ids"]["c"].dtype == np.int32
  acc.consume()
  acc.consume()
  # batch 1: {0, 12, 11} -> rows {0, 9}; batch 2: {3, 4, 5} -> 3 rows; 'e' never merges.
  assert acc.metrics() == {"id_merged/c": 1 - 5 / 6, "id_merged": 1 - 5 / 6}
