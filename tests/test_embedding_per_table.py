"""Per-table settings: dim, storage dtype, optimizer and learning rate, in one plan.

Reference: each table alone in a 1 x 1 plan whose default optimizer is that table's.
The loss is a sum over features, so every table's step is independent of the others:
after one step on a 2 x 4 mesh each table must equal its reference (fp32 within 1e-6;
bf16 storage: weights within one bf16 ulp, the fp32 accumulator within 2^-7 relative, as
its gradients come from rows pooled in bf16, in another order on another mesh).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ml_collections import config_dict

from conftest import make_mesh
from gem_jax.data.spec import DataSpec, SparseFeatureSpec
from gem_jax.embedding import (FeatureConfig, SparseOptimizerConfig, TableConfig,
                               apply_sparse_updates, export_state, gather_rows,
                               init_embedding_state, plan_embeddings, pool_rows, prepare_ids)
from gem_jax.train import setup as setup_lib
from gem_jax.train.validate import ConfigError

B = 32
ADAGRAD = SparseOptimizerConfig("rowwise_adagrad", lr=0.05)
TABLES = [
    TableConfig("a", 40, 8, sharding="table_wise"),                                   # default
    TableConfig("b", 30, 4, sharding="table_wise", optimizer=SparseOptimizerConfig("sgd", 0.5)),
    TableConfig("c", 64, 8, sharding="row_wise", optimizer=SparseOptimizerConfig("adam", 0.01)),
    TableConfig("d", 48, 16, jnp.bfloat16, sharding="row_wise"),
    TableConfig("e", 20, 6, sharding="replicated", optimizer=SparseOptimizerConfig("sgd", 0.2)),
]
FEATURES = [FeatureConfig(t.name, t.name, 3) for t in TABLES]


def one_step(plan, state, host, targets):
  ids = prepare_ids(plan, host)
  if plan.num_shards * plan.num_replicas > 1:
    ids = jax.device_put(ids, plan.ids_shardings())

  def step(state, ids):
    rows, ctx = gather_rows(plan, state, ids)
    g = jax.grad(lambda r: sum(jnp.sum((e.astype(jnp.float32) - targets[f]) ** 2) for f, e in
                               pool_rows(plan, r, ctx).items()))(rows)
    return apply_sparse_updates(plan, state, ctx, g)
  return export_state(plan, jax.jit(step)(state, ids))


def test_mixed_tables_match_each_table_alone():
  plan = plan_embeddings(TABLES, FEATURES, make_mesh(2, 4), B, ADAGRAD)
  assert plan.buffers[plan.buffer_of["a"]] is not plan.buffers[plan.buffer_of["b"]]
  assert plan.buffer_of["b"] == "tw_d4_float32_sgd_lr0.5"     # packed by optimizer too
  text = plan.describe()
  assert "adam lr 0.01" in text and "bfloat16" in text
  rng = np.random.default_rng(0)
  host = {t.name: rng.integers(0, t.rows, (B, 3)) for t in TABLES}
  targets = {t.name: rng.normal(size=(B, t.dim)).astype(np.float32) for t in TABLES}
  got = one_step(plan, init_embedding_state(plan, jax.random.key(1)), host, targets)
  assert got["d"]["weight"].dtype == jnp.bfloat16 and got["d"]["accumulator"].dtype == jnp.float32
  assert set(got["c"]) == {"weight", "m", "v", "step"} and set(got["b"]) == {"weight"}
  for i, t in enumerate(TABLES):
    alone = TableConfig(t.name, t.rows, t.dim, t.dtype, sharding="table_wise")
    ref = plan_embeddings([alone], [FEATURES[i]], make_mesh(1, 1), B, t.optimizer or ADAGRAD)
    # the same initial values: table i of the mixed plan is drawn with fold_in(key, i)
    init = {t.name: {k: np.asarray(v) for k, v in export_state(
        plan, init_embedding_state(plan, jax.random.key(1)))[t.name].items()}}
    from gem_jax.embedding import import_state
    want = one_step(ref, import_state(ref, init), {t.name: host[t.name]},
                    {t.name: targets[t.name]})[t.name]
    for k in want:   # bf16 rows are pooled in bf16, in another order on another mesh: the
      a, b = np.asarray(got[t.name][k], np.float32), np.asarray(want[k], np.float32)
      if t.dtype == jnp.bfloat16:   # weights within one ulp, g^2 sums within 2 ulp (2^-7)
        rtol, atol = (0, 2.0 ** -8 * np.abs(b).max()) if k == "weight" else (2.0 ** -7, 0)
      else:
        rtol, atol = 0, 1e-6
      np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=f"{t.name} {k}")
    assert not np.array_equal(np.asarray(got[t.name]["weight"], np.float32),
                              np.asarray(init[t.name]["weight"], np.float32)), t.name


def _emb_cfg(**kw):
  from configs import base  # pylint: disable=import-outside-toplevel
  c = base.get_config().embedding
  c.update(**kw)
  return c


SPEC = DataSpec(n_dense=1, sparse=tuple(SparseFeatureSpec(n, 100) for n in
                                        ("C1", "C2", "hist_item", "user")))


def test_config_per_table_settings():
  cfg = _emb_cfg(per_table="C*: dim=32, optimizer=adam, lr=0.001; hist_item|user: "
                           "dtype=bfloat16; C2: lr=0.5")
  tables, _ = setup_lib.embedding_configs(SPEC, cfg)
  by = {t.name: t for t in tables}
  assert by["C1"].dim == 32 and by["C1"].optimizer == SparseOptimizerConfig("adam", lr=0.001)
  assert by["C2"].optimizer == SparseOptimizerConfig("adam", lr=0.5)     # later rule wins
  assert by["user"].dtype == jnp.bfloat16 and by["user"].dim == cfg.dim
  assert by["user"].optimizer is None                                    # the plan's
  for bad, msg in [("D*: dim=8", "pattern 'D\\*' matches no table"),
                   ("C1: width=8", "keys are \\['dim', 'dtype', 'eviction', 'id_policy', "
                                   "'initial_accumulator', 'lr', "
                                   "'optimizer', 'probe', 'rows', 'ttl_steps'\\]"),
                   ("C1: dtype=float16", "dtype='float16' not in"),
                   ("C1: optimizer=lamb", "optimizer='lamb' not in"),
                   ("C1: dim=0", "dim and lr must be positive"),
                   ("C1 dim=8", "is not 'PATTERNS: key=value"),
                   ("C1: lr=fast", "lr='fast' is not a float")]:
    with pytest.raises(ConfigError, match=msg):
      setup_lib.embedding_configs(SPEC, _emb_cfg(per_table=bad))


def test_trainer_plan_and_model_take_mixed_dims():
  from configs import tiny  # pylint: disable=import-outside-toplevel
  c = tiny.get_config()
  c.embedding.per_table = "*: optimizer=sgd, lr=0.1; " + "|".join(
      f.name for f in setup_lib.sources(c)[0].spec.sparse[:2]) + ": dim=24, dtype=bfloat16"
  s = setup_lib.setup(config_dict.ConfigDict(c))
  dims = set(s.feature_dims.values())
  assert 24 in dims and c.embedding.dim in dims
  assert all(b.optimizer.kind == "sgd" for b in s.plan.buffers.values())


def test_config_initial_accumulator_reaches_the_state():
  """embedding.initial_accumulator (and per_table's) start the row-wise Adagrad sums."""
  cfg = _emb_cfg(lr=0.1, initial_accumulator=0.01, per_table="C2: initial_accumulator=0.5")
  plan = setup_lib.make_plan(SPEC, cfg, make_mesh(1, 1), B)
  assert plan.optimizer.initial_accumulator == 0.01
  acc = {t: np.asarray(s["accumulator"]) for t, s in
         export_state(plan, init_embedding_state(plan, jax.random.key(0))).items()}
  assert set(np.unique(acc["C1"])) == {np.float32(0.01)}
  assert set(np.unique(acc["C2"])) == {np.float32(0.5)}
  for bad in (_emb_cfg(lr=0.1, initial_accumulator=-1e-3),
              _emb_cfg(lr=0.1, per_table="C1: initial_accumulator=-1")):
    with pytest.raises(ConfigError, match="initial_accumulator.* must be >= 0"):
      setup_lib.make_plan(SPEC, bad, make_mesh(1, 1), B)
