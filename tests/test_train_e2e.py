"""End to end through the real entry scripts on the tiny config.

A 40-step run (tiny with a larger batch and learning rates, so it learns), and the
same run stopped at step 20 (simulated preemption) then restarted: the restarted run
resumes from its checkpoint (state and data position) and logs exactly the losses of
the uninterrupted run. The run must learn the planted synthetic signal: beat a
logistic regression on the id-free features of the same rows and close a fixed
fraction of the AUC gap to the oracle. Then scripts/evaluate.py restores the final
checkpoint and reproduces the final eval.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from gem_jax.data.synthetic import SyntheticSource, rank_auc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, BATCH, EVAL_ROWS = 40, 256, 2048
LEARN = (f"--config.train.steps={STEPS}", "--config.train.eval_every=20",
         "--config.train.checkpoint_every=20", f"--config.data.batch_size={BATCH}",
         f"--config.data.eval_examples={EVAL_ROWS}", "--config.data.eval_batch_size=256",
         f"--config.train.eval_batches={EVAL_ROWS // 256}", "--config.optim.lr=1e-2",
         "--config.embedding.lr=0.2")


def _run(script, workdir, *overrides, cache=None):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  cmd = [sys.executable, os.path.join(ROOT, "scripts", script), "--config",
         os.path.join(ROOT, "configs", "tiny.py"), "--workdir", str(workdir), *LEARN,
         *overrides]
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
  part, _ = _run("train.py", tmp / "resumed", "--config.train.stop_at=20", cache=cache)
  resumed, err = _run("train.py", tmp / "resumed", cache=cache)
  return tmp, full, part, resumed, err


def test_final_line_has_the_summary(runs):
  _, full, _, _, _ = runs
  for key in ("step", "examples_per_s", "mfu", "train_loss", "eval_auc", "eval_logloss",
              "eval_ne", "compile_s", "oracle_auc"):
    assert key in full, key
  assert full["step"] == STEPS and np.isfinite(full["train_loss"]) and full["examples_per_s"] > 0


def _id_free_baseline(seed):
  """Mean AUC over tasks of a logistic regression (Newton) on dense + domain one-hot, fitted
  on the run's training rows and scored on its eval rows (same data seed and streams)."""
  def feats(b):
    return np.concatenate([b["dense"].astype(np.float64), np.eye(2)[b["domain"]]], 1)
  train = SyntheticSource("tiny", split="train").examples(0, STEPS * BATCH, seed)
  ev = SyntheticSource("tiny", split="eval").examples(0, EVAL_ROWS, seed)
  aucs = []
  for t in range(2):
    mt, me = train["label_mask"][:, t] > 0, ev["label_mask"][:, t] > 0
    x, y, w = feats(train)[mt], train["labels"][mt, t], np.zeros(4)
    for _ in range(25):
      p = 1 / (1 + np.exp(-x @ w))
      w -= np.linalg.solve((x * (p * (1 - p))[:, None]).T @ x + 1e-6 * np.eye(4), x.T @ (p - y))
    aucs.append(rank_auc(feats(ev)[me] @ w, ev["labels"][me, t]))
  return float(np.mean(aucs))


def test_learns_the_planted_signal(runs):
  # Measured with these overrides (--config.seed=0, 1, 2; eval on 2,048 rows, oracle AUC 0.717):
  #   eval_auc          0.6285  0.6168  0.6223   (range 0.012)
  #   auc_gap_closed    0.592   0.538   0.563
  #   id-free baseline  0.5355  0.5575  0.5608   eval_auc - baseline: 0.093 0.059 0.062
  # Thresholds sit well under the worst seed: gap closed >= 0.45, baseline + 0.03.
  # (A logistic regression on the one-hot ids too reaches 0.631 0.659 0.635 on the same
  # rows: at this budget tiny does not beat it.) With --config.optim.lr=0
  # --config.embedding.lr=1e-30 (the validator wants > 0): eval_auc 0.512, gap closed 0.057.
  _, full, _, _, _ = runs
  assert full["oracle_auc"] > 0.69
  assert full["auc_gap_closed"] >= 0.45, full
  baseline = _id_free_baseline(seed=0)
  assert full["eval_auc"] > baseline + 0.03, (full["eval_auc"], baseline)


def test_resumed_losses_equal_uninterrupted(runs):
  tmp, full, part, resumed, err = runs
  assert part["step"] == 20 and resumed["step"] == STEPS
  assert "resumed from the checkpoint at step 20" in err
  a, b = _losses(tmp / "full"), _losses(tmp / "resumed")
  assert sorted(a) == list(range(1, STEPS + 1)) and sorted(b) == list(range(1, STEPS + 1))
  # Two processes running the same compiled step can differ in the last bit on
  # XLA:CPU (multi-threaded reductions), so "equal" is to fp32 rounding here;
  # the restored state itself is bit-exact (tests/test_state.py).
  np.testing.assert_allclose([b[s] for s in sorted(b)], [a[s] for s in sorted(a)],
                             rtol=2e-6, atol=0)
  assert resumed["eval_auc"] == pytest.approx(full["eval_auc"], abs=1e-4)
  assert os.path.isdir(tmp / "full" / "tb")
  assert os.path.isdir(tmp / "full" / "checkpoints" / str(STEPS))
  traces = [f for _, _, fs in os.walk(tmp / "full" / "plugins") for f in fs]
  assert any(f.endswith(".xplane.pb") for f in traces), traces  # profiler switch


def test_evaluate_script_restores_latest(runs):
  tmp, full, _, _, _ = runs
  out, _ = _run("evaluate.py", tmp / "full")
  assert out["step"] == STEPS
  assert out["eval_auc"] == pytest.approx(full["eval_auc"], abs=1e-4)
  assert out["eval_logloss"] == pytest.approx(full["eval_logloss"], rel=1e-5)
