"""End to end through the real entry scripts on the tiny config.

A 6-step run, and the same run stopped at step 3 (simulated preemption) then
restarted: the restarted run resumes from its checkpoint (state and data
position) and logs exactly the losses of the uninterrupted run. Then
scripts/evaluate.py restores the final checkpoint and reproduces the final eval.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script, workdir, *overrides, cache=None):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  cmd = [sys.executable, os.path.join(ROOT, "scripts", script), "--config",
         os.path.join(ROOT, "configs", "tiny.py"), "--workdir", str(workdir), *overrides]
  if cache is not None:
    cmd.append(f"--config.train.compile_cache={cache}")
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def _losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return {r["step"]: r["train_loss"] for r in rows if "train_loss" in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("e2e")
  cache = tmp / "xla_cache"
  full, _ = _run("train.py", tmp / "full", "--config.train.profile_steps=4,5", cache=cache)
  part, _ = _run("train.py", tmp / "resumed", "--config.train.stop_at=3", cache=cache)
  resumed, err = _run("train.py", tmp / "resumed", cache=cache)
  return tmp, full, part, resumed, err


def test_final_line_has_the_summary(runs):
  _, full, _, _, _ = runs
  for key in ("step", "examples_per_s", "mfu", "train_loss", "eval_auc", "eval_logloss",
              "eval_ne", "compile_s", "oracle_auc"):
    assert key in full, key
  assert full["step"] == 6 and np.isfinite(full["train_loss"])
  assert 0.0 <= full["eval_auc"] <= 1.0 and full["examples_per_s"] > 0


def test_resumed_losses_equal_uninterrupted(runs):
  tmp, full, part, resumed, err = runs
  assert part["step"] == 3 and resumed["step"] == 6
  assert "resumed from the checkpoint at step 3" in err
  a, b = _losses(tmp / "full"), _losses(tmp / "resumed")
  assert sorted(a) == [1, 2, 3, 4, 5, 6] and sorted(b) == [1, 2, 3, 4, 5, 6]
  # Two processes running the same compiled step can differ in the last bit on
  # XLA:CPU (multi-threaded reductions), so "equal" is to fp32 rounding here;
  # the restored state itself is bit-exact (tests/test_state.py).
  np.testing.assert_allclose([b[s] for s in sorted(b)], [a[s] for s in sorted(a)],
                             rtol=2e-6, atol=0)
  assert resumed["eval_auc"] == pytest.approx(full["eval_auc"], abs=1e-4)
  assert os.path.isdir(tmp / "full" / "tb") and os.path.isdir(tmp / "full" / "checkpoints" / "6")
  traces = [f for _, _, fs in os.walk(tmp / "full" / "plugins") for f in fs]
  assert any(f.endswith(".xplane.pb") for f in traces), traces  # profiler switch


def test_evaluate_script_restores_latest(runs):
  tmp, full, _, _, _ = runs
  out, _ = _run("evaluate.py", tmp / "full")
  assert out["step"] == 6
  assert out["eval_auc"] == pytest.approx(full["eval_auc"], abs=1e-4)
  assert out["eval_logloss"] == pytest.approx(full["eval_logloss"], rel=1e-5)
