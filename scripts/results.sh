#!/usr/bin/env bash
# Reproduces every number in docs/RESULTS.md: short CPU runs of scripts/train.py on the
# shared real-data samples (../shared/data or $GEM_JAX_DATA), 3 seeds each, then the
# tables (mean +- sample std over seeds) printed as markdown.
#
#   bash scripts/results.sh                  # everything (~25-40 min on 2 busy cores)
#   bash scripts/results.sh criteo           # one part: criteo | movielens | avazu | table
#   SEEDS="0 1 2" OUT=runs/results PY=.venv/bin/python bash scripts/results.sh
#
# Each run is one CPU device (mesh 1x1: the sharded paths are tested elsewhere; the
# numbers do not depend on the mesh) and prints its final JSON line to $OUT/<run>.json.
# Runs are sequential; a run whose JSON already exists is skipped (delete it to redo).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/results}
SEEDS=${SEEDS:-"0 1 2"}
export XLA_FLAGS=--xla_force_host_platform_device_count=1
mkdir -p "$OUT"

# scripts/train.py with one extra model name registered for these runs ('lr',
# gem_jax.models.linear.LinearModel, is in gem_jax/train/setup.py's MODELS):
#   gem_noseq  GEM built on the DataSpec without its event streams (GEM's dummy stream
#              of one invalid event takes their place: no sequence module input);
#              FLOPs counted as GEM's on the spec without its streams.
train() {
  "$PY" - "$@" <<'EOF'
import dataclasses
import runpy
import sys
import types

from gem_jax.models.gem import GEM
from gem_jax.train import setup


def no_streams(spec):
  """The spec minus its streams and their item features."""
  items = spec.sequence_item_features
  return dataclasses.replace(spec, sequences=(),
                             sparse=tuple(f for f in spec.sparse if f.name not in items))


class GEMNoSequences(GEM):
  """GEM on the spec minus its streams and their item features (inputs['seq'] unused)."""

  def __init__(self, cfg, spec, feature_dims, *, rngs):
    super().__init__(cfg, no_streams(spec), feature_dims, rngs=rngs)


ablations = types.ModuleType("results_ablations")
ablations.GEMNoSequences = GEMNoSequences
sys.modules["results_ablations"] = ablations
setup.register_model("gem_noseq", "results_ablations", "GEMNoSequences",
                     lambda cfg, spec, dims: setup.MODELS["gem"].flops(cfg, no_streams(spec), dims))
sys.argv = ["scripts/train.py"] + sys.argv[1:]
runpy.run_path("scripts/train.py", run_name="__main__")
EOF
}

# run NAME ARGS...: one training run unless $OUT/NAME.json exists.
run() {
  local name=$1; shift
  if [[ -s "$OUT/$name.json" ]]; then echo "skip $name (exists)"; return; fi
  echo "== $name"
  rm -rf "$OUT/$name"
  local t0=$SECONDS
  train --workdir "$OUT/$name" "$@" --config.mesh='(1,1)' \
    --config.train.compile_cache="$OUT/compile_cache" 2> "$OUT/$name.log" | tail -n 1 > "$OUT/$name.json.tmp"
  mv "$OUT/$name.json.tmp" "$OUT/$name.json"
  echo "   $((SECONDS - t0)) s: $(cut -c1-160 "$OUT/$name.json")"
}

# Criteo 8k sample: train split (7,200 rows) -> dev split (409 rows). The config's
# defaults, nothing else: one pass (57 steps of 128), eval every 19 steps, the best
# checkpoint by eval log loss kept, early stopping after 2 evals without a new best
# (configs/criteo.py).
CRITEO=(--config configs/criteo.py)
criteo() {
  for model in lr dlrm dcnv2 gem; do
    for s in $SEEDS; do
      run "criteo_${model}_s$s" "${CRITEO[@]}" --config.model.name=$model --config.seed=$s
    done
  done
}

