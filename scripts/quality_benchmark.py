"""Model-quality benchmark: each model trained on planted CTR data, next to the oracle.

  python scripts/quality_benchmark.py                          # pairs,triples x 1M rows x 3 seeds
  python scripts/quality_benchmark.py --kinds pairs,heavy --rows 100000,1000000 --models lr,gem
  python scripts/quality_benchmark.py --models lr,gem --variant gem_d32=--config.model.name=gem,\
--config.model.overrides.d_model=32                          # a labelled GEM variant beside gem
  python scripts/quality_benchmark.py --table-only             # the table of runs/quality

For each (kind, rows, seed), gem_jax/bench/planted_ctr.py writes the rows once (Criteo
TSV with a known generative model; cached by its meta.json) under --data-dir, then every
model trains on them in a fresh process of scripts/train.py (configs/quality.py), one at
a time: seed s is the generator's seed and config.seed (fresh data and a fresh init),
train.steps = rows // data.batch_size (one pass), one evaluation at the end over all eval
rows. Each run's summary line, command and wall time go to <out>/results.jsonl; runs
already there are skipped (an interrupted benchmark resumes where it stopped; results
are keyed by (kind, rows, seed, model label), so other eval rows or --extra overrides
need another --out). A failed run prints its log tail (<out>/runs/<run>/train.log); the
others still run and the script exits 1 at the end. Checkpoints are deleted after a
successful run unless --keep-checkpoints.

The table (printed and written to <out>/table.md), one block per (kind, rows): per
model the seeds, eval AUC and log loss (mean ± sample std over seeds), the gap closed
(AUC - AUC_lr) / (AUC_oracle - AUC_lr) (per seed, then the mean), the median
examples/s, and each seed's AUC; plus the oracle (sigmoid of the true logit) and the
base rate (the train click rate for every row).

--extra / --variant take trainer flags `--config.x=y`; `--config.model.overrides.K=V`
(model-config fields) travel as JSON in the config argument (configs/quality.py says why).
"""
from __future__ import annotations

import argparse
import ast
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import time
from typing import Any, Sequence
from unittest import mock

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from gem_jax.bench import planted_ctr  # noqa: E402
from gem_jax.bench import timing  # noqa: E402
from gem_jax.bench.peer import parse_peer_output  # noqa: E402
from gem_jax.bench.report_table import _num  # noqa: E402

CONFIG = os.path.abspath(os.path.join(ROOT, "configs", "quality.py"))
TRAIN = os.path.abspath(os.path.join(ROOT, "scripts", "train.py"))
MODEL_OVERRIDES = "--config.model.overrides."
LABEL = re.compile(r"^[A-Za-z0-9_.+-]+$")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--kinds", default="pairs,triples", help=f"comma list of {planted_ctr.KINDS}")
  p.add_argument("--rows", default="1000000", help="comma list of training-row counts")
  p.add_argument("--eval-rows", type=int, default=100_000)
  p.add_argument("--seeds", default="0,1,2", help="generator seed = config.seed")
  p.add_argument("--models", default="lr,fm,fwfm,dlrm,dcnv2,gem",
                 help="comma list of config.model.name values")
  p.add_argument("--variant", action="append", default=[], metavar="LABEL=--config.a=b,...",
                 help="a labelled model variant: trainer flags (comma-separated) after the "
                      "--extra ones; model.name defaults to the config's (gem). Repeatable")
  p.add_argument("--out", default="runs/quality")
  p.add_argument("--data-dir", default=None, help="generated data (default <out>/data)")
  p.add_argument("--extra", action="append", default=[], metavar="--config.x=y",
                 help="trainer flag passed to every run (repeatable)")
  p.add_argument("--keep-checkpoints", action="store_true")
  p.add_argument("--table-only", action="store_true",
                 help="print the table of <out>/results.jsonl; run nothing")
  args = p.parse_args(argv)
  args.out = os.path.abspath(args.out)
  args.data_dir = os.path.abspath(args.data_dir or os.path.join(args.out, "data"))
  return args


def _csv(text: str) -> list[str]:
  return [t.strip() for t in text.split(",") if t.strip()]


# ------------------------------------------------------------------- runs --

