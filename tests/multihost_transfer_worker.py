"""One knowledge-transfer run for tests/test_multihost_transfer.py (any process count).

  python tests/multihost_transfer_worker.py --teacher_workdir T --out DIR
  GEM_JAX_SCRIPT=tests/multihost_transfer_worker.py scripts/launch_local.sh 2 4 -- ...

Restores the teacher of T on a (2, 4) mesh, writes its knowledge of the planted
student data (train and eval splits) under DIR/knowledge, then trains the
student of configs/student_planted.py on it for a few steps (workdir DIR/student,
its metrics.jsonl written by process 0). Process 0 prints one JSON line: the
student's summary and both knowledge indexes.
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402

from gem_jax.data import registry  # noqa: E402
from gem_jax.parallel import distributed  # noqa: E402
from gem_jax.train import predict  # noqa: E402
from gem_jax.transfer import generate  # noqa: E402
from gem_jax.transfer import train as ttrain  # noqa: E402

TEACHER = os.path.join(ROOT, "configs", "transfer_teacher_planted.py")
STUDENT = os.path.join(ROOT, "configs", "student_planted.py")
B = 32            # global batch: 16 rows a process with 2 processes, 4 a device
TRAIN_ROWS = 80   # 2.5 batches: the last one padded
EVAL_ROWS = 64


def teacher_config():
  c = ttrain._load_config(TEACHER)  # pylint: disable=protected-access
  c.mesh = (2, 4)
  c.data.batch_size = c.data.eval_batch_size = B
  return c


def student_config(teacher_workdir: str, out: str, steps: int):
  c = ttrain._load_config(STUDENT)  # pylint: disable=protected-access
  c.mesh = (2, 4)
  c.data.update(train_examples=TRAIN_ROWS, eval_examples=EVAL_ROWS, batch_size=B,
                eval_batch_size=B)
  c.knowledge.update(train=os.path.join(out, "knowledge", "train"),
                     eval=os.path.join(out, "knowledge", "eval"))
  c.teacher.update(config=TEACHER, workdir=teacher_workdir)
  c.train.update(steps=steps, log_every=1)
  return c


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--teacher_workdir", required=True)
  p.add_argument("--out", required=True)
  p.add_argument("--steps", type=int, default=4)
  args = p.parse_args(argv)
  distributed.maybe_initialize()
  cfg = student_config(args.teacher_workdir, args.out, args.steps)
  teacher = predict.restore_model(teacher_config(), args.teacher_workdir, B)
  train_src, eval_src = registry.make_sources(cfg.data)
  indexes = {}
  for split, src in (("train", train_src), ("eval", eval_src)):
    indexes[split] = generate.generate_knowledge(
        teacher, src, cfg.knowledge[split], batch_size=B, fields=("trunk",), seed=cfg.seed,
        rows_per_shard=24)
  summary = ttrain.train_student(cfg, os.path.join(args.out, "student"), teacher=teacher)
  out = {"summary": summary, "index": indexes, "process_count": jax.process_count()}
  if jax.process_index() == 0:
    print(json.dumps(out, default=float), flush=True)
  return out


if __name__ == "__main__":
  main()
