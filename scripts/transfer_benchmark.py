"""Transfer benchmark: student alone vs distillation, Student Adapter, representation transfer,
parameter sharing and all together, on planted data and on the Avazu sample (app traffic).

  python scripts/transfer_benchmark.py --workdir /tmp/transfer_bench
  python scripts/transfer_benchmark.py --workdir /tmp/tb --datasets planted --seeds 0 \
    --student_steps 30 --teacher_steps 40 --student_eval 2048        # a quick smoke run

Prints one JSON line per teacher and per (dataset, variant): mean/std/min/max over
seeds of eval AUC and NE, and the student's FLOPs per example. Runs on one CPU
device by default (a few minutes on 2 cores); docs/knowledge_transfer.md has the table.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gem_jax.transfer import benchmark  # noqa: E402
from gem_jax.transfer.train import _load_config  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--workdir", required=True)
  p.add_argument("--datasets", default="planted,avazu")
  p.add_argument("--variants", default=",".join(benchmark.VARIANTS))
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--teacher_steps", type=int, default=600)
  p.add_argument("--student_steps", type=int, default=200)
  p.add_argument("--student_train", type=int, default=2048)
  p.add_argument("--student_eval", type=int, default=16384)
  p.add_argument("--avazu_teacher_steps", type=int, default=100)
  p.add_argument("--avazu_student_steps", type=int, default=100)
  p.add_argument("--data_dir", default=os.environ.get(
      "GEM_JAX_DATA", os.path.join(HERE, "..", "..", "shared", "data")))
  args = p.parse_args(argv)
  base = _load_config(os.path.join(HERE, "..", "configs", "transfer_teacher_planted.py"))
  seeds = tuple(int(s) for s in args.seeds.split(","))
  variants = [v for v in args.variants.split(",") if v]
  rows = []
  for ds in args.datasets.split(","):
    wd = os.path.join(args.workdir, ds)
    if ds == "planted":
      budget = benchmark.Budget(args.teacher_steps, args.student_steps, 128, args.student_train,
                                args.student_eval, seeds)
      rows += benchmark.planted_benchmark(wd, base, budget, variants, benchmark.print_row)
    elif ds == "avazu":
      budget = benchmark.Budget(args.avazu_teacher_steps, args.avazu_student_steps, 64, 0, 0,
                                seeds)
      rows += benchmark.avazu_benchmark(wd, args.data_dir, base, budget, variants,
                                        benchmark.print_row)
    else:
      raise SystemExit(f"unknown dataset {ds!r}: expected planted or avazu")
  return rows


if __name__ == "__main__":
  main()
