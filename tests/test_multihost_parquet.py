"""Multi-process training on a converted dataset: 2 processes x 4 CPU devices vs 1 x 8.

The synthetic Criteo days are converted (scripts/preprocess.py, 30 row groups) and
trained on with DLRM tiny by one process with 8 devices and by two processes with
4 each (scripts/launch_local.sh). The columnar reader gives every process only its
lanes' rows of each global batch, so the losses agree to fp32 rounding, and each
process reads about half of the bytes (each logs what it read). Slow: two compiles.
"""
import json
import os
import re
import subprocess
import sys

import pytest
from data_fixtures import synth_data  # noqa: F401
from test_multihost_runs import LAUNCH, RUN_TIMEOUT_S, _env, _finish, _spawn, losses

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CRITEO = os.path.join(ROOT, "configs", "criteo.py")
pytestmark = pytest.mark.slow


def _args(workdir, ds, cache):
  return ["--config", CRITEO, "--workdir", str(workdir),
          f"--config.data.train={ds}/train", f"--config.data.eval={ds}/eval",
          "--config.model.name=dlrm", "--config.model.preset=tiny", "--config.mesh=(2,4)",
          "--config.train.steps=16", "--config.train.eval_every=16", "--config.train.log_every=1",
          f"--config.train.compile_cache={cache}"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, synth_data):  # noqa: F811
  tmp = tmp_path_factory.mktemp("mh_pq")
  fx = synth_data.criteo
  ds, cache = tmp / "ds", tmp / "cache"
  subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "preprocess.py"),
                  "--config", CRITEO, "--out", str(ds), "--row_group_rows=100",
                  f"--config.data.train={os.path.dirname(fx['dev'])}/day-*.gz",
                  f"--config.data.eval={fx['dev']}"], check=True, capture_output=True,
                 timeout=300, cwd=ROOT)
  one_dir, two_dir = tmp / "1x8", tmp / "2x4"
  os.makedirs(one_dir)
  proc = _spawn([sys.executable, os.path.join(ROOT, "scripts", "train.py"),
                 *_args(one_dir, ds, cache)], _env(8), os.path.join(one_dir, "stderr.log"))
  one = json.loads(_finish(proc, RUN_TIMEOUT_S).strip().splitlines()[-1])
  assert proc.returncode == 0
  logs = two_dir / "logs"
  os.makedirs(two_dir)
  proc = _spawn(["bash", LAUNCH, "2", "4", "--", *_args(two_dir, ds, cache)],
                _env(4, GEM_JAX_LOG_DIR=str(logs)), os.path.join(two_dir, "stderr.log"))
  two = json.loads(_finish(proc, RUN_TIMEOUT_S).strip().splitlines()[-1])
  assert proc.returncode == 0
  read = {}
  for name in os.listdir(logs):
    for m in re.finditer(r"input: process (\d) of 2 read (\d+) bytes", open(logs / name).read()):
      read[int(m[1])] = int(m[2])
  single = re.findall(r"input: process 0 of 1 read (\d+) bytes",
                      open(one_dir / "stderr.log").read())
  return one_dir, two_dir, one, two, read, int(single[0])


def test_2x4_losses_equal_1x8_on_the_converted_dataset(runs):
  one_dir, two_dir, one, two, _, _ = runs
  a, b = losses(one_dir), losses(two_dir)
  assert sorted(a) == sorted(b) == list(range(1, 17))
  for s in a:
    assert abs(a[s] - b[s]) < 1e-5, (s, a[s], b[s])
  assert abs(one["eval_auc"] - two["eval_auc"]) < 1e-5


def test_each_process_reads_about_half(runs):
  *_, read, single = runs
  assert sorted(read) == [0, 1]
  for p in (0, 1):
    assert abs(read[p] / single - 0.5) < 0.1, (read, single)
