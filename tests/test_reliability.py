"""Reliability, in process: checkpoint integrity, the non-finite guard and policies,
preemption flag agreement, start-up validation. (Subprocess kills: test_reliability_e2e.py.)
"""
import dataclasses
import importlib.util
import os
import shutil
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_mesh
from gem_jax.train import integrity, loop, nonfinite, preemption, report, setup, validate
from gem_jax.train import state as state_lib
from gem_jax.train import step as step_lib
from gem_jax.train.checkpoint import CheckpointManager, abstract_like
from test_checkpoint import assert_trees_equal, make_state
from test_step_fixtures import SPEC, Built, make_batch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------- integrity --

@pytest.fixture
def two_checkpoints(tmp_path):
  """Checkpoints 1 and 2 of two different toy states (sealed), and the states."""
  mesh = make_mesh(1, 8)
  s1, _ = make_state(mesh, seed=0)
  s2, _ = make_state(mesh, seed=1)
  with CheckpointManager(str(tmp_path / "ckpt"), save_every=1, keep=5) as ckpt:
    ckpt.save(1, s1)
    ckpt.save(2, s2)
  return tmp_path / "ckpt", s1, s2


def _largest_file(step_dir):
  files = [os.path.join(r, n) for r, _, ns in os.walk(step_dir) for n in ns
           if n != integrity.MANIFEST]
  return max(files, key=os.path.getsize)