def model_specs(models: Sequence[str], variants: Sequence[str]) -> list[tuple[str, list[str]]]:
  """[(label, trainer flags)]: each model name, then each `LABEL=--config.a=b,--config.c=d`."""
  specs = [(m, [f"--config.model.name={m}"]) for m in models]
  for v in variants:
    label, sep, rest = v.partition("=")
    flags = [f for f in re.split(r",(?=--config\.)", rest) if f]
    if not sep or not LABEL.match(label) or not all(f.startswith("--config.") for f in flags):
      raise SystemExit(f"--variant {v!r}: expected LABEL=--config.a=b[,--config.c=d...]")
    specs.append((label, flags))
  labels = [s[0] for s in specs]
  if len(set(labels)) != len(labels):
    raise SystemExit(f"model labels must be unique: {labels}")
  return specs


def _literal(raw: str) -> Any:
  try:
    return ast.literal_eval(raw)
  except (ValueError, SyntaxError):
    return raw


def trainer_config(flags: Sequence[str]) -> tuple[str, list[str]]:
  """(the --config argument, the other flags): model.overrides.K=V move into the argument's
  JSON (train.py locks the config, and the empty overrides block takes no new keys)."""
  over, rest = {}, []
  for f in flags:
    if f.startswith(MODEL_OVERRIDES):
      key, _, raw = f[len(MODEL_OVERRIDES):].partition("=")
      over[key] = _literal(raw)
    else:
      rest.append(f)
  return (f"{CONFIG}:{json.dumps(over)}" if over else CONFIG), rest


def resolve(config_arg: str, flags: Sequence[str]):
  """The config train.py will run, parsed as it parses it (absl config_flags, locked)."""
  from absl import flags as absl_flags  # pylint: disable=import-outside-toplevel
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel
  argv = ["train.py", f"--config={config_arg}", *flags]
  fv = absl_flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, flag_values=fv, lock_config=True)
  try:
    with mock.patch.object(sys, "argv", argv):  # config_flags reads the overrides from sys.argv
      fv(argv)
  except (absl_flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
    raise SystemExit(f"bad trainer flags {list(flags)}: {type(e).__name__}: {e}") from None
  return fv.config


def run_name(kind: str, rows: int, seed: int, label: str) -> str:
  return f"{kind}_{rows}_s{seed}_{label}"


def load_results(path: str) -> list[dict]:
  if not os.path.exists(path):
    return []
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def _key(r: dict) -> tuple:
  return (r["kind"], r["rows"], r["seed"], r["model"])


def _tail(path: str, n: int = 40) -> str:
  with open(path, encoding="utf-8", errors="replace") as f:
    return "".join(f.readlines()[-n:])


def run_one(cmd: list[str], workdir: str, keep_checkpoints: bool) -> tuple[dict | None, float]:
  """Runs the trainer in a fresh process (log: <workdir>/train.log); (summary or None, wall s)."""
  if os.path.exists(workdir):  # no half-done run to resume: every result is one clean pass
    shutil.rmtree(workdir)
  os.makedirs(workdir)
  env = dict(os.environ)
  if "xla_force_host_platform_device_count" not in env.get("XLA_FLAGS", ""):
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +  # CPU: one device is all mesh (1, 1) uses
                        " --xla_force_host_platform_device_count=1").strip()
  log = os.path.join(workdir, "train.log")
  t0 = time.perf_counter()
  with open(log, "w", encoding="utf-8") as err:
    err.write(" ".join(cmd) + "\n")
    err.flush()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, check=False)
  wall = time.perf_counter() - t0
  with open(log, "a", encoding="utf-8") as f:
    f.write(p.stdout)
  summary = None
  if p.returncode == 0:
    try:
      summary = parse_peer_output(p.stdout)  # the last JSON line of stdout
    except ValueError:
      pass
  if summary is not None and not keep_checkpoints:
    shutil.rmtree(os.path.join(workdir, "checkpoints"), ignore_errors=True)
  return summary, wall


