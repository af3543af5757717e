"""Checkpoints: cross-mesh restore, retention (last K + best), resume, JSON items."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import make_mesh
from gem_jax.train import metrics
from gem_jax.train.checkpoint import CheckpointManager, abstract_like


def specs():
  """Partition specs of the toy state (dense FSDP, row-sharded table, replicated rest)."""
  return {
      "step": P(),
      "params": {"w": P("shard", None), "b": P()},
      "table": P("shard", None),
      "slot": P(("replica", "shard")),
      "rng": P(),
      "acc": jax.tree.map(lambda _: P(), metrics.init_accumulators(2, 2, 16)),
  }


def make_state(mesh, seed=0):
  rng = np.random.default_rng(seed)
  state = {
      "step": jnp.int32(7 + seed),
      "params": {"w": rng.normal(size=(16, 8)).astype(np.float32),
                 "b": rng.normal(size=(8,)).astype(jnp.bfloat16)},
      "table": rng.normal(size=(40, 4)).astype(np.float32),    # 40 rows: 8 | 40, 4 | 40
      "slot": rng.random(size=(40,)).astype(np.float32),
      "rng": jax.random.key(seed),
      "acc": metrics.update(metrics.init_accumulators(2, 2, 16),
                            rng.normal(size=(32, 2)).astype(np.float32),
                            (rng.random((32, 2)) < 0.5).astype(np.float32),
                            np.ones((32, 2), np.float32), rng.integers(0, 2, 32)),
  }
  shard = jax.tree.map(lambda s: NamedSharding(mesh, s), specs(),
                       is_leaf=lambda x: isinstance(x, P))
  return jax.tree.map(jax.device_put, state, shard), shard


def assert_trees_equal(a, b):
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  assert ta == tb
  for x, y in zip(la, lb):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      x, y = jax.random.key_data(x), jax.random.key_data(y)
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("shape", [(2, 4), (4, 2)])
def test_save_on_1x8_restore_on_other_mesh(tmp_path, shape):
  state, _ = make_state(make_mesh(1, 8))
  cfg = {"model": {"name": "gem", "layers": [2, 3]}, "seed": 1}
  with CheckpointManager(str(tmp_path), save_every=5) as ckpt:
    assert ckpt.save(10, state, data_state={"train": {"batch": 12}}, config=cfg)
  new_mesh = make_mesh(*shape)
  _, new_shard = make_state(new_mesh)
  with CheckpointManager(str(tmp_path), save_every=5) as ckpt:
    got = ckpt.restore(abstract_like(state, new_shard))
  assert got.step == 10
  assert_trees_equal(got.state, state)
  for leaf, want in zip(jax.tree.leaves(got.state), jax.tree.leaves(new_shard)):
    assert leaf.sharding == want, (leaf.sharding, want)
  assert got.state["table"].sharding.mesh.devices.shape == shape
  assert got.data_state == {"train": {"batch": 12}}
  assert got.config == cfg


def test_retention_keeps_last_k_plus_best(tmp_path):
  state, _ = make_state(make_mesh(1, 8))
  auc = {2: 0.70, 4: 0.90, 6: 0.80, 8: 0.75, 10: 0.60, 12: 0.65}
  with CheckpointManager(str(tmp_path), save_every=2, keep=2, best_metric="eval_auc") as ckpt:
    for step in range(1, 13):
      m = {"eval_auc": auc[step], "eval_loss": 1.0} if step in auc else None
      saved = ckpt.save(step, state, metrics=m)
      assert saved == (step % 2 == 0)
    ckpt.wait()
    assert ckpt.save(12, state, force=True) is False       # already on disk: no-op
    assert ckpt.save(13, state, force=True)                # forced final save (no metric)
    ckpt.wait()
    assert ckpt.all_steps() == [4, 12, 13]
    assert ckpt.best_step() == 4
    assert ckpt.metrics(4)["eval_auc"] == pytest.approx(0.90)
  on_disk = sorted(int(d) for d in os.listdir(tmp_path) if d.isdigit())
  assert on_disk == [4, 12, 13]


def test_retention_min_mode(tmp_path):
  state, _ = make_state(make_mesh(1, 8))
  loss = [0.5, 0.2, 0.4, 0.3]
  with CheckpointManager(str(tmp_path), save_every=1, keep=1, best_metric="eval_loss",
                         best_mode="min") as ckpt:
    for step, v in enumerate(loss, start=1):
      ckpt.save(step, state, metrics={"eval_loss": v})
    ckpt.wait()
    assert ckpt.all_steps() == [2, 4]


def test_resume_picks_latest_and_ignores_incomplete(tmp_path):
  mesh = make_mesh(1, 8)
  with CheckpointManager(str(tmp_path), save_every=1, keep=5) as ckpt:
    assert ckpt.restore(abstract_like(make_state(mesh)[0])) is None   # fresh start
    for step in (1, 2, 3):
      state, _ = make_state(mesh, seed=step)
      ckpt.save(step, state, data_state={"batch": step * 10})
  # A write that never finished (Orbax's temporary directory) must be ignored.
  os.makedirs(tmp_path / "4.orbax-checkpoint-tmp-1234" / "state")
  want, shard = make_state(mesh, seed=3)
  with CheckpointManager(str(tmp_path), save_every=1, keep=5) as ckpt:
    assert ckpt.latest_step() == 3
    got = ckpt.restore(abstract_like(want, shard))
    assert got.step == 3 and got.data_state == {"batch": 30}
    assert_trees_equal(got.state, want)
    older = ckpt.restore(abstract_like(want, shard), step=1)
    assert older.data_state == {"batch": 10}
    assert_trees_equal(older.state, make_state(mesh, seed=1)[0])
    with pytest.raises(FileNotFoundError):
      ckpt.restore(abstract_like(want, shard), step=4)


def test_config_dict_round_trip(tmp_path):
  ml_collections = pytest.importorskip("ml_collections")
  cfg = ml_collections.ConfigDict({"train": {"steps": 10, "keep": 2}, "mesh": (1, -1),
                                   "data": {"kind": "synthetic"}})
  state, _ = make_state(make_mesh(1, 8))
  with CheckpointManager(str(tmp_path), save_every=None) as ckpt:
    assert not ckpt.save(3, state, config=cfg)               # nothing due without force
    assert ckpt.save(3, state, config=cfg, data_state=[{"a": 1}, {"b": [1, 2]}], force=True)
    got = ckpt.restore(abstract_like(state))
  assert got.config == {"train": {"steps": 10, "keep": 2}, "mesh": [1, -1],
                        "data": {"kind": "synthetic"}}
  assert got.data_state == [{"a": 1}, {"b": [1, 2]}]
  assert ml_collections.ConfigDict(got.config).train.steps == 10


def test_shared_kvstore_specs_equal_orbax_own(tmp_path):
  """The per-directory spec, copied per array, is the spec Orbax builds for that array."""
  from orbax.checkpoint._src.serialization import tensorstore_utils as tsu
  from gem_jax.train import tensorstore_leaks
  tensorstore_leaks.install()
  shared = tsu._build_ocdbt_kvstore_tspec
  assert hasattr(shared, "wrapped"), "this Orbax lacks the hook: the leak is back"
  own = shared.wrapped
  write = tsu.OcdbtKvStoreWriteOptions(mode=tsu.OcdbtWriteMode.WRITE)
  cases = [{}, {"write_options": write},
           {"write_options": tsu.OcdbtKvStoreWriteOptions(
               mode=tsu.OcdbtWriteMode.WRITE, target_data_file_size=1 << 20,
               store_ocdbt_metadata_and_values_separately=True)}]
  for directory in (str(tmp_path / "1" / "state"), str(tmp_path / "2" / "state")):
    for options in cases:
      for name in (None, "params.w", "table", None, "params.w"):  # misses, then hits
        got = shared(directory, name, **options)
        assert got == own(directory, name, **options), (directory, name, options)
        got["path"] = "changed"                                    # copies, not shared
  assert shared(directory=directory, name="x") == own(directory=directory, name="x")


def test_saves_do_not_leak_python_objects(tmp_path):
  """Python's allocated blocks stay flat across saves of a many-array state.

  Without `tensorstore_leaks`, each save leaves ~4 blocks per array (tensorstore's
  `KvStore.Spec.to_json`) plus ~140 (its metric collection): ~500 here, ~13 with it.
  """
  import gc
  import sys
  n_arrays = 60
  state = {f"a{i}": jnp.full((8, 4), i, jnp.float32) for i in range(n_arrays)}
  ckpt = CheckpointManager(str(tmp_path / "ckpt"), save_every=1, keep=2)

  def blocks_after(first, last):
    for step in range(first, last):
      ckpt.save(step, state, data_state={"step": step})
    ckpt.wait()
    gc.collect()
    return sys.getallocatedblocks()

  start = blocks_after(1, 31)                  # caches, pools and compiled paths warm
  end = blocks_after(31, 61)
  ckpt.close()
  per_save = (end - start) / 30
  assert per_save < n_arrays / 2, f"{per_save:.0f} Python blocks retained per save"
