"""Loss of the first steps of a config, to compare one backend/precision against another.

  python -m gem_jax.bench.loss_check --config medium --steps 3 --out gpu.json
  JAX_PLATFORMS=cpu python -m gem_jax.bench.loss_check --config medium --steps 3 \
      --set model.dtype='"float32"' --out cpu.json
  python -m gem_jax.bench.loss_check --compare cpu.json gpu.json --atol 0.02
  python -m gem_jax.bench.loss_check --compare cpu.json bench.jsonl --atol 0.02

RUN may also be a benchmark JSONL: each gem_jax line's `warmup_losses` (the
first steps from init on the first batches of the same source) is checked.
Both runs build the state from the same key and train on the same batches
(the config's seeded source), with the trainer's own setup and step; the
comparison passes when every step's loss is within `atol` of the reference.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import time


def run_losses(config, steps: int) -> list[float]:
  """Train losses of the first `steps` steps of `config` on the default backend."""
  import jax  # pylint: disable=import-outside-toplevel
  from gem_jax.bench import runner  # pylint: disable=import-outside-toplevel
  from gem_jax.train import setup as setup_lib, step as step_lib  # pylint: disable=import-outside-toplevel
  s = setup_lib.setup(config)
  state = setup_lib.init_state(s, config.seed)
  batches = runner.device_batches(s, config, steps)
  fn = step_lib.jit_train_step(s.step_cfg, s.shardings,
                               jax.tree.map(lambda x: x.sharding, batches[0]))
  losses = []
  for b in batches:
    state, m = fn(state, b)
    losses.append(float(m["train_loss"]))
  return losses


def compare(ref: dict, run: dict, atol: float) -> dict:
  """Max |loss - ref loss| over the common steps and whether it is within `atol`."""
  n = min(len(ref["losses"]), len(run["losses"]))
  diffs = [abs(a - b) for a, b in zip(ref["losses"][:n], run["losses"][:n])]
  ok = n > 0 and all(d <= atol for d in diffs)
  return {"check": "loss", "reference": ref.get("label"), "run": run.get("label"),
          "steps": n, "max_abs_diff": max(diffs) if diffs else float("nan"), "atol": atol,
          "ok": ok, "ref_losses": ref["losses"][:n], "run_losses": run["losses"][:n]}


def load_runs(path: str) -> list[dict]:
  """Runs in a loss_check JSON file or in a benchmark JSONL (its gem_jax lines)."""
  runs = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      if not line.strip():
        continue
      r = json.loads(line)
      if "losses" in r:
        runs.append(r)
      elif r.get("framework") == "gem_jax" and r.get("warmup_losses"):
        runs.append({"label": f"{r['backend']} {r['dtype']}{' fp8' if r['fp8'] else ''}",
                     "losses": r["warmup_losses"], "fp8": r["fp8"], "config": r.get("config")})
  return runs


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config")
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
  p.add_argument("--label", default="")
  p.add_argument("--out")
  p.add_argument("--compare", nargs=2, metavar=("REF", "RUN"))
  p.add_argument("--atol", type=float, default=0.02)
  p.add_argument("--atol-fp8", type=float, default=None, help="tolerance for fp8 runs")
  args = p.parse_args(argv)
  if args.compare:
    with open(args.compare[0], encoding="utf-8") as f:
      ref = json.load(f)
    ok = True
    for run in load_runs(args.compare[1]):
      if ref.get("config") and run.get("config") and run["config"] != ref["config"]:
        continue   # another config's run (a benchmark JSONL holds several)
      tol = args.atol_fp8 if run.get("fp8") and args.atol_fp8 is not None else args.atol
      res = compare(ref, run, tol)
      print(json.dumps(res))
      ok = ok and res["ok"]
    return 0 if ok else 1
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
  import jax  # pylint: disable=import-outside-toplevel
  from gem_jax.bench import runner  # pylint: disable=import-outside-toplevel
  overrides = {}
  for item in args.set:
    k, _, v = item.partition("=")
    try:
      overrides[k] = ast.literal_eval(v)
    except (ValueError, SyntaxError):
      overrides[k] = v
  config = runner.fit_mesh(runner.load_config(args.config, overrides), 1)
  t0 = time.perf_counter()
  losses = run_losses(config, args.steps)
  out = {"label": args.label or f"{jax.default_backend()} {config.model.dtype}"
                                 f"{' fp8' if config.model.fp8 else ''}",
         "config": os.path.basename(args.config).removesuffix(".py"),
         "backend": jax.default_backend(), "dtype": config.model.dtype,
         "fp8": bool(config.model.fp8), "batch_size": config.data.batch_size,
         "losses": losses, "wall_s": time.perf_counter() - t0}
  print(json.dumps(out))
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump(out, f)
  return 0


if __name__ == "__main__":
  sys.exit(main())
