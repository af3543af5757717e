"""Storage faults under the checkpoint manager: a full disk, a read-only directory, a
slow save, a checkpoint deleted while it is restored.

Faults are injected at the write layer Orbax's Python-side files go through
(`etils.epath` paths: the JSON items and metadata of every step; the arrays are
written by tensorstore, and a failed commit of any item fails the save the same
way), and, where the machine allows mounting (root), also on a real size-limited
or read-only tmpfs (those tests are skipped elsewhere).
"""
import errno
import os
import re
import shutil
import subprocess
import threading
import time

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from etils.epath import gpath

from conftest import make_mesh
from gem_jax.train import integrity
from gem_jax.train.checkpoint import CheckpointManager, CheckpointSaveError, abstract_like
from test_checkpoint import assert_trees_equal, make_state
from test_reliability import cache_dir, tiny_config  # noqa: F401  pylint: disable=unused-import
from test_reliability import two_checkpoints  # noqa: F401  pylint: disable=unused-import

_STEP = re.compile(r"/(\d+)\.orbax-checkpoint-tmp")


def _write_hook(monkeypatch, fn):
  """Calls fn(step, path) before every file Orbax opens for writing inside a step's
  temporary directory."""
  orig = gpath._GPath.open  # pylint: disable=protected-access

  def open_(self, mode="r", **kw):
    m = _STEP.search(os.fspath(self))
    if m and any(c in mode for c in "wax"):
      fn(int(m.group(1)), os.fspath(self))
    return orig(self, mode, **kw)

  monkeypatch.setattr(gpath._GPath, "open", open_)  # pylint: disable=protected-access


def fail_writes(monkeypatch, steps, code=errno.ENOSPC):
  """Writes of the saves of `steps` fail with OSError(code)."""
  def fn(step, path):
    if step in steps:
      raise OSError(code, os.strerror(code), path)
  _write_hook(monkeypatch, fn)


def _partials(d):
  return [n for n in os.listdir(d) if ".orbax-checkpoint-tmp" in n]


@pytest.fixture
def states():
  mesh = make_mesh(1, 8)
  return [make_state(mesh, seed=i)[0] for i in range(4)]


# ------------------------------------------------------------ full disk --

def test_enospc_during_async_save_is_reported_and_training_goes_on(tmp_path, states, caplog,
                                                                   monkeypatch):
  """keep=1: the failed save of step 2 had planned to delete checkpoint 1; it must not."""
  d = tmp_path / "ckpt"
  fail_writes(monkeypatch, {2})
  with CheckpointManager(str(d), save_every=1, keep=1) as ckpt:
    assert ckpt.save(1, states[1])
    assert ckpt.save(2, states[2])          # async: the failure is not known yet
    assert ckpt.save(3, states[3])          # collects it, then saves 3
    assert ckpt.failures == 0 or ckpt.failures == 1
    msg = ckpt.last_error
    assert re.fullmatch(r"checkpoint save failed at step 2: \S*/2\.orbax-checkpoint-tmp\S*: "
                        r"No space left on device \(ENOSPC\)", msg), msg
    assert msg in caplog.text and "committed checkpoints [1] untouched" in caplog.text
    # Its partial directory is removed then, or is already gone (Orbax's writes may still be
    # creating or deleting it when the failure is collected): either way none is left below.
    left = r"removed \[[^\]]*2\.orbax-checkpoint-tmp[^\]]*\]|no partial directory left"
    assert re.search(rf"; ({left});", caplog.text), caplog.text
    ckpt.wait()
    assert ckpt.failures == 0 and not ckpt.last_save_failed
  assert sorted(int(n) for n in os.listdir(d) if n.isdigit()) == [3]
  assert _partials(d) == []
  with CheckpointManager(str(d), save_every=1) as ckpt:
    got = ckpt.restore(abstract_like(states[3]))
  assert got.step == 3
  assert_trees_equal(got.state, states[3])


