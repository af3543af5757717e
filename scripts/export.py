"""Exports a checkpoint as a self-contained serving artifact (jax.export + tables + manifest).

  python scripts/export.py --config configs/criteo.py --workdir runs/criteo \
    --out artifacts/criteo --table_dtype int8 --batch_sizes 1,64,512

The model is restored from the latest checkpoint (or --step) like scripts/predict.py
(the config must be the one it was trained with; --data replaces its data paths, e.g.
when the training files are not on this machine: any file of the kind will do).
--batch_sizes: one exported function per size (default: one of a symbolic batch).
Load it with `gem_jax.serving.load(OUT)`; layout and formats: docs/serving.md.
Prints a summary of the manifest as one JSON line. On CPU, 8 devices are simulated
unless XLA_FLAGS sets a device count (the config's mesh must fit).
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from gem_jax import hostmem  # noqa: E402  (imports no jax)

hostmem.simulate_cpu_devices()

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from gem_jax.serving import export  # noqa: E402
from gem_jax.serving import quantize  # noqa: E402
from gem_jax.train import loop  # noqa: E402
from gem_jax.train import predict  # noqa: E402
from gem_jax.train import report  # noqa: E402

config_flags.DEFINE_config_file("config", None, "configs/NAME.py", lock_config=True)
flags.DEFINE_string("workdir", None, "run directory holding checkpoints/")
flags.DEFINE_string("out", None, "artifact directory")
flags.DEFINE_integer("step", None, "checkpoint step (default: the latest)")
flags.DEFINE_string("data", None, "input files or dataset directory replacing the config's")
flags.DEFINE_list("batch_sizes", [], "exported batch sizes (default: a symbolic batch)")
flags.DEFINE_enum("table_dtype", "float32", quantize.DTYPES, "table storage format")
flags.DEFINE_bool("trunk", False, "also return the trunk embedding")
flags.DEFINE_list("platforms", [], "lowering platforms (default: this backend), e.g. cpu,cuda")
flags.DEFINE_bool("overwrite", False, "replace an existing --out")
flags.mark_flags_as_required(["config", "workdir", "out"])


def run(config, workdir: str) -> dict:
  f = flags.FLAGS
  report.quiet_library_logs()
  model = predict.restore_model(config, workdir, config.data.eval_batch_size, f.step,
                                data=f.data)
  m = export.export_artifact(model, f.out, batch_sizes=[int(b) for b in f.batch_sizes] or None,
                             table_dtype=f.table_dtype, trunk=f.trunk,
                             platforms=f.platforms or None, config=config,
                             overwrite=f.overwrite)
  return {"out": f.out, "step": m["checkpoint_step"], "batch_sizes": m["batch_sizes"],
          "table_dtype": m["table_dtype"], "platforms": m["platforms"],
          "table_bytes": sum(t["bytes"] for t in m["tables"].values()),
          "max_table_error": max(t["error"]["max_abs"] for t in m["tables"].values()),
          "outputs": m["outputs"]}


def main(argv):
  del argv
  loop.run_and_print(run, flags.FLAGS.config, flags.FLAGS.workdir)


if __name__ == "__main__":
  app.run(main, flags_parser=loop.parse_flags_or_exit)
