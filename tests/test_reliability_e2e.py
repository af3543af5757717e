"""Reliability through the real entry script, killed from outside (subprocesses of tiny).

  * SIGTERM mid-run: exit status 0, a sealed checkpoint at the last logged step;
    the restart resumes from it and its losses and final state equal an
    uninterrupted run's bit for bit (same config, seed and mesh).
  * SIGKILL while an async save is in flight (an Orbax temporary directory
    exists): the temporary checkpoint is never picked; the restart resumes from
    the newest complete one.
  * scripts/chaos.py at a small scale (slow).
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import chaos  # noqa: E402  pylint: disable=wrong-import-position

from gem_jax.train import integrity  # noqa: E402  pylint: disable=wrong-import-position


def _start(workdir, cache, steps, every, **extra):
  cmd = chaos.child_cmd(str(workdir), steps, str(cache))
  cmd = [c for c in cmd if not c.startswith("--config.train.checkpoint_every")]
  cmd.append(f"--config.train.checkpoint_every={every}")
  cmd += [f"--config.train.{k}={v}" for k, v in extra.items()]
  return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=chaos.child_env(), cwd=ROOT)


def _finish(proc):
  out, err = proc.communicate(timeout=900)
  return proc.returncode, out, err


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  return tmp_path_factory.mktemp("xla_cache")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache):
  d = tmp_path_factory.mktemp("reference")
  rc, _, err = _finish(_start(d, cache, steps=8, every=4))
  assert rc == 0, err[-3000:]
  return d


@pytest.mark.slow  # real training loop runs: minutes on 2 cores
def test_sigterm_checkpoints_exits_0_and_resume_is_bit_identical(tmp_path, cache, reference):
  proc = _start(tmp_path, cache, steps=8, every=4)
  while len(chaos.logged_steps(str(tmp_path))) < 2 and proc.poll() is None:
    time.sleep(0.005)
  proc.send_signal(signal.SIGTERM)
  rc, _, err = _finish(proc)
  assert rc == 0, err[-3000:]
  last = chaos.logged_steps(str(tmp_path))[-1][0]
  assert 2 <= last < 8 and "preempted (SIGTERM)" in err
  ckpt = tmp_path / "checkpoints"
  assert max(chaos.complete_steps(str(ckpt))) == last
  assert integrity.verify(str(ckpt / str(last))) is True      # saved, finished and sealed
  rc, _, err = _finish(_start(tmp_path, cache, steps=8, every=4))
  assert rc == 0, err[-3000:]
  assert f"resumed from the checkpoint at step {last}" in err
  ref = chaos.logged_steps(str(reference))
  got = chaos.logged_steps(str(tmp_path))
  assert [s for s, _ in got] == list(range(1, 9)) == [s for s, _ in ref]
  assert [v for _, v in got] == [v for _, v in ref]           # bit-identical losses
  assert chaos.final_states_equal(str(reference), str(tmp_path), 8)


@pytest.mark.slow  # real training loop runs: minutes on 2 cores
def test_sigkill_during_async_save_restarts_from_newest_complete(tmp_path, cache):
  ckpt = tmp_path / "checkpoints"
  for _ in range(5):  # the save must be caught in flight; tiny saves take ~0.1 s
    proc = _start(tmp_path, cache, steps=400, every=1)
    seen = False
    while proc.poll() is None:
      if chaos.has_tmp(str(ckpt)) and chaos.complete_steps(str(ckpt)):
        proc.send_signal(signal.SIGKILL)
        seen = True
        break
      time.sleep(0.001)
    proc.communicate(timeout=600)
    if seen and chaos.has_tmp(str(ckpt)) and chaos.complete_steps(str(ckpt)):
      break
  else:
    pytest.skip("never caught a save in flight")
  names = os.listdir(ckpt)
  tmp_steps = [int(n.split(".")[0]) for n in names if chaos.TMP_MARK in n]
  complete = chaos.complete_steps(str(ckpt))
  assert tmp_steps and max(tmp_steps) > max(complete, default=0)  # the unfinished one is newer
  last = max(complete)
  rc, _, err = _finish(_start(tmp_path, cache, steps=last + 1, every=1))
  assert rc == 0, err[-3000:]
  assert f"resumed from the checkpoint at step {last}" in err
  assert "corrupt checkpoint" not in err
  assert max(chaos.complete_steps(str(ckpt))) == last + 1


@pytest.mark.slow
def test_chaos_small(tmp_path):
  out = chaos.main(["--trials", "4", "--seed", "1", "--workdir", str(tmp_path)])
  assert out["restarts_ok"] == 4 and out["checkpoints_lost"] == 0
  assert out["corrupt_restores"] == 0 and out["final_state_equal"] and out["losses_equal"]
  line = json.dumps(out)
  assert "final_state_equal" in line
