"""Serving latency (p50/p99) and rows/s of exported artifacts on CPU, and table memory per dtype.

  python scripts/bench_serving.py --artifact artifacts/criteo --batch_sizes 1,64,512,4096
  python scripts/bench_serving.py --configs configs/small.py,configs/medium.py

--artifact: times an existing artifact. --configs: for each config, a freshly initialised
model (latency does not depend on the weights; mesh 1 x 1, compute `--model_dtype`) is
exported once per `--table_dtypes` into a temporary directory, loaded and timed. One call
is a whole request: `predict(batch)` of a numpy batch (id policy, copies, the exported
function; gem_jax/serving/bench.py). One JSON line per (config, table dtype, batch).
Runs on one CPU device (no simulated devices); XLA uses every core it is given.
"""
import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402

from gem_jax.serving import bench, export, load, read_manifest  # noqa: E402


def fresh_model(config_path: str, dtype: str):
  """An initialised model of the config on a 1 x 1 mesh, computing in `dtype`."""
  from gem_jax.bench.runner import load_config  # pylint: disable=import-outside-toplevel
  from gem_jax.train import predict  # pylint: disable=import-outside-toplevel
  from gem_jax.train import setup as setup_lib  # pylint: disable=import-outside-toplevel
  c = load_config(config_path, {"mesh": (1, 1), "model.dtype": dtype, "model.fp8": False})
  s = setup_lib.setup(predict.scoring_config(c, 8))
  return predict.Model(s, setup_lib.init_state(s, c.seed), 0), c


def run_artifact(path: str, sizes, seconds: float, tag: dict) -> list[dict]:
  p = load(path)
  rows = []
  for b in sizes:
    row = {**tag, **bench.memory(p.manifest), **bench.bench(p, b, seconds)}
    print(json.dumps(row), flush=True)
    rows.append(row)
  return rows


def main(argv=None) -> list[dict]:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--artifact", default="")
  ap.add_argument("--configs", default="")
  ap.add_argument("--batch_sizes", default="1,64,512,4096")
  ap.add_argument("--table_dtypes", default="float32,bfloat16,int8")
  ap.add_argument("--time_dtypes", default="float32,int8",
                  help="table dtypes whose latency is measured (all: memory)")
  ap.add_argument("--model_dtype", default="float32")
  ap.add_argument("--seconds", type=float, default=2.0, help="timed seconds per batch size")
  args = ap.parse_args(argv)
  sizes = [int(b) for b in args.batch_sizes.split(",") if b]
  if bool(args.artifact) == bool(args.configs):
    ap.error("give one of --artifact or --configs")
  if args.artifact:
    return run_artifact(args.artifact, sizes, args.seconds, {"artifact": args.artifact})
  out = []
  for path in args.configs.split(","):
    model, config = fresh_model(path, args.model_dtype)
    n_params = sum(x.size for x in jax.tree.leaves(model.state.params))
    for dtype in args.table_dtypes.split(","):
      with tempfile.TemporaryDirectory() as tmp:
        export.export_artifact(model, tmp, table_dtype=dtype, config=config, overwrite=True)
        tag = {"config": os.path.basename(path), "model": config.model.name,
               "preset": config.model.preset, "dense_params": int(n_params)}
        if dtype in args.time_dtypes.split(","):
          out += run_artifact(tmp, sizes, args.seconds, tag)
        else:
          row = {**tag, **bench.memory(read_manifest(tmp))}
          print(json.dumps(row), flush=True)
          out.append(row)
  return out


if __name__ == "__main__":
  main()
