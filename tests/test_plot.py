"""scripts/plot.py: series parsing and PNG output from a metrics.jsonl."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "plot.py")


@pytest.fixture(scope="module")
def plot():
  spec = importlib.util.spec_from_file_location("plot_script", SCRIPT)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def write_run(workdir):
  rows = []
  for s in range(1, 11):
    rows.append({"step": s, "train_loss": 1.0 / s, "examples_per_s": 1000.0 + s,
                 "step_time_s": 0.1, "mfu": 0.01 * s})
    if s % 5 == 0:
      rows.append({"step": s, "eval_auc": 0.6 + 0.01 * s, "eval_ne": 0.9,
                   "eval_auc/click/domain_0": 0.7, "eval_logloss": 0.5,
                   "oracle_auc": 0.8, "note": "x"})
  rows.append({"step": 3, "train_loss": 7.0})         # a resumed run re-logs step 3
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")
    f.write('{"step": 11, "train_lo')                   # cut by a crash


def test_read_series(plot, tmp_path):
  write_run(tmp_path)
  s = plot.read_series(str(tmp_path / "metrics.jsonl"))
  assert [x for x, _ in s["train_loss"]] == list(range(1, 11))
  assert dict(s["train_loss"])[3] == 7.0
  assert s["eval_auc"] == [(5, pytest.approx(0.65)), (10, pytest.approx(0.7))]
  assert "note" not in s


def test_plot_run_writes_pngs(plot, tmp_path):
  write_run(tmp_path)
  paths = plot.plot_run(str(tmp_path))
  assert sorted(os.path.basename(p) for p in paths) == ["auc_ne.png", "loss.png",
                                                        "throughput.png"]
  for p in paths:
    with open(p, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(p) > 5000


def test_selection_of_series(plot):
  keys = {"eval_auc": [(1, 0.7)], "auc/click": [(1, 0.7)], "eval_auc/click/domain_1": [(1, 0.7)],
          "oracle_auc": [(1, 0.8)], "eval_ne": [(1, 0.9)], "ne/click": [(1, 0.9)],
          "examples_per_s": [(1, 1.0)], "engine": [(1, 1.0)]}
  assert plot._select(keys, lambda k: bool(plot._AUC.search(k))) == ["auc/click", "eval_auc"]
  assert plot._select(keys, lambda k: bool(plot._NE.search(k))) == ["eval_ne", "ne/click"]


def test_cli(tmp_path):
  write_run(tmp_path)
  out = subprocess.run([sys.executable, SCRIPT, str(tmp_path), "--out", str(tmp_path / "o")],
                       check=True, capture_output=True, text=True, timeout=120).stdout
  assert sorted(os.listdir(tmp_path / "o")) == ["auc_ne.png", "loss.png", "throughput.png"]
  assert out.count(".png") == 3
  missing = subprocess.run([sys.executable, SCRIPT, str(tmp_path / "none")],
                           capture_output=True, text=True, timeout=120)
  assert missing.returncode != 0 and "no metrics.jsonl" in missing.stderr
