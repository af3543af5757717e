"""Plots a run's metrics: `python scripts/plot.py WORKDIR [--out DIR]`.

Reads WORKDIR/metrics.jsonl (written by gem_jax.train.report.MetricWriter) and
writes into WORKDIR/plots (or --out):

  loss.png        every *loss* series (train_loss, eval_logloss, ...)
  auc_ne.png      AUC and NE series (per task too; per-domain series left out),
                  with the oracle AUC as a dashed line when the run logged one
  throughput.png  examples/s, step time and MFU

Steps logged twice (a run resumed from an earlier checkpoint) keep the last value.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  pylint: disable=wrong-import-position

_AUC = re.compile(r"(^|[_/])auc($|[_/])")
_NE = re.compile(r"(^|[_/])ne($|[_/])")


def read_series(path: str) -> dict[str, list[tuple[int, float]]]:
  """{metric: [(step, value)]} of the finite numeric values, sorted by step."""
  by_key: dict[str, dict[int, float]] = {}
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        continue                        # e.g. a line cut by a crash
      step = row.get("step")
      if step is None:
        continue
      for k, v in row.items():
        if k == "step" or isinstance(v, bool) or not isinstance(v, (int, float)):
          continue
        if math.isfinite(v):
          by_key.setdefault(k, {})[int(step)] = float(v)
  return {k: sorted(d.items()) for k, d in by_key.items()}


def _plot(ax, series, keys, title, ylabel=None):
  for k in keys:
    xs, ys = zip(*series[k])
    ax.plot(xs, ys, marker="." if len(xs) < 30 else None, label=k)
  ax.set_title(title)
  ax.set_xlabel("step")
  if ylabel:
    ax.set_ylabel(ylabel)
  ax.grid(alpha=0.3)
  if keys:
    ax.legend(fontsize="small")


def _select(series, pattern):
  return sorted(k for k in series if pattern(k) and "domain_" not in k and "oracle" not in k)


def plot_run(workdir: str, out_dir: str | None = None) -> list[str]:
  """Writes the PNGs for `workdir`; returns their paths."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    raise FileNotFoundError(f"no metrics.jsonl in {workdir}")
  series = read_series(path)
  out_dir = out_dir or os.path.join(workdir, "plots")
  os.makedirs(out_dir, exist_ok=True)
  written = []

  def save(fig, name):
    fig.tight_layout()
    p = os.path.join(out_dir, name)
    fig.savefig(p, dpi=100)
    plt.close(fig)
    written.append(p)

  fig, ax = plt.subplots(figsize=(7, 4))
  _plot(ax, series, _select(series, lambda k: "loss" in k), "loss")
  save(fig, "loss.png")

  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
  _plot(ax1, series, _select(series, lambda k: bool(_AUC.search(k))), "AUC")
  for k in sorted(k for k in series if "oracle" in k and _AUC.search(k)):
    ax1.axhline(series[k][-1][1], ls="--", color="k", lw=1, label=f"{k} {series[k][-1][1]:.4f}")
    ax1.legend(fontsize="small")
  _plot(ax2, series, _select(series, lambda k: bool(_NE.search(k))), "normalized entropy")
  save(fig, "auc_ne.png")

  fig, axes = plt.subplots(1, 3, figsize=(15, 4))
  _plot(axes[0], series, _select(series, lambda k: k.startswith("examples_per_s")),
        "throughput", "examples/s")
  _plot(axes[1], series, _select(series, lambda k: k == "step_time_s"), "step time", "s")
  _plot(axes[2], series, _select(series, lambda k: k in ("mfu", "tflops_per_device")),
        "utilisation")
  save(fig, "throughput.png")
  return written


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("workdir")
  parser.add_argument("--out", default=None, help="output folder (default WORKDIR/plots)")
  args = parser.parse_args(argv)
  for p in plot_run(args.workdir, args.out):
    print(p)
  return 0


if __name__ == "__main__":
  sys.exit(main())
