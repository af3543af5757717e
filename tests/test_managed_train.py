"""Managed-collision tables in the trainer: checkpointed with the tables, resumed on another mesh.

A tiny DLRM with every table managed (LFU, TTL 4 steps, 64 rows: the tiny vocabularies
overflow them, so evictions and expiry happen) trains 6 steps on 8 devices (2x4),
checkpointing at step 3; the step-3 checkpoint resumes on 4 devices (1x4). Steps 4-6 must
log the same map counters exactly (not `mc_broadcast`: which route a step takes depends
on the mesh) and the same losses, and the final maps must be equal.
"""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from saved_state import saved_state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = ("--config.train.steps=6", "--config.train.checkpoint_every=3",
          "--config.train.eval_every=6", "--config.train.keep=3", "--config.model.name=dlrm",
          "--config.embedding.per_table=*: id_policy=managed, eviction=lfu, ttl_steps=4, rows=64")


def _train(workdir, devices, mesh):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "train.py"), "--config",
         os.path.join(ROOT, "configs", "tiny.py"), "--workdir", str(workdir), *COMMON,
         f"--config.mesh=({mesh[0]},{mesh[1]})"]
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stderr, json.loads(proc.stdout.strip().splitlines()[-1])


def _log(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {r["step"]: r for r in map(json.loads, f) if "train_loss" in r}


def _maps(workdir, step):
  return {k: v for k, v in saved_state(workdir, step).items() if "map_" in k}


@pytest.mark.slow
def test_managed_tables_resume_on_another_mesh(tmp_path):
  ref_err, ref_out = _train(tmp_path / "ref", 8, (2, 4))
  assert "mc_hit_rate=" in ref_err and "mc_broadcast=" in ref_err   # the progress line
  assert ref_out["mc_evictions/user"] > 0 and "mc_occupancy/ad" in ref_out   # final JSON
  assert 0 <= ref_out["mc_broadcast"] <= 1
  shutil.copytree(tmp_path / "ref" / "checkpoints" / "3",
                  tmp_path / "other" / "checkpoints" / "3")
  err, _ = _train(tmp_path / "other", 4, (1, 4))
  assert "resumed from the checkpoint at step 3" in err
  ref, got = _log(tmp_path / "ref"), _log(tmp_path / "other")
  assert sorted(got) == [4, 5, 6]
  for s in got:
    mc = {k: v for k, v in ref[s].items()   # the route taken depends on the mesh, the maps not
          if k.startswith("mc_") and k != "mc_broadcast"}
    assert mc and mc == {k: got[s][k] for k in mc}, s
    np.testing.assert_allclose(got[s]["train_loss"], ref[s]["train_loss"], rtol=1e-5)
  want, have = _maps(tmp_path / "ref", 6), _maps(tmp_path / "other", 6)
  assert want and sorted(want) == sorted(have)
  for k in want:
    np.testing.assert_array_equal(have[k], want[k], err_msg=k)
