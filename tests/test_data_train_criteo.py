"""`scripts/train.py --config configs/criteo.py` on Criteo-format files other than the sample.

The train files are a gzip copy of the sample's train split found through a
glob, the eval file a 300-row cut of the dev split: the final JSON line must
report eval_auc. Slow (~20-40 s each on 2 cores): run with `-m slow`.
"""
import gzip
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")


def run_train(tmp_path, real_data_dir, model):
  data = tmp_path / "data"
  data.mkdir()
  with open(os.path.join(real_data_dir, "criteo_kaggle_8k_train.tsv"), "rb") as f:
    (data / "day-0.tsv.gz").write_bytes(gzip.compress(f.read()))
  with open(os.path.join(real_data_dir, "criteo_kaggle_8k_dev.tsv"), "rb") as f:
    (data / "eval.tsv").write_bytes(b"".join(f.readlines()[:300]))
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "train.py"),
         "--config", os.path.join(ROOT, "configs", "criteo.py"),
         "--workdir", str(tmp_path / "run"),
         f"--config.data.train={data}/day-*.gz", f"--config.data.eval={data}/eval.tsv",
         f"--config.model.name={model}", "--config.model.preset=tiny",
         "--config.train.steps=3", "--config.train.eval_every=3", "--config.train.log_every=3",
         "--config.train.checkpoint_every=3"]
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
  out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
  assert out.returncode == 0, out.stderr[-3000:]
  final = json.loads(out.stdout.strip().splitlines()[-1])
  assert 0.0 <= final["eval_auc"] <= 1.0 and final["step"] == 3
  return final


@pytest.mark.slow
def test_train_script_on_other_criteo_files_dlrm(tmp_path, real_data_dir):
  run_train(tmp_path, real_data_dir, "dlrm")


@pytest.mark.slow
def test_train_script_on_other_criteo_files_gem(tmp_path, real_data_dir):
  if importlib.util.find_spec("gem_jax.models.gem") is None:
    pytest.fail("gem_jax.models.gem is not there yet")
  run_train(tmp_path, real_data_dir, "gem")
