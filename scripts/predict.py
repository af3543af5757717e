"""Scores every row of an input with a checkpoint: per-example probabilities, in input order.

  python scripts/predict.py --config configs/criteo.py --workdir runs/criteo \
    --data /data/criteo/day_23.gz --out runs/criteo/pred_day23

--data: text files (comma list or glob) of the config's data.kind, or a dataset
directory written by scripts/preprocess.py (data.format='auto' detects it); default:
the config's eval split. OUT is a directory of part files (Parquet, or --format=tsv)
that concatenate in input order, plus OUT/_index.json; an interrupted run resumes
where it stopped. Columns, bad rows and resume: gem_jax/train/predict.py, docs/serving.md.
Prints the index as one JSON line. On CPU, 8 devices are simulated unless XLA_FLAGS
sets a device count.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from gem_jax import hostmem  # noqa: E402  (imports no jax)

hostmem.simulate_cpu_devices()

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from gem_jax.parallel import distributed  # noqa: E402
from gem_jax.train import loop  # noqa: E402
from gem_jax.train import predict  # noqa: E402
from gem_jax.train import report  # noqa: E402

config_flags.DEFINE_config_file("config", None, "configs/NAME.py", lock_config=True)
flags.DEFINE_string("workdir", None, "run directory holding checkpoints/")
flags.DEFINE_string("data", None, "input files or dataset directory (default: data.eval)")
flags.DEFINE_string("out", None, "output directory")
flags.DEFINE_integer("step", None, "checkpoint step (default: the latest)")
flags.DEFINE_enum("format", "parquet", predict.FORMATS, "output file format")
flags.DEFINE_bool("trunk", False, "also write the trunk embedding")
flags.DEFINE_enum("bad_rows", "reject", predict.BAD_ROWS,
                  "bad rows: reject (NaN + reason), missing (scored as all-missing), drop")
flags.DEFINE_integer("batch_size", 0, "global scoring batch (0: data.eval_batch_size)")
flags.DEFINE_integer("rows_per_part", 65536, "input rows per part file and process")
flags.DEFINE_float("bad_row_limit", None, "bad-row fraction that stops (default: the config's)")
flags.DEFINE_string("key_column", None, "also write this raw input column (text inputs), "
                    "e.g. Avazu's id")
flags.DEFINE_integer("max_parts", None, "stop after this many parts (a resumable interruption)")
flags.mark_flags_as_required(["config", "workdir", "out"])


def run(config, workdir: str) -> dict:
  f = flags.FLAGS
  report.quiet_library_logs()
  model = predict.restore_model(config, workdir, f.batch_size or config.data.eval_batch_size,
                                f.step, data=f.data)
  limit = config.data.bad_row_limit if f.bad_row_limit is None else f.bad_row_limit
  return predict.predict(model, model.setup.eval_src, f.out, fmt=f.format, trunk=f.trunk,
                         bad_rows=f.bad_rows, rows_per_part=f.rows_per_part, seed=config.seed,
                         bad_row_limit=limit, max_parts=f.max_parts, key_column=f.key_column)


def main(argv):
  del argv
  distributed.maybe_initialize()
  loop.run_and_print(run, flags.FLAGS.config, flags.FLAGS.workdir)


if __name__ == "__main__":
  app.run(main, flags_parser=loop.parse_flags_or_exit)
