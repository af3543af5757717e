"""scripts/preprocess.py then scripts/train.py on the converted dataset.

The synthetic Criteo days of tests/data_fixtures.py (clicks planted on C1, C2, I1)
are converted to the columnar format; DLRM (tiny) trained on it for 24 steps must
learn as on the text files (tests/test_data_train_criteo.py: AUC > 0.66; all
learning rates 0 give 0.48), and a run stopped at step 12 and restarted must log
exactly the losses of the uninterrupted run: the reader's position goes through
the checkpoint.
"""
import json
import os
import subprocess
import sys

import pytest
from data_fixtures import synth_data  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 24


def _script(name, *args):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", name),
                         "--config", os.path.join(ROOT, "configs", "criteo.py"), *args],
                        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return [json.loads(x) for x in proc.stdout.strip().splitlines() if x.startswith("{")]


def _losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {r["step"]: r["train_loss"] for r in map(json.loads, f) if "train_loss" in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, synth_data):  # noqa: F811
  tmp = tmp_path_factory.mktemp("pq_train")
  fx = synth_data.criteo
  data = os.path.dirname(fx["dev"])
  lines = _script("preprocess.py", "--out", str(tmp / "ds"), "--row_group_rows=100",
                  f"--config.data.train={data}/day-*.gz", f"--config.data.eval={fx['dev']}")
  train = ["--config.data.train", str(tmp / "ds" / "train"),
           "--config.data.eval", str(tmp / "ds" / "eval"),
           "--config.model.name=dlrm", "--config.model.preset=tiny",
           f"--config.train.steps={STEPS}", f"--config.train.eval_every={STEPS}",
           "--config.train.log_every=1", "--config.train.checkpoint_every=12",
           "--config.optim.warmup_steps=0", f"--config.train.compile_cache={tmp / 'cache'}"]
  full = _script("train.py", "--workdir", str(tmp / "full"), *train)[-1]
  _script("train.py", "--workdir", str(tmp / "resumed"), *train, "--config.train.stop_at=12")
  resumed = _script("train.py", "--workdir", str(tmp / "resumed"), *train)[-1]
  return tmp, lines, full, resumed


def test_preprocess_writes_both_splits(runs):
  _, lines, _, _ = runs
  assert [(x["split"], x["rows"], x["bad_rows"], x["parser"]) for x in lines] == [
      ("train", 3000, 0, "vectorised"), ("eval", 400, 0, "vectorised")]


def test_training_on_the_converted_dataset_learns(runs):
  _, _, full, _ = runs
  assert full["step"] == STEPS and full["eval_batches"] == 2
  assert full["eval_auc"] > 0.66, full["eval_auc"]


def test_resume_replays_the_same_batches(runs):
  tmp, _, full, resumed = runs
  a, b = _losses(tmp / "full"), _losses(tmp / "resumed")
  assert sorted(b) == list(range(1, STEPS + 1))
  assert [b[s] for s in range(13, STEPS + 1)] == [a[s] for s in range(13, STEPS + 1)]
  assert resumed["eval_auc"] == full["eval_auc"]