def test_failed_save_keeps_every_committed_checkpoint(tmp_path, states, monkeypatch):
  d = tmp_path / "ckpt"
  fail_writes(monkeypatch, {3})
  with CheckpointManager(str(d), save_every=1, keep=2) as ckpt:
    ckpt.save(1, states[1])
    ckpt.save(2, states[2])
    ckpt.save(3, states[3])
    ckpt.wait()                             # collects the failure of 3 (tolerated)
    assert ckpt.last_save_failed and ckpt.all_steps() == [1, 2]
    for s in (1, 2):
      assert integrity.verify(str(d / str(s))) is True
    got = ckpt.restore(abstract_like(states[2]))
    assert got.step == 2
    assert_trees_equal(got.state, states[2])
    ckpt.close(check=False)
  assert _partials(d) == []   # writes still running may recreate it after `wait`: close looks again


def test_save_failures_in_a_row_stop_with_a_clear_error(tmp_path, states, monkeypatch):
  d = tmp_path / "ckpt"
  fail_writes(monkeypatch, {2, 3, 4, 5})
  ckpt = CheckpointManager(str(d), save_every=1, keep=1, max_save_failures=2)
  ckpt.save(1, states[1])
  ckpt.save(2, states[2])
  ckpt.save(3, states[2])                   # failure 1 (of step 2) collected
  ckpt.save(4, states[2])                   # failure 2 (step 3)
  with pytest.raises(CheckpointSaveError, match=r"checkpoint save failed at step 4: .*No space "
                     r"left on device \(ENOSPC\); 3 checkpoint saves in a row failed \(2 "
                     r"tolerated: train.save_failures\); newest committed checkpoint: 1"):
    ckpt.save(5, states[2])                 # failure 3 (step 4): more than 2 in a row
  ckpt.close(check=False)
  assert integrity.complete_steps(str(d)) == [1] and _partials(d) == []
  assert integrity.verify(str(d / "1")) is True


def test_failed_last_save_is_an_error_at_close(tmp_path, states, monkeypatch):
  fail_writes(monkeypatch, {2})
  ckpt = CheckpointManager(str(tmp_path), save_every=1)
  ckpt.save(1, states[1])
  ckpt.save(2, states[2], force=True)
  with pytest.raises(CheckpointSaveError, match=r"the last checkpoint save failed \(checkpoint "
                     r"save failed at step 2: .*\); newest committed checkpoint: 1"):
    ckpt.close()


def test_a_bug_is_not_taken_for_a_storage_fault(tmp_path, states, monkeypatch):
  """Only file-system errors are survived; anything else propagates as it is."""
  def fn(step, path):
    if step == 2:
      raise KeyError("not a disk problem")
  _write_hook(monkeypatch, fn)
  ckpt = CheckpointManager(str(tmp_path), save_every=1)
  ckpt.save(1, states[1])
  ckpt.save(2, states[2])
  with pytest.raises(KeyError, match="not a disk problem"):
    ckpt.wait()
  with pytest.raises(KeyError):   # the save's other writes failed the same way
    ckpt.close(check=False)


# ---------------------------------------------------------- read-only --

def test_read_only_directory_mid_run(tmp_path, states, caplog, monkeypatch):
  """Creating the step's temporary directory fails (EROFS) inside `save`."""
  d = tmp_path / "ckpt"
  orig = gpath._GPath.mkdir  # pylint: disable=protected-access
  read_only = {"on": False}

  def mkdir(self, *a, **kw):
    if read_only["on"] and os.fspath(self).startswith(str(d)):
      raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(self))
    return orig(self, *a, **kw)

  monkeypatch.setattr(gpath._GPath, "mkdir", mkdir)  # pylint: disable=protected-access
  with CheckpointManager(str(d), save_every=1, keep=1) as ckpt:
    ckpt.save(1, states[1])
    ckpt.wait()
    read_only["on"] = True
    assert not ckpt.save(2, states[2])
    assert re.fullmatch(r"checkpoint save failed at step 2: \S+: Read-only file system "
                        r"\(EROFS\)", ckpt.last_error), ckpt.last_error
    assert ckpt.last_error in caplog.text and ckpt.all_steps() == [1]
    read_only["on"] = False                 # remounted read-write: saving resumes
    assert ckpt.save(3, states[3])
  assert integrity.complete_steps(str(d)) == [3]


