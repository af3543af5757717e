"""Knowledge generation and student training with 2 processes x 4 CPU devices vs 1 x 8.

Both run tests/multihost_transfer_worker.py (the 2 x 4 one through
scripts/launch_local.sh, on loopback) on the same (2, 4) mesh, global batch and
teacher checkpoint. Each process reads its `B / P` rows of every global batch
(before the fix the transfer code asked the sources for `B / P` and got
`B / P^2` rows a process), so: every student row gets its knowledge exactly
once, the two layouts hold the same knowledge, and the student's losses and
metrics agree to fp32 rounding.

Slow: two process shapes compile the teacher forward and the student steps.
"""
import json
import os
import sys

import numpy as np
import pytest

from test_multihost_runs import FAST_FAILURE, LAUNCH, ROOT, RUN_TIMEOUT_S, _finish, _spawn

import multihost_transfer_worker as worker  # noqa: E402

pytestmark = pytest.mark.slow
WORKER = os.path.join(ROOT, "tests", "multihost_transfer_worker.py")


def _env(devices: int, **extra) -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHON=sys.executable, GEM_JAX_SCRIPT=WORKER,
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", **FAST_FAILURE)
  env.update(extra)
  return env


def _teacher(workdir: str) -> str:
  """An initialised (untrained) teacher checkpoint written by the trainer's checkpoint code."""
  from gem_jax.train import checkpoint as ckpt_lib  # pylint: disable=import-outside-toplevel
  from gem_jax.train import setup  # pylint: disable=import-outside-toplevel
  cfg = worker.teacher_config()
  s = setup.setup(cfg)
  with ckpt_lib.CheckpointManager(os.path.join(workdir, "checkpoints"), save_every=None,
                                  keep=1) as ckpt:
    ckpt.save(1, setup.checkpoint_tree(setup.init_state(s, 3), s.plan), config=cfg, force=True)
  return workdir


def _run(out, teacher, processes: int) -> dict:
  os.makedirs(out, exist_ok=True)
  args = ["--teacher_workdir", teacher, "--out", str(out)]
  logs = os.path.join(out, "logs")
  if processes == 1:
    proc = _spawn([sys.executable, WORKER, *args], _env(8), os.path.join(out, "stderr.log"))
  else:
    proc = _spawn(["bash", LAUNCH, str(processes), str(8 // processes), "--", *args],
                  _env(8 // processes, GEM_JAX_LOG_DIR=logs), os.path.join(out, "stderr.log"))
  stdout = _finish(proc, RUN_TIMEOUT_S)
  if proc.returncode != 0:
    tails = [open(os.path.join(out, "stderr.log")).read()[-3000:]]
    if os.path.isdir(logs):
      tails += [open(os.path.join(logs, f)).read()[-3000:] for f in sorted(os.listdir(logs))]
    pytest.fail(f"{processes}-process run failed ({proc.returncode}):\n" + "\n----\n".join(tails))
  return json.loads(stdout.strip().splitlines()[-1])


def _global_rows(directory: str, index: dict) -> dict:
  """Every process's knowledge rows back in global row order: batch by batch, process by
  process (each process wrote its `B / P` rows of every global batch)."""
  from gem_jax.transfer import knowledge as kn  # pylint: disable=import-outside-toplevel
  pc, local = index["process_count"], index["batch_size"] // index["process_count"]
  readers = [kn.ShardReader(directory, p, index["shards"][p]) for p in range(pc)]
  assert all(r.total == index["num_batches"] * local for r in readers)
  parts = [[r.read(local) for r in readers] for _ in range(index["num_batches"])]
  return {k: np.concatenate([part[k] for batch in parts for part in batch])
          for k in parts[0][0]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("multihost_transfer")
  teacher = _teacher(str(tmp / "teacher"))
  return tmp, _run(tmp / "1x8", teacher, 1), _run(tmp / "2x4", teacher, 2)


def test_every_row_gets_its_knowledge_once_and_the_layouts_agree(runs):
  tmp, one, two = runs
  assert one["process_count"] == 1 and two["process_count"] == 2
  for split, rows in (("train", worker.TRAIN_ROWS), ("eval", worker.EVAL_ROWS)):
    i1, i2 = one["index"][split], two["index"][split]
    assert i1["batch_size"] == i2["batch_size"] == worker.B
    assert i1["num_batches"] == i2["num_batches"] == -(-rows // worker.B)
    assert [sum(s) for s in i2["shards"]] == [i2["num_batches"] * worker.B // 2] * 2
    a = _global_rows(str(tmp / "1x8" / "knowledge" / split), i1)
    b = _global_rows(str(tmp / "2x4" / "knowledge" / split), i2)
    assert int(a["valid"].sum()) == int(b["valid"].sum()) == rows
    assert a["valid"][:rows].all() and not a["valid"][rows:].any()
    real = a["fingerprint"][a["valid"]]
    assert len(np.unique(real)) == rows  # each example once
    np.testing.assert_array_equal(b["fingerprint"], a["fingerprint"])
    np.testing.assert_array_equal(b["valid"], a["valid"])
    for field in ("logits", "trunk"):
      np.testing.assert_allclose(b[field], a[field], rtol=1e-5, atol=1e-5, err_msg=field)


def test_student_trains_on_the_full_batch_and_matches_one_process(runs):
  tmp, one, two = runs

  def logged(run):
    with open(tmp / run / "student" / "metrics.jsonl") as f:
      return [r for r in map(json.loads, f) if "eval_auc" not in r]

  a, b = logged("1x8"), logged("2x4")
  assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4]  # one writer
  # The labelled rows each step trained on: the whole global batch's on both layouts.
  assert [r["labels_observed"] for r in b] == [r["labels_observed"] for r in a]
  for k in ("train_loss", "loss_hard", "loss_soft", "grad_norm"):
    np.testing.assert_allclose([r[k] for r in b], [r[k] for r in a], rtol=0, atol=1e-5,
                               err_msg=k)
  assert one["summary"]["step"] == two["summary"]["step"] == 4
  for k in ("eval_auc", "eval_ne", "train_loss"):
    assert two["summary"][k] == pytest.approx(one["summary"][k], abs=1e-5), k
