"""The ragged exchange (gem_jax/embedding/ragged.py) on CPU.

XLA:CPU has no ragged-all-to-all, so the CPU runs `ragged_all_to_all`'s contract on
padded blocks. Checked here: that equivalent against a NumPy model of the contract as
jax documents it (slices with gaps, receivers' offsets out of order); the routes of
the row-wise exchange against NumPy; and that the native path (what GPU/TPU meshes
run) traces, type-checks and lowers, also for CUDA, with every exchange a
`ragged_all_to_all`. The row-wise lookups and updates through it are checked against
the unsharded plan in tests/test_embedding_rw_a2a.py and tests/test_embedding.py.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import make_mesh
from gem_jax.embedding import (FeatureConfig, SparseOptimizerConfig, TableConfig,
                               apply_sparse_updates, gather_rows, init_embedding_state,
                               plan_embeddings, pool_rows, prepare_ids, ragged)

S, N, D, OUT = 4, 16, 3, 20


def contract(operand, output, in_off, send, out_off, recv):
  """jax's documented semantics of ragged_all_to_all (one slice per peer), per device."""
  result = output.copy()
  for dst in range(S):
    for src in range(S):
      k = recv[dst][src]
      assert k == send[src][dst]
      o, i = out_off[src][dst], in_off[src][dst]
      result[dst][o:o + k] = operand[src][i:i + k]
  return result


def test_padded_equivalent_follows_the_documented_contract():
  rng = np.random.default_rng(0)
  operand = rng.normal(size=(S, N, D)).astype(np.float32)
  output = np.full((S, OUT, D), -7.0, np.float32)
  send = rng.integers(0, 4, (S, S)).astype(np.int32)          # send[src][dst]
  in_off = np.zeros((S, S), np.int32)
  out_off = np.zeros((S, S), np.int32)
  for src in range(S):         # slices with gaps between them, in a shuffled order
    pos = 0
    for dst in rng.permutation(S):
      in_off[src, dst] = pos
      pos += send[src, dst] + rng.integers(0, 2)
    assert pos <= N
  for dst in range(S):         # each receiver lays its sources out of order, with gaps
    pos = 0
    for src in rng.permutation(S):
      out_off[src, dst] = pos
      pos += send[src, dst] + rng.integers(0, 2)
    assert pos <= OUT
  recv = send.T.copy()
  want = contract(operand, output, in_off, send, out_off, recv)

  mesh = jax.make_mesh((S,), ("shard",), devices=jax.devices()[:S],
                       axis_types=(jax.sharding.AxisType.Explicit,))
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P("shard")))  # noqa: E731

  def body(x, o, a, b, c, d):
    y = ragged.ragged_all_to_all(x[0], o[0], a[0], b[0], c[0], d[0], axis_name="shard",
                                 native=False, max_send=4)
    return y[None]
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("shard"),) * 6, out_specs=P("shard")))
  got = fn(*map(put, (operand, output, in_off, send, out_off, recv)))
  np.testing.assert_array_equal(np.asarray(got), want)


def test_routes_lay_every_source_end_to_end():
  rng = np.random.default_rng(1)
  count = rng.integers(0, 5, (S, S)).astype(np.int32)          # count[src][owner]
  start = np.cumsum(count, 1) - count
  mesh = jax.make_mesh((S,), ("shard",), devices=jax.devices()[:S],
                       axis_types=(jax.sharding.AxisType.Explicit,))

  def body(st, ct):
    r = ragged.routes(st[0], ct[0])
    return tuple(x[None] for x in (r.out_off, r.recv_start, r.recv_count, r.back_off))
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("shard"),) * 2,
                             out_specs=(P("shard"),) * 4))
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P("shard")))  # noqa: E731
  out_off, recv_start, recv_count, back_off = map(np.asarray, fn(put(start), put(count)))
  np.testing.assert_array_equal(recv_count, count.T)         # owner o hears count[s][o]
  np.testing.assert_array_equal(back_off, start.T)           # and where to answer s
  for o in range(S):           # sources 0, 1, ... laid end to end in owner o's buffer
    np.testing.assert_array_equal(recv_start[o], np.cumsum(count[:, o]) - count[:, o])
    for s in range(S):
      assert out_off[s, o] == recv_start[o, s]


def _ragged_step(mesh_shape):
  tables = [TableConfig("rw", 200, 8, sharding="row_wise")]
  feats = [FeatureConfig("q", "rw", 5, "sum")]
  plan = plan_embeddings(tables, feats, make_mesh(*mesh_shape), 32,
                         SparseOptimizerConfig("rowwise_adagrad", lr=0.1), rw_exchange="ragged")
  state = init_embedding_state(plan, jax.random.key(0))
  ids = jax.device_put(prepare_ids(plan, {"q": np.zeros((32, 5), np.int64)}),
                       plan.ids_shardings())

  def step(state, ids):
    rows, ctx = gather_rows(plan, state, ids)
    g = jax.grad(lambda r: jnp.sum(pool_rows(plan, r, ctx)["q"] ** 2))(rows)
    return apply_sparse_updates(plan, state, ctx, g)
  return plan, jax.jit(step), (state, ids)


def test_native_path_lowers_with_ragged_all_to_all(monkeypatch):
  """What a GPU/TPU mesh runs: ids out and rows back (lookup), ids and gradients out
  (update): 4 `ragged_all_to_all`, with the receive capacity M as the owners' buffers."""
  monkeypatch.setattr(ragged, "is_native", lambda mesh: True)
  plan, step, args = _ragged_step((2, 4))
  M = plan.recv_capacity(plan.units["row_wise.q"])
  text = step.lower(*args).as_text()
  calls = [line for line in text.splitlines() if "@ragged_all_to_all(" in line]
  assert len(calls) == 4, calls
  assert sum(f"tensor<{M}xi32>" in c for c in calls) == 2       # ids into (M,) on the owners
  exported = jax.export.export(
      step, platforms=["cuda"],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")])(*args)
  assert exported.mlir_module().count("@ragged_all_to_all(") == 4


def test_cpu_path_has_no_ragged_op_and_auto_picks_by_backend():
  plan, step, args = _ragged_step((1, 4))
  assert "ragged_all_to_all" not in step.lower(*args).as_text()   # the padded equivalent
  auto = plan_embeddings(list(plan.tables.values()), list(plan.features.values()),
                         make_mesh(1, 4), 32)
  assert auto.rw_exchange == "a2a"                                # CPU: padded all_to_all
  with pytest.raises(ValueError, match="rw_exchange 'ragd' not in"):
    plan_embeddings(list(plan.tables.values()), list(plan.features.values()),
                    make_mesh(1, 4), 32, rw_exchange="ragd")