# -------------------------------------------- real file systems (root) --

def _mount_tmpfs(path, size):
  os.makedirs(path, exist_ok=True)
  if os.geteuid() != 0 or shutil.which("mount") is None:
    pytest.skip("mounting a size-limited tmpfs needs root")
  r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                     capture_output=True, text=True, check=False)
  if r.returncode:
    pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")


@pytest.fixture
def tmpfs(tmp_path):
  mnt = tmp_path / "fs"
  _mount_tmpfs(mnt, "4m")
  yield mnt
  subprocess.run(["umount", "-l", str(mnt)], check=False)


def _big(seed):
  return {"w": jnp.asarray(np.random.default_rng(seed).normal(size=(200_000,)).astype(
      np.float32))}   # 800 KB


def test_real_full_disk(tmpfs, caplog):
  """A filler file takes the free space after checkpoint 1: the real ENOSPC of the array
  write (tensorstore) is reported; once space is back, saving resumes."""
  d = tmpfs / "ckpt"
  with CheckpointManager(str(d), save_every=1, keep=1) as ckpt:
    ckpt.save(1, _big(1))
    ckpt.wait()
    filler = tmpfs / "filler"
    with open(filler, "wb") as f:
      try:
        while True:
          f.write(b"\0" * 65536)
      except OSError as e:
        assert e.errno == errno.ENOSPC
    ckpt.save(2, _big(2))
    ckpt.wait()
    assert ckpt.last_save_failed, "the save should have failed on a full disk"
    assert re.fullmatch(r"checkpoint save failed at step 2: \S+: No space left on device "
                        r"\(ENOSPC\)", ckpt.last_error), ckpt.last_error
    # A write of the failed save still running may recreate its temporary directory after
    # its removal (Orbax stops waiting at the first failed write): the next save, `wait`
    # and `close` remove it again, so it is checked after save 3, not here.
    assert ckpt.all_steps() == [1]
    assert integrity.verify(str(d / "1")) is True
    os.remove(filler)
    assert ckpt.save(3, _big(3))
    ckpt.wait()
    assert not [p for p in _partials(d) if p.startswith("3")]
  assert integrity.complete_steps(str(d)) == [3] and _partials(d) == []
  with CheckpointManager(str(d), save_every=1) as ckpt:
    got = ckpt.restore(abstract_like(_big(3)))
  np.testing.assert_array_equal(np.asarray(got.state["w"]), np.asarray(_big(3)["w"]))


def test_real_read_only_remount(tmpfs):
  d = tmpfs / "ckpt"
  with CheckpointManager(str(d), save_every=1, keep=1) as ckpt:
    ckpt.save(1, _big(1))
    ckpt.wait()
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    try:
      ckpt.save(2, _big(2))
      ckpt.wait()
      assert ckpt.last_save_failed
      assert "Read-only file system (EROFS)" in ckpt.last_error, ckpt.last_error
      assert ckpt.all_steps() == [1] and integrity.verify(str(d / "1")) is True
    finally:
      subprocess.run(["mount", "-o", "remount,rw", str(tmpfs)], check=True)
    assert ckpt.save(3, _big(3))
  assert integrity.complete_steps(str(d)) == [3]


# ---------------------------------------------------------- slow saves --

@pytest.fixture
def slow_write(monkeypatch):
  """The save of step 2 blocks in its background write until `release` is set."""
  entered, release = threading.Event(), threading.Event()

  def fn(step, path):
    if step == 2:
      entered.set()
      release.wait(timeout=120)
  _write_hook(monkeypatch, fn)
  return entered, release


