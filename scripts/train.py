"""Trains a gem_jax model: `python scripts/train.py --config configs/small.py --workdir runs/small`.

Config fields can be overridden: `--config.train.steps=100 --config.mesh='(2,4)'`.
Resumes from the latest checkpoint in WORKDIR/checkpoints if there is one.
Ends by printing one JSON line (step, examples_per_s, mfu, train_loss, eval_*).
On CPU, 8 devices are simulated unless XLA_FLAGS already sets a device count.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from gem_jax import hostmem  # noqa: E402  (imports no jax: the re-exec comes first)

if __name__ == "__main__":  # host malloc, huge pages (gem_jax/hostmem.py)
  hostmem.use_host_malloc()

hostmem.simulate_cpu_devices()

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from gem_jax.parallel import distributed  # noqa: E402
from gem_jax.train import loop  # noqa: E402

config_flags.DEFINE_config_file("config", None, "configs/NAME.py", lock_config=True)
flags.DEFINE_string("workdir", None, "run directory: metrics.jsonl, TensorBoard events, checkpoints")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  distributed.maybe_initialize()
  loop.run_and_print(loop.train_and_evaluate, flags.FLAGS.config, flags.FLAGS.workdir)


if __name__ == "__main__":
  app.run(main, flags_parser=loop.parse_flags_or_exit)
