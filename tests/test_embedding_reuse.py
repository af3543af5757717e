"""What an outside program relies on: mesh axes, a second plan for another batch over
the same state, the batch sharding, and the table -> buffer map in the printout."""
import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from gem_jax.embedding import (FeatureConfig, TableConfig, check_mesh, export_state,
                               init_embedding_state, lookup, plan_embeddings, prepare_ids)

TABLES = [TableConfig("ad", 40, 8, sharding="table_wise"),
          TableConfig("cat", 24, 8, sharding="table_wise"),
          TableConfig("user", 50, 4, sharding="row_wise", id_policy="hash", vocab=50),
          TableConfig("tiny", 6, 4, sharding="replicated", id_policy="clip")]
FEATS = [FeatureConfig("ad", "ad", 1), FeatureConfig("cat", "cat", 2, "mean"),
         FeatureConfig("user", "user", 3), FeatureConfig("tiny", "tiny", 1)]


def _mesh(names=("replica", "shard")):
  return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), names)   # a plain jax Mesh


def test_mesh_with_other_axis_names_fails_naming_the_axes():
  with pytest.raises(ValueError, match=r"needs a Mesh with axis_names \('replica', 'shard'\).*"
                                       r"got \('data', 'model'\)"):
    plan_embeddings(TABLES, FEATS, _mesh(("data", "model")), 8)
  with pytest.raises(ValueError, match=r"got \('shard', 'replica'\)"):
    check_mesh(_mesh(("shard", "replica")))


def test_second_plan_at_another_batch_reads_the_same_state():
  train = plan_embeddings(TABLES, FEATS, _mesh(), 16)
  infer = plan_embeddings(TABLES, FEATS, _mesh(), 8)
  strip = lambda p: {k: dataclasses.replace(b, sync="none") for k, b in p.buffers.items()}  # noqa: E731
  assert strip(train) == strip(infer) and train.state_specs() == infer.state_specs()
  state = init_embedding_state(train, jax.random.key(0))
  rng = np.random.default_rng(0)
  high = {"ad": 40, "cat": 24, "user": 2**40, "tiny": 10}     # raw ids; hash / clip map them
  host = {f.name: rng.integers(-1, high[f.table], (8, f.bag)) for f in FEATS}
  with pytest.raises(ValueError, match=r"ids of shape \(8, 1\), expected \(16, 1\)"):
    prepare_ids(train, host)
  ids = prepare_ids(infer, host)
  got = lookup(infer, state, jax.device_put(ids, infer.ids_shardings()))
  canon = jax.device_get(export_state(train, state))
  for f in FEATS:
    x = ids[f.name]
    e = canon[f.table]["weight"][np.maximum(x, 0)] * (x >= 0)[..., None]   # (8, bag, D)
    want = e.sum(1) if f.pooling == "sum" else e.sum(1) / np.maximum((x >= 0).sum(1), 1)[:, None]
    np.testing.assert_allclose(np.asarray(got[f.name]), want, rtol=1e-6, atol=1e-7)
  assert got["ad"].shape == (8, 8)


def test_batch_sharding_and_describe_name_every_table():
  plan = plan_embeddings(TABLES, FEATS, _mesh(), 8)
  assert plan.batch_sharding().spec == P(("replica", "shard"))
  assert plan.ids_shardings()["ad"].spec == P(("replica", "shard"), None)
  text = plan.describe()
  assert plan.buffer_of == {"ad": "tw_d8_float32", "cat": "tw_d8_float32", "user": "user",
                            "tiny": "tiny"}
  for t in TABLES:
    line = next(l for l in text.splitlines() if l.strip().startswith(f"{t.name} "))
    assert plan.buffer_of[t.name] in line and plan.table_placement(t.name) in line
    assert t.id_policy in line
  buf = plan.buffers["tw_d8_float32"]
  i = buf.tables.index("cat")
  lo = buf.owners[i] * buf.local_rows + buf.offsets[i]
  assert plan.table_placement("cat") == f"rows {lo}:{lo + 24} (shard {buf.owners[i]})"
  assert "36.4 % of 50" in text     # user: hash, rows = vocab = 50
  assert "? (vocab unknown)" in text   # tiny: clip, vocab unknown