def test_saves_are_sealed_and_verify(two_checkpoints):
  d, _, _ = two_checkpoints
  for s in (1, 2):
    assert os.path.exists(d / str(s) / integrity.MANIFEST)
    assert integrity.verify(str(d / str(s))) is True
  assert integrity.complete_steps(str(d)) == [1, 2]


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_corrupt_checkpoint_is_reported_and_previous_used(two_checkpoints, damage, caplog):
  d, s1, _ = two_checkpoints
  victim = _largest_file(d / "2")
  if damage == "flip":
    with open(victim, "r+b") as f:
      f.seek(os.path.getsize(victim) // 2)
      byte = f.read(1)
      f.seek(-1, os.SEEK_CUR)
      f.write(bytes([byte[0] ^ 0x01]))
  elif damage == "truncate":
    with open(victim, "r+b") as f:
      f.truncate(os.path.getsize(victim) - 7)
  else:
    os.remove(victim)
  with pytest.raises(integrity.CorruptCheckpointError, match=os.path.basename(victim)):
    integrity.verify(str(d / "2"))
  with CheckpointManager(str(d), save_every=1, keep=5) as ckpt:
    got = ckpt.restore(abstract_like(s1))
    assert got.step == 1
    assert_trees_equal(got.state, s1)
    assert ckpt.all_steps() == [1]
  assert victim.replace(str(d) + os.sep, "") in caplog.text or victim in caplog.text
  assert "corrupt checkpoint" in caplog.text
  assert os.path.isdir(str(d) + "_corrupt/2") and not os.path.exists(d / "2")


def test_unfinished_temporary_checkpoint_is_never_picked(two_checkpoints):
  """What a kill during an async save leaves: `STEP.orbax-checkpoint-tmp-*` (here a
  copy of a real checkpoint under that name, i.e. even one that looks complete)."""
  d, _, s2 = two_checkpoints
  shutil.copytree(d / "2", d / "3.orbax-checkpoint-tmp-1234")
  assert integrity.complete_steps(str(d)) == [1, 2]
  with CheckpointManager(str(d), save_every=1, keep=5) as ckpt:
    assert ckpt.all_steps() == [1, 2]
    got = ckpt.restore(abstract_like(s2))
  assert got.step == 2
  assert_trees_equal(got.state, s2)


def test_unsealed_checkpoint_restores_and_old_ones_are_not_sealed(two_checkpoints, caplog):
  d, _, _ = two_checkpoints
  os.remove(d / "2" / integrity.MANIFEST)   # killed between the rename and the manifest
  os.remove(d / "1" / integrity.MANIFEST)
  assert integrity.verify(str(d / "2")) is None
  assert integrity.restore_newest(str(d), [1, 2], lambda s: s * 10) == 20
  assert "no integrity manifest" in caplog.text
  assert integrity.seal(str(d)) == [1, 2]       # nothing sealed: both are newer than that
  os.remove(d / "1" / integrity.MANIFEST)
  assert integrity.seal(str(d)) == []           # 1 is older than the newest sealed (2)


def test_nonfinite_state_is_never_saved(tmp_path):
  state, _ = make_state(make_mesh(1, 8))
  bad = dict(state, params=dict(state["params"], w=state["params"]["w"].at[3, 1].set(jnp.inf)))
  with CheckpointManager(str(tmp_path), save_every=1) as ckpt:
    assert ckpt.save(1, state)
    with pytest.raises(integrity.NonFiniteStateError, match=r"\['params'\]\['w'\]"):
      ckpt.save(2, bad)
    assert ckpt.all_steps() == [1]


# ----------------------------------------------------- non-finite guard --

@pytest.fixture(scope="module")
def guarded():
  """Built (test_step_fixtures) with the skip counter in its optimizer, and a jitted guard."""
  b = Built(make_mesh(2, 4))
  b.tx = nonfinite.with_skip_counter(b.tx)
  b.abstract, b.shardings = state_lib.abstract_train_state(
      b.model_fn, b.tx, b.plan, b.emb_init, b.acc_fn, b.mesh)
  b.cfg = dataclasses.replace(b.cfg, tx=b.tx)
  good, bad = b.put(make_batch(0)), b.put(make_batch(1))
  bad["dense"] = bad["dense"].at[2, 1].set(jnp.nan)
  sh = jax.tree.map(lambda x: x.sharding, good)
  fn = step_lib.jit_train_step(b.cfg, b.shardings, sh, skip_nonfinite=True)
  return b, fn, good, bad


def _host(state):
  """Host copies (np.array copies: on CPU a device_get view would follow the donated buffers)."""
  return jax.tree.map(lambda x: np.array(jax.random.key_data(x) if jnp.issubdtype(
      x.dtype, jax.dtypes.prng_key) else x, copy=True), state)


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_nonfinite_batch_skips_update_and_counts(guarded, value):
  b, fn, good, bad = guarded
  bad = dict(bad, dense=bad["dense"].at[2, 1].set(value))
  state = b.init()
  before = _host(state)
  state, m = fn(state, bad)
  after = _host(state)
  assert float(m["nonfinite_loss"]) == 1.0 and float(m["train_loss"]) == 0.0
  assert int(after.step) == 1 and nonfinite.skipped_steps(state) == 1
  for name in ("params", "emb", "model_state"):
    assert_trees_equal(getattr(after, name), getattr(before, name))
  assert_trees_equal(after.opt_state[:-1], before.opt_state[:-1])
  assert not np.array_equal(after.rng, before.rng)   # the RNG moves on with the step
  state, m = fn(state, good)                          # a good batch updates as usual
  assert float(m["nonfinite_loss"]) == 0.0 and np.isfinite(float(m["train_loss"]))
  assert nonfinite.skipped_steps(state) == 1
  # The tables move (sparse lr follows state.step); the dense lr is still 0 here because
  # optax's own step count did not advance on the skipped step (warm-up from 0).
  assert not all(np.array_equal(x, y) for x, y in
                 zip(jax.tree.leaves(_host(state).emb), jax.tree.leaves(before.emb)))


def test_guard_equals_plain_step_on_finite_batches(guarded):
  b, fn, good, _ = guarded
  plain = Built(make_mesh(2, 4))
  ref, ref_m = plain.step_fn(good)(plain.init(), good)
  got, m = fn(b.init(), good)
  assert float(m["train_loss"]) == float(ref_m["train_loss"])
  assert_trees_equal(_host(got).params, _host(ref).params)
  assert_trees_equal(_host(got).emb, _host(ref).emb)


def test_policy_modes():
  ok = {"nonfinite_loss": np.float32(0), "nonfinite_grad": np.float32(0)}
  bad = {"nonfinite_loss": np.float32(1), "nonfinite_grad": np.float32(1)}
  assert not nonfinite.NonFinitePolicy("skip").check(5, bad)
  with pytest.raises(nonfinite.NonFiniteError, match="train_loss and grad_norm at step 5"):
    nonfinite.NonFinitePolicy("stop").check(5, bad)
  p = nonfinite.NonFinitePolicy("rollback", max_rollbacks=2)
  assert not p.check(4, ok)
  assert p.check(5, bad) and p.check(6, bad)
  with pytest.raises(nonfinite.NonFiniteError, match="rolled back 2 times"):
    p.check(7, bad)
  with pytest.raises(ValueError, match="nonfinite"):
    nonfinite.NonFinitePolicy("ignore")


# ----------------------------------------- the loop with injected NaNs --

def tiny_config(**train):
  spec = importlib.util.spec_from_file_location("tiny", os.path.join(ROOT, "configs", "tiny.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  c = mod.get_config()
  c.train.eval_every = 1000
  c.train.log_every = 1
  c.train.best_metric = None
  for k, v in train.items():
    c.train[k] = v
  return c


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("xla_cache"))


def _restore(workdir, config):
  s = setup.setup(config)
  with CheckpointManager(os.path.join(workdir, "checkpoints"), save_every=None) as ckpt:
    return s, ckpt.restore(setup.checkpoint_abstract(s.abstract, s.plan))


@pytest.mark.slow  # real training loop runs: minutes on 2 cores
def test_loop_skip_mode_counts_and_checkpoints_stay_finite(tmp_path, cache_dir):
  c = tiny_config(steps=3, checkpoint_every=3, inject_nan_step=2, compile_cache=cache_dir)
  out = loop.train_and_evaluate(c, str(tmp_path))
  assert out["step"] == 3 and np.isfinite(out["train_loss"])
  _, got = _restore(str(tmp_path), c)
  assert got.step == 3 and int(got.state.opt_state[-1].skipped) == 1
  rows = [r for r in report.read_jsonl(str(tmp_path / "metrics.jsonl")) if "train_loss" in r]
  assert [r["nonfinite_loss"] for r in rows] == [0.0, 1.0, 0.0]


@pytest.mark.slow  # real training loop runs: minutes on 2 cores
def test_loop_stop_mode_names_step_and_metric(tmp_path, cache_dir):
  c = tiny_config(steps=3, checkpoint_every=1, inject_nan_step=2, nonfinite="stop",
                  compile_cache=cache_dir)
  with pytest.raises(nonfinite.NonFiniteError, match="non-finite train_loss and grad_norm at step 2"):
    loop.train_and_evaluate(c, str(tmp_path))
  with CheckpointManager(str(tmp_path / "checkpoints"), save_every=None) as ckpt:
    assert ckpt.all_steps() == [1]     # nothing saved at or after the bad step


@pytest.mark.slow  # real training loop runs: minutes on 2 cores
def test_loop_rollback_mode_restores_last_checkpoint(tmp_path, cache_dir):
  c = tiny_config(steps=4, checkpoint_every=2, inject_nan_step=3, nonfinite="rollback",
                  compile_cache=cache_dir)
  out = loop.train_and_evaluate(c, str(tmp_path))
  assert out["step"] == 4
  s, got = _restore(str(tmp_path), c)
  assert got.step == 4 and int(got.state.opt_state[-1].skipped) == 1
  # Step 4 started from checkpoint 2's model: replay it by hand and compare.
  with CheckpointManager(str(tmp_path / "checkpoints"), save_every=None) as ckpt:
    at2 = ckpt.restore(setup.checkpoint_abstract(s.abstract, s.plan), step=2)
  assert got.state.step == 4 and at2.state.step == 2
  diff = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), got.state.params,
                      at2.state.params)
  assert 0 < max(jax.tree.leaves(diff)) < 0.05   # one optimizer step away, not three


