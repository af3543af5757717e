"""Slow: the transfer benchmark script end to end (tiny budget: planted, and the Avazu sample
when ../shared/data is there), the documented ordering student alone < distilled < Student
Adapter on the planted data at a budget where it is real, and the documented workflow
(train teacher -> generate_knowledge.py -> student training from its config)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
VARIANTS = ("alone", "distill", "adapter", "repr", "share", "all")


def _run(args, env_extra=None, timeout=900):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
             JAX_PLATFORMS="cpu", **(env_extra or {}))
  out = subprocess.run([sys.executable] + args, cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=timeout)
  assert out.returncode == 0, out.stderr[-3000:]
  return [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{")]


def _tiny(workdir, dataset, *extra):
  rows = _run(["scripts/transfer_benchmark.py", "--workdir", str(workdir), "--seeds", "0",
               "--datasets", dataset, "--teacher_steps", "20", "--student_steps", "10",
               "--student_train", "512", "--student_eval", "1024", "--avazu_teacher_steps",
               "10", "--avazu_student_steps", "10", *extra])
  variants = {r["variant"]: r for r in rows}
  assert 0.0 < variants["teacher"]["teacher_auc_on_student_eval"] < 1.0
  for v in VARIANTS:
    r = variants[v]
    assert 0.3 < r["eval_auc"] < 1.0 and r["eval_ne"] > 0, r
    assert r["student_flops_per_example"] > 0
  return variants


@pytest.mark.slow
def test_transfer_benchmark_tiny_planted(tmp_path):
  variants = _tiny(tmp_path, "planted")
  # Representation transfer adds the teacher-token projection (and only that) to the student.
  assert variants["repr"]["student_flops_per_example"] > \
      variants["alone"]["student_flops_per_example"]


@pytest.mark.slow
def test_transfer_benchmark_tiny_avazu(tmp_path, real_data_dir):
  _tiny(tmp_path, "avazu", "--data_dir", real_data_dir)


@pytest.mark.slow
def test_transfer_ordering_on_planted_data(tmp_path):
  """alone < distill < adapter for every student seed (data and teacher fixed).

  Budget: teacher 300 steps x 256 rows, students 200 steps x 128 on the 2,048 fresh rows
  (about 12 epochs: the student alone overfits, which the soft targets prevent), eval on
  8,192 rows. Measured (seeds 0, 1, 2; about 2-7 min on 2 shared cores):
    alone   0.6930 0.6877 0.6766  (mean 0.6858)
    distill 0.7112 0.7118 0.7126  (mean 0.7118)  distill - alone   per seed >= 0.018
    adapter 0.7406 0.7415 0.7389  (mean 0.7403)  adapter - distill per seed >= 0.026
  The documented budget (teacher 600 steps, eval 16,384) gives the same ordering with per-seed
  margins >= 0.019 and >= 0.028. At 100 student steps (teacher 300) the ordering still holds
  but distill - alone shrinks to 0.003-0.011 (the student alone has not overfit yet), so
  this budget is the cheap one where the margins below are real.
  """
  rows = _run(["scripts/transfer_benchmark.py", "--workdir", str(tmp_path), "--seeds", "0,1,2",
               "--datasets", "planted", "--variants", "alone,distill,adapter",
               "--teacher_steps", "300", "--student_steps", "200", "--student_train", "2048",
               "--student_eval", "8192"], timeout=1800)
  auc = {r["variant"]: [s["eval_auc"] for s in r["per_seed"]] for r in rows if "per_seed" in r}
  for a, d, s in zip(auc["alone"], auc["distill"], auc["adapter"]):
    assert d > a + 0.01, auc
    assert s > d + 0.015, auc


@pytest.mark.slow
def test_documented_workflow(tmp_path):
  teacher, kdir = str(tmp_path / "teacher"), tmp_path / "knowledge"
  _run(["scripts/train.py", "--config", "configs/transfer_teacher_planted.py", "--workdir",
        teacher, "--config.train.steps=10", "--config.train.eval_every=10",
        "--config.train.checkpoint_every=10", "--config.data.eval_examples=512"])
  for split in ("train", "eval"):
    (index,) = _run(["scripts/generate_knowledge.py", "--teacher_config",
                     "configs/transfer_teacher_planted.py", "--teacher_workdir", teacher,
                     "--data_config", "configs/student_planted.py", "--split", split,
                     "--out", str(kdir / split)])
    assert index["fields"]["trunk"] == [32] and index["teacher"]["step"] == 10
  cfg = tmp_path / "student.py"
  cfg.write_text(
      "import importlib.util, os\n"
      f"spec = importlib.util.spec_from_file_location('s', {os.path.join(ROOT, 'configs', 'student_planted.py')!r})\n"
      "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
      "def get_config():\n"
      "  c = m.get_config()\n"
      f"  c.knowledge.train, c.knowledge.eval = {str(kdir / 'train')!r}, {str(kdir / 'eval')!r}\n"
      f"  c.teacher.workdir = {teacher!r}\n"
      "  c.train.steps = 5\n"
      "  return c\n")
  (out,) = _run(["-m", "gem_jax.transfer.train", "--config", str(cfg), "--workdir",
                 str(tmp_path / "student")])
  assert out["step"] == 5 and 0.3 < out["eval_auc"] < 1.0 and out["loss_soft"] > 0
  assert os.path.isdir(tmp_path / "student" / "checkpoints" / "5")
