"""Slow: the transfer benchmark script end to end (tiny budget), and the documented workflow
(train teacher -> generate_knowledge.py -> student training from its config)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _run(args, env_extra=None, timeout=900):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
             JAX_PLATFORMS="cpu", **(env_extra or {}))
  out = subprocess.run([sys.executable] + args, cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=timeout)
  assert out.returncode == 0, out.stderr[-3000:]
  return [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{")]


@pytest.mark.slow
def test_transfer_benchmark_tiny(tmp_path, real_data_dir):
  rows = _run(["scripts/transfer_benchmark.py", "--workdir", str(tmp_path), "--seeds", "0",
               "--teacher_steps", "20", "--student_steps", "10", "--student_train", "512",
               "--student_eval", "1024", "--avazu_teacher_steps", "10",
               "--avazu_student_steps", "10", "--data_dir", real_data_dir])
  variants = {(r["dataset"], r["variant"]): r for r in rows}
  for ds in ("planted", "avazu"):
    assert 0.0 < variants[(ds, "teacher")]["teacher_auc_on_student_eval"] < 1.0
    for v in ("alone", "distill", "adapter", "repr", "share", "all"):
      r = variants[(ds, v)]
      assert 0.3 < r["eval_auc"] < 1.0 and r["eval_ne"] > 0, r
      assert r["student_flops_per_example"] > 0
  # Representation transfer adds the teacher-token projection (and only that) to the student.
  assert variants[("planted", "repr")]["student_flops_per_example"] > \
      variants[("planted", "alone")]["student_flops_per_example"]


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