# ------------------------------------------------------------ preemption --

def test_preemption_flag_is_set_by_signal_and_second_signal_is_default():
  w = preemption.PreemptionWatcher(signals=(signal.SIGUSR1,))
  with w:
    assert not w.should_stop(1)
    os.kill(os.getpid(), signal.SIGUSR1)
    assert w.requested and w.should_stop(2) and w.stopped_at == 2
  assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


def test_preemption_decision_is_collective(monkeypatch):
  """Two processes, only the other one was signalled: both stop at the same check."""
  from jax.experimental import multihost_utils
  calls = []
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(multihost_utils, "process_allgather",
                      lambda x: calls.append(int(x)) or np.array([int(x), 1]))
  w = preemption.PreemptionWatcher(check_every=3)
  assert [w.should_stop(s) for s in (1, 2, 3)] == [False, False, True]
  assert calls == [0]         # gathered at step 3 only (check_every), with this flag (0)
  assert w.stopped_at == 3


# ------------------------------------------------------------ validation --

def test_workdir_checks(tmp_path):
  f = tmp_path / "file"
  f.write_text("x")
  with pytest.raises(validate.ConfigError, match="cannot be created"):
    validate.check_workdir(str(f / "run"))
  with pytest.raises(validate.ConfigError, match="not a directory"):
    validate.check_workdir(str(f))
  with pytest.raises(validate.ConfigError, match="MiB free"):
    validate.check_workdir(str(tmp_path / "run"), need_bytes=1 << 60)
  validate.check_workdir(str(tmp_path / "run"), need_bytes=1 << 20)
  assert os.listdir(tmp_path / "run") == []        # the write test leaves nothing behind