@pytest.mark.parametrize("busy", ["wait", "skip"])
def test_slow_save_never_piles_up(tmp_path, states, slow_write, busy, caplog):
  """Bound ('wait'): the next save waits for the rest of the slow one, then returns
  (its own write is async again); 'skip': a periodic save due meanwhile is skipped with
  a message, a forced one waits. Generous bound: 30 s after the slow write is released
  (measured here: well under 1 s)."""
  entered, release = slow_write
  with CheckpointManager(str(tmp_path), save_every=1, busy=busy) as ckpt:
    ckpt.save(1, states[1])
    ckpt.wait()
    assert ckpt.save(2, states[2])        # returns although its write is stuck
    assert entered.wait(60) and not release.is_set()
    if busy == "skip":
      assert not ckpt.save(3, states[3])
      assert "checkpoint at step 3 skipped: the save of step 2 is still being written" \
          in caplog.text
    released_at = []
    timer = threading.Timer(1.0, lambda: (released_at.append(time.perf_counter()),
                                          release.set()))
    timer.start()
    assert ckpt.save(4, states[3], force=busy == "skip")
    done = time.perf_counter()
    assert released_at, "save 4 must have waited for save 2"
    assert ckpt.last_wait_s >= 0.5
    assert done - released_at[0] < 30.0
    print(f"busy={busy}: save 4 waited {ckpt.last_wait_s:.2f} s, returned "
          f"{done - released_at[0]:.3f} s after the slow write was released")
    ckpt.wait()
    assert ckpt.all_steps() == [1, 2, 4] and not ckpt.last_save_failed


# -------------------------------------- deleted while being restored --

@pytest.mark.parametrize("what", ["directory", "files"])
def test_checkpoint_deleted_while_restoring_falls_back(two_checkpoints, what, caplog,  # noqa: F811
                                                       monkeypatch):
  d, s1, _ = two_checkpoints
  orig = ocp.CheckpointManager.restore

  def restore(self, step, *a, **kw):
    if step == 2:   # another process deletes it after it was listed and verified
      if what == "directory":
        shutil.rmtree(d / "2")
      else:
        for root, _, names in os.walk(d / "2" / "state"):
          for n in names:
            if n != "_METADATA":
              os.remove(os.path.join(root, n))
    return orig(self, step, *a, **kw)

  monkeypatch.setattr(ocp.CheckpointManager, "restore", restore)
  with CheckpointManager(str(d), save_every=1, keep=5) as ckpt:
    got = ckpt.restore(abstract_like(s1))
    assert got.step == 1 and ckpt.all_steps() == [1]
  assert_trees_equal(got.state, s1)
  if what == "directory":
    assert f"checkpoint {d / '2'} disappeared: deleted while being restored" in caplog.text
  else:
    assert "corrupt checkpoint: " in caplog.text and ": missing" in caplog.text
    assert os.path.isdir(str(d) + "_corrupt/2")
  assert "falling back to the previous one" in caplog.text


def test_checkpoint_deleted_after_listing(two_checkpoints, caplog):  # noqa: F811
  d, s1, _ = two_checkpoints
  got = integrity.restore_newest(str(d), [1, 2], lambda s: s)
  assert got == 2
  shutil.rmtree(d / "2")
  assert integrity.restore_newest(str(d), [1, 2], lambda s: s) == 1
  assert f"checkpoint {d / '2'} disappeared: deleted after it was listed" in caplog.text


# ---------------------------------------------------------- the trainer --

@pytest.mark.slow  # two real training runs of tiny: minutes on 2 cores
def test_trainer_survives_failed_saves_and_stops_past_the_tolerance(  # noqa: F811
    tmp_path, cache_dir, monkeypatch, caplog):
  from gem_jax.train import loop  # pylint: disable=import-outside-toplevel
  fail_writes(monkeypatch, {2, 3})
  c = tiny_config(steps=5, checkpoint_every=1, keep=1, compile_cache=cache_dir)
  out = loop.train_and_evaluate(c, str(tmp_path / "ok"))
  assert out["step"] == 5
  for step in (2, 3):
    assert f"checkpoint save failed at step {step}: " in caplog.text
  assert integrity.complete_steps(str(tmp_path / "ok" / "checkpoints")) == [5]
  c = tiny_config(steps=5, checkpoint_every=1, keep=1, compile_cache=cache_dir,
                  save_failures=1)
  with pytest.raises(CheckpointSaveError, match=r"2 checkpoint saves in a row failed \(1 "
                     r"tolerated: train.save_failures\); newest committed checkpoint: 1"):
    loop.train_and_evaluate(c, str(tmp_path / "stop"))
  assert integrity.complete_steps(str(tmp_path / "stop" / "checkpoints")) == [1]