# MovieLens ml-latest-small, time split at the 80% hour: GEM with its `history` stream
# (20 most recent earlier ratings) and without it (gem_noseq). One epoch of the
# train period (80,018 examples, 157 steps of 512); eval = the last 20% (19,986).
MOVIELENS=(--config configs/movielens.py --config.data.max_len=20 --config.data.batch_size=512
           --config.train.steps=157 --config.optim.warmup_steps=10 --config.train.eval_every=157
           --config.train.checkpoint_every=157 --config.train.log_every=50)
movielens() {
  for model in gem gem_noseq; do
    for s in $SEEDS; do
      run "movielens_${model}_s$s" "${MOVIELENS[@]}" --config.model.name=$model --config.seed=$s
    done
  done
}

# Avazu 9k sample: train split (8,087 rows) -> dev split (480 rows), two domains
# (0 = site, 1 = app traffic). The config's defaults, nothing else: one pass (64 steps
# of 128), eval every 16 steps, best checkpoint by eval log loss, early stopping after
# 2 evals without a new best (configs/avazu.py).
AVAZU=(--config configs/avazu.py)
avazu() {
  for model in lr dlrm gem; do
    for s in $SEEDS; do
      run "avazu_${model}_s$s" "${AVAZU[@]}" --config.model.name=$model --config.seed=$s
    done
  done
}

table() {
  "$PY" - "$OUT" <<'EOF'
import glob
import json
import os
import re
import sys

import numpy as np

out = sys.argv[1]
runs = {}
for path in sorted(glob.glob(os.path.join(out, "*.json"))):
  m = re.fullmatch(r"(\w+?)_(\w+)_s(\d+)\.json", os.path.basename(path))
  if m:
    with open(path) as f:
      runs.setdefault((m[1], m[2]), []).append(json.loads(f.read()))


def value(r, key):
  """key of run summary r: 'best:K' -> the best eval's K (the checkpoint the run keeps),
  'last:K' -> the last eval's K."""
  where, k = key.split(":", 1)
  src = r if where == "last" else r.get("best") or {}
  return src.get(k, np.nan)


def cell(rs, key):
  v = np.array([value(r, key) for r in rs], np.float64)
  spread = f" ± {v.std(ddof=1):.4f}" if len(v) > 1 else ""
  return f"{v.mean():.4f}{spread}"


def steps(rs):
  """Per seed: best eval's step / last step (+ 'es' where the run stopped early)."""
  return ", ".join(f"{(r.get('best') or {}).get('step', '?')}/{r.get('step', '?')}"
                   + (" es" if r.get("stopped_early") else "") for r in rs)


# Criteo and Avazu: the best eval by log loss (the checkpoint the run keeps; `best` in
# the summary), the last eval's log loss beside it. MovieLens: the last eval, as before.
cols = {"criteo": ("best:eval_auc", "best:eval_logloss", "last:eval_logloss"),
        "movielens": ("last:eval_auc", "last:eval_logloss"),
        "avazu": ("best:eval_auc", "best:eval_logloss", "last:eval_logloss",
                  "best:eval_auc/click/domain_0", "best:eval_auc/click/domain_1",
                  "best:eval_logloss/click/domain_0", "best:eval_logloss/click/domain_1")}
for data, keys in cols.items():
  rows = [(m, rs) for (d, m), rs in sorted(runs.items()) if d == data]
  if not rows:
    continue
  best = keys[0].startswith("best:")
  print(f"\n{data}\n\n| model | seeds | " + ("best step/last step | " if best else "")
        + " | ".join(keys) + " |")
  print("|---|---|" + ("---|" if best else "") + "---|" * len(keys))
  for model, rs in rows:
    print(f"| {model} | {len(rs)} | " + (f"{steps(rs)} | " if best else "")
          + " | ".join(cell(rs, k) for k in keys) + " |")
  base = sorted({round(r.get("eval_base_rate_logloss", np.nan), 4) for _, rs in rows
                 for r in rs})
  print(f"\neval base-rate log loss (the eval rows' own click rate for every row): {base}")
EOF
}

parts=("$@")
[[ ${#parts[@]} -eq 0 ]] && parts=(criteo avazu movielens table)
for p in "${parts[@]}"; do "$p"; done
