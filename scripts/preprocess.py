"""Converts a config's raw files into the columnar training format (gem_jax/data/columnar.py).

  python scripts/preprocess.py --config configs/criteo.py --out data/criteo
  python scripts/train.py --config configs/criteo.py --workdir runs/criteo \
      --config.data.train=data/criteo/train --config.data.eval=data/criteo/eval

Reads `data.train` and `data.eval` of the config (with any --config.data.* overrides,
e.g. other files or int_buckets) once, in file order, and writes OUT/train and OUT/eval:
Parquet row groups and a dataset.json (schema, DataSpec, row counts, bad rows). The
trainer reads such a directory wherever a file path goes (data.format='auto'); it
refuses one converted with other data options than the run's. Prints one JSON line per
split (rows, files, bytes, bad rows, rows/s).
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from gem_jax.data import convert  # noqa: E402

config_flags.DEFINE_config_file("config", None, "configs/NAME.py", lock_config=True)
flags.DEFINE_string("out", None, "output directory (one sub-directory per split)")
flags.DEFINE_list("splits", ["train", "eval"], "splits to convert")
flags.DEFINE_integer("row_group_rows", 65536, "rows per Parquet row group (the unit of "
                     "shuffling and of per-process reading)")
flags.DEFINE_integer("rows_per_file", 1 << 20, "rows per Parquet file")
flags.DEFINE_integer("workers", os.cpu_count() or 1, "parser threads (vectorised formats)")
flags.DEFINE_string("compression", "lz4", "Parquet compression: lz4 (decodes fastest), zstd "
                    "(about 25 % smaller files, the reader about 20 % slower), snappy, none")
flags.mark_flags_as_required(["config", "out"])


def main(argv):
  del argv
  f = flags.FLAGS
  for split in f.splits:
    t0 = time.perf_counter()
    meta = convert.convert_config(f.config.data, f.out, splits=(split,),
                                  row_group_rows=f.row_group_rows, rows_per_file=f.rows_per_file,
                                  workers=f.workers, compression=f.compression)[split]
    dt = time.perf_counter() - t0
    print(json.dumps({"split": split, "out": os.path.join(f.out, split), "rows": meta["rows"],
                      "files": len(meta["files"]),
                      "bytes": sum(x["bytes"] for x in meta["files"]),
                      "bad_rows": meta["bad_rows"]["bad"], "parser": meta["parser"],
                      "seconds": round(dt, 3), "rows_per_s": round(meta["rows"] / dt)}))
  logging.info("train with --config.data.train=%s --config.data.eval=%s",
               os.path.join(f.out, "train"), os.path.join(f.out, "eval"))


if __name__ == "__main__":
  app.run(main)
