"""Evaluates the latest checkpoint of a run: `python scripts/evaluate.py --config configs/small.py --workdir runs/small`.

Prints one JSON line of eval metrics (eval_auc, eval_logloss, eval_ne, per task
and domain) and the checkpoint step. `--step N` picks another checkpoint.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from gem_jax import hostmem  # noqa: E402  (imports no jax)

hostmem.simulate_cpu_devices()

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from gem_jax.parallel import distributed  # noqa: E402
from gem_jax.train import evaluate  # noqa: E402
from gem_jax.train import loop  # noqa: E402

config_flags.DEFINE_config_file("config", None, "configs/NAME.py", lock_config=True)
flags.DEFINE_string("workdir", None, "run directory holding checkpoints/")
flags.DEFINE_integer("step", None, "checkpoint step (default: the latest)")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  distributed.maybe_initialize()
  loop.run_and_print(evaluate.evaluate_checkpoint, flags.FLAGS.config, flags.FLAGS.workdir,
                     flags.FLAGS.step)


if __name__ == "__main__":
  app.run(main, flags_parser=loop.parse_flags_or_exit)
