"""Train state: abstract shapes allocate nothing and carry shardings; init lands in
them; a checkpoint saved on 1x8 restores on 2x4 and 4x2 with every parameter,
optimizer moment, table and sparse slot equal."""
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import make_mesh
from gem_jax.embedding import export_state, import_state
from gem_jax.train import checkpoint as ckpt_lib
from gem_jax.train.setup import checkpoint_abstract, checkpoint_tree
from test_step_fixtures import Built, make_batch


def test_abstract_state_has_shardings_and_init_lands_there():
  built = Built(make_mesh(2, 4))
  leaves = jax.tree.leaves(built.abstract)
  assert all(isinstance(a, jax.ShapeDtypeStruct) and a.sharding is not None for a in leaves)
  state = built.init()
  for a, x in zip(leaves, jax.tree.leaves(state)):
    assert x.shape == a.shape and x.dtype == a.dtype
    assert x.sharding.is_equivalent_to(a.sharding, x.ndim)
  kernel = state.params["l1"]["kernel"][...]  # (27, 64): 64 split over 'shard'
  assert kernel.sharding.spec == P(None, "shard")
  assert kernel.addressable_shards[0].data.shape == (27, 16)
  assert state.params["l1"]["kernel"][...].dtype == np.float32


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """Two steps on a 1x8 mesh, then a checkpoint; returns (dir, host copies)."""
  built = Built(make_mesh(1, 8))
  state = built.init()
  fn = None
  for i in range(2):
    b = built.put(make_batch(i))
    fn = fn or built.step_fn(b)
    state, _ = fn(state, b)
  path = str(tmp_path_factory.mktemp("ckpt"))
  with ckpt_lib.CheckpointManager(path, save_every=1, keep=1) as mgr:
    mgr.save(2, checkpoint_tree(state, built.plan), data_state={"train": {"batch": 2}})
  host = {"params": jax.tree.map(np.asarray, state.params),
          "opt": jax.tree.map(np.asarray, state.opt_state),
          "emb": jax.tree.map(np.asarray, export_state(built.plan, state.emb)),
          "rng": np.asarray(state.rng), "step": int(state.step)}
  return path, host


@pytest.mark.parametrize("shape", [(2, 4), (4, 2)])
def test_restore_on_another_mesh(saved, shape):
  path, want = saved
  built = Built(make_mesh(*shape))
  with ckpt_lib.CheckpointManager(path, save_every=1, keep=1) as mgr:
    restored = mgr.restore(checkpoint_abstract(built.abstract, built.plan))
  assert restored.step == 2 and restored.data_state == {"train": {"batch": 2}}
  state = restored.state.replace(emb=import_state(built.plan, restored.state.emb))
  assert int(state.step) == want["step"]
  np.testing.assert_array_equal(np.asarray(state.rng), want["rng"])
  eq = np.testing.assert_array_equal
  jax.tree.map(eq, jax.tree.map(np.asarray, state.params), want["params"])
  jax.tree.map(eq, jax.tree.map(np.asarray, state.opt_state), want["opt"])
  emb = jax.tree.map(np.asarray, export_state(built.plan, state.emb))
  assert set(emb["ad"]) == {"weight", "accumulator"}  # table + row-wise Adagrad slot
  jax.tree.map(eq, emb, want["emb"])
  # The restored state is laid out for the new mesh and steps there.
  for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(built.shardings)):
    assert x.sharding.is_equivalent_to(s, x.ndim)
  b = built.put(make_batch(2))
  _, m = built.step_fn(b)(state, b)
  assert np.isfinite(float(m["train_loss"]))