def run_all(args) -> int:
  kinds, seeds = _csv(args.kinds), [int(s) for s in _csv(args.seeds)]
  rows_list = [int(r) for r in _csv(args.rows)]
  bad = [k for k in kinds if k not in planted_ctr.KINDS]
  if bad:
    raise SystemExit(f"--kinds {bad}: expected among {planted_ctr.KINDS}")
  from gem_jax.train import setup  # pylint: disable=import-outside-toplevel  (imports jax)
  bad = [m for m in _csv(args.models) if m not in setup.MODELS]
  if bad:
    raise SystemExit(f"--models {bad}: expected among {sorted(setup.MODELS)}")
  specs = []
  for label, flags in model_specs(_csv(args.models), args.variant):
    config_arg, rest = trainer_config([*args.extra, *flags])
    c = resolve(config_arg, rest)
    steps = {rows: rows // c.data.batch_size for rows in rows_list}
    if min(steps.values()) < 1:
      raise SystemExit(f"{label}: --rows {rows_list} give no step at batch {c.data.batch_size}")
    specs.append((label, c.model.name, c.data.batch_size, steps, config_arg, rest))
  os.makedirs(args.out, exist_ok=True)
  results_path = os.path.join(args.out, "results.jsonl")
  done = {_key(r): r for r in load_results(results_path)}
  failed = []
  for kind in kinds:
    for rows in rows_list:
      for seed in seeds:
        todo = [s for s in specs if (kind, rows, seed, s[0]) not in done]
        for s in specs:
          if (kind, rows, seed, s[0]) in done:
            print(f"skip {run_name(kind, rows, seed, s[0])} (in {results_path})", flush=True)
            old = done[(kind, rows, seed, s[0])]
            if old.get("flags") != s[5] or old.get("config") != s[4]:
              print(f"  warning: recorded with other flags: {old.get('config')} "
                    f"{old.get('flags')}", flush=True)
        if not todo:
          continue
        data = os.path.join(args.data_dir, f"{kind}_{rows}_e{args.eval_rows}_s{seed}")
        t0 = time.perf_counter()
        meta = planted_ctr.write(data, kind, seed, rows, args.eval_rows)
        print(f"data {data}: oracle eval AUC {meta['oracle_auc']:.4f}, log loss "
              f"{meta['oracle_logloss']:.4f} (base rate {meta['base_logloss']:.4f}) "
              f"[{time.perf_counter() - t0:.1f} s]", flush=True)
        oracle = {k: meta[k] for k in ("oracle_auc", "oracle_logloss", "base_logloss",
                                       "train_ctr", "eval_ctr")}
        for label, model, batch, steps, config_arg, rest in todo:
          name = run_name(kind, rows, seed, label)
          workdir = os.path.join(args.out, "runs", name)
          cmd = [sys.executable, TRAIN, "--config", config_arg, "--workdir", workdir,
                 f"--config.data.train={os.path.join(data, 'train.tsv')}",
                 f"--config.data.eval={os.path.join(data, 'eval.tsv')}",
                 f"--config.seed={seed}", f"--config.train.steps={steps[rows]}", *rest]
          load = timing.loadavg()
          summary, wall = run_one(cmd, workdir, args.keep_checkpoints)
          if summary is None:
            failed.append(name)
            log = os.path.join(workdir, "train.log")
            print(f"FAILED {name} after {wall:.1f} s; log tail ({log}):\n{_tail(log)}",
                  file=sys.stderr, flush=True)
            continue
          record = {"kind": kind, "rows": rows, "eval_rows": args.eval_rows, "seed": seed,
                    "model": label, "model_name": model, "batch_size": batch,
                    "steps": steps[rows], "config": config_arg, "flags": rest,
                    "command": cmd, "wall_s": wall, "loadavg_1m_before": load,
                    "oracle": oracle, "summary": summary}
          with open(results_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=float) + "\n")
          print(f"{name}: eval AUC {summary.get('eval_auc', float('nan')):.4f}, log loss "
                f"{summary.get('eval_logloss', float('nan')):.4f} (oracle "
                f"{oracle['oracle_auc']:.4f}) [{wall:.1f} s]", flush=True)
  table = format_table(aggregate(load_results(results_path)))
  with open(os.path.join(args.out, "table.md"), "w", encoding="utf-8") as f:
    f.write(table)
  print(table, end="", flush=True)
  if failed:
    print(f"{len(failed)} run(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1
  return 0


# ------------------------------------------------------------------ table --

def _mean_std(values: Sequence[float]) -> tuple[float | None, float | None]:
  v = np.asarray([x for x in values if x is not None], np.float64)
  if not len(v):
    return None, None
  return float(np.mean(v)), (float(np.std(v, ddof=1)) if len(v) > 1 else None)


def aggregate(records: Sequence[dict]) -> dict[tuple[str, int], list[dict]]:
  """{(kind, rows): [row per model (run order), then 'oracle', then 'base rate']}.

  Each row: model, seeds, auc (seed -> AUC), auc_mean/auc_std, logloss_mean/logloss_std
  (sample std; None for one seed), gap_closed (mean over the seeds that have lr; None for
  lr itself or without lr), examples_per_s (median).
  """
  by_block: dict[tuple, dict[str, dict[int, dict]]] = collections.defaultdict(dict)
  for r in records:
    by_block[(r["kind"], r["rows"])].setdefault(r["model"], {})[r["seed"]] = r
  kind_order = {k: i for i, k in enumerate(planted_ctr.KINDS)}
  out = {}
  for block in sorted(by_block, key=lambda b: (kind_order.get(b[0], len(kind_order)), b)):
    models = by_block[block]
    oracle = {}
    for runs in models.values():
      for seed, r in runs.items():
        oracle.setdefault(seed, r["oracle"])
    lr = {s: r["summary"].get("eval_auc") for s, r in models.get("lr", {}).items()}
    rows = []
    for model, runs in models.items():
      seeds = sorted(runs)
      auc = {s: runs[s]["summary"].get("eval_auc") for s in seeds}
      ll = [runs[s]["summary"].get("eval_logloss") for s in seeds]
      gaps = [(auc[s] - lr[s]) / (oracle[s]["oracle_auc"] - lr[s]) for s in seeds
              if model != "lr" and lr.get(s) is not None and auc[s] is not None
              and oracle[s]["oracle_auc"] != lr[s]]
      eps = [runs[s]["summary"].get("examples_per_s") for s in seeds]
      eps = [e for e in eps if e is not None]
      rows.append({"model": model, "seeds": seeds, "auc": auc,
                   **dict(zip(("auc_mean", "auc_std"), _mean_std(list(auc.values())))),
                   **dict(zip(("logloss_mean", "logloss_std"), _mean_std(ll))),
                   "gap_closed": float(np.mean(gaps)) if gaps else None,
                   "examples_per_s": float(np.median(eps)) if eps else None})
    seeds = sorted(oracle)
    o_auc = {s: oracle[s]["oracle_auc"] for s in seeds}
    rows.append({"model": "oracle", "seeds": seeds, "auc": o_auc,
                 **dict(zip(("auc_mean", "auc_std"), _mean_std(list(o_auc.values())))),
                 **dict(zip(("logloss_mean", "logloss_std"),
                            _mean_std([oracle[s]["oracle_logloss"] for s in seeds]))),
                 "gap_closed": None, "examples_per_s": None})
    rows.append({"model": "base rate", "seeds": seeds, "auc": {}, "auc_mean": None,
                 "auc_std": None,
                 **dict(zip(("logloss_mean", "logloss_std"),
                            _mean_std([oracle[s]["base_logloss"] for s in seeds]))),
                 "gap_closed": None, "examples_per_s": None})
    out[block] = rows
  return out


def _pm(mean: float | None, std: float | None) -> str:
  if mean is None:
    return ""
  return f"{mean:.4f}" + (f" ± {std:.4f}" if std is not None else "")


def format_table(blocks: dict[tuple[str, int], list[dict]]) -> str:
  """Markdown: a heading and a table per (kind, rows)."""
  out = []
  for (kind, rows), table in blocks.items():
    out.append(f"### {kind}, {rows:,} training rows\n")
    out.append("| model | seeds | eval AUC | eval log loss | gap closed | examples/s | "
               "AUC per seed |")
    out.append("|---|---|---|---|---|---|---|")
    for r in table:
      gap = "" if r["gap_closed"] is None else f"{r['gap_closed']:.3f}"
      eps = "" if r["examples_per_s"] is None else _num(r["examples_per_s"], "{:,.0f}")
      per_seed = " ".join(_num(r["auc"][s], "{:.4f}") for s in r["seeds"] if s in r["auc"])
      out.append(f"| {r['model']} | {','.join(map(str, r['seeds']))} | "
                 f"{_pm(r['auc_mean'], r['auc_std'])} | "
                 f"{_pm(r['logloss_mean'], r['logloss_std'])} | {gap} | {eps} | {per_seed} |")
    out.append("")
  return "\n".join(out) + ("\n" if out else "")


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.table_only:
    results = load_results(os.path.join(args.out, "results.jsonl"))
    if not results:
      raise SystemExit(f"no results in {os.path.join(args.out, 'results.jsonl')}")
    print(format_table(aggregate(results)), end="")
    return 0
  return run_all(args)


if __name__ == "__main__":
  sys.exit(main())