def test_checkpoint_bytes():
  a = {"w": jax.ShapeDtypeStruct((10, 4), jnp.float32), "s": jax.ShapeDtypeStruct((), jnp.int32)}
  assert validate.checkpoint_bytes(a, keep=2) == 4 * (160 + 4)


def test_embedding_checks():
  base = tiny_config().embedding
  validate.check_embedding(SPEC, base, {"hist_ad": "ad"})
  for field, value, msg in (("dim", 0, "dim=0"), ("sharding", "diagonal", "sharding"),
                            ("id_policy", "drop", "id_policy"), ("optimizer", "lamb", "optimizer"),
                            ("lr", 0.0, "lr")):
    e = base.copy_and_resolve_references()
    e[field] = value
    with pytest.raises(validate.ConfigError, match=msg):
      validate.check_embedding(SPEC, e, {})
  with pytest.raises(validate.ConfigError, match="'clicks_ad' is not among"):
    validate.check_embedding(SPEC, base, {"clicks_ad": "ad"})
  with pytest.raises(validate.ConfigError, match="'item', which is not among"):
    validate.check_embedding(SPEC, base, {"hist_ad": "item"})
  strict = base.copy_and_resolve_references()
  strict.id_policy = "error"
  with pytest.raises(validate.ConfigError, match="larger ids"):
    validate.check_embedding(SPEC, strict, {"user": "ad"})    # 64 ids into 48 rows


@pytest.mark.parametrize("field,value,msg", [
    ("mesh", (3, 3), "config.mesh"),
    ("data.train", "/nonexistent/day_*.gz", "config.data"),
    ("embedding.sharding", "diagonal", "embedding.sharding"),
])
def test_setup_errors_before_compiling(field, value, msg):
  c = tiny_config()
  if field == "data.train":
    c.data.kind, c.data.eval = "criteo", "/nonexistent/eval.gz"
  node, key = (c, field) if "." not in field else (c[field.split(".")[0]], field.split(".")[1])
  node[key] = value
  with pytest.raises(validate.ConfigError, match=msg):
    setup.setup(c)
