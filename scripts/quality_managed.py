"""Managed collisions vs hashing on planted data with a drifting id population.

  python scripts/quality_managed.py --seeds 0 1 2

Two sparse features (user, ad), each raw id with a planted effect theta ~ N(0, 1);
label ~ Bernoulli(sigmoid(theta_user + theta_ad - 1)). At step s ids are drawn
Zipf(1.05)-popular from a window of `--alive` ids that slides by `--drift` ids per step,
so the run sees far more distinct raw ids than the table has rows, and old ids go
cold. Model: logit = mean(e_user) + mean(e_ad) + b, row-wise Adagrad on the tables, on
a 1 x 4 mesh. Metric: progressive AUC (each batch scored before it is trained on),
over the second half of the run.

Same table size: both policies get `--rows` rows. Same memory: the hash table gets the
map's bytes as extra rows, rows x (4 D + 4 + 16) / (4 D + 4) (weights, accumulator,
map per row). Prints one JSON line per (seed, variant) and the means.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=4").strip()

import argparse  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from gem_jax.data.synthetic import rank_auc  # noqa: E402
from gem_jax.embedding import (FeatureConfig, SparseOptimizerConfig, TableConfig,  # noqa: E402
                               apply_sparse_updates, gather_rows, init_embedding_state,
                               managed, plan_embeddings, pool_rows, prepare_ids)
from gem_jax.embedding.plan import MAP_BYTES_PER_ROW  # noqa: E402
from gem_jax.parallel.mesh import make_mesh  # noqa: E402

FEATURES = ("user", "ad")


def stream(seed: int, steps: int, batch: int, alive: int, drift: int):
  """Yields (raw ids {feature: (batch, 1) int64}, labels (batch,), true logits (batch,)) of a
  drifting population."""
  rng = np.random.default_rng(seed)
  total = alive + drift * steps
  ids = {f: rng.integers(0, 1 << 62, total, dtype=np.int64) for f in FEATURES}
  theta = {f: rng.normal(0.0, 1.0, total) for f in FEATURES}
  for s in range(steps):
    out, logit = {}, -1.0
    for f in FEATURES:
      k = np.minimum(rng.zipf(1.05, batch) - 1, alive - 1)   # popularity rank in the window
      pos = s * drift + (k * 7919) % alive                   # hot ids spread over the window
      out[f] = ids[f][pos][:, None]
      logit = logit + theta[f][pos]
    y = (rng.random(batch) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    yield out, y, logit


def run(seed: int, policy: str, rows: int, args) -> dict:
  mesh = make_mesh((1, 4))
  tables = [TableConfig(f, rows, args.dim, sharding="row_wise", id_policy=policy,
                        eviction=args.eviction, probe=args.probe) for f in FEATURES]
  feats = [FeatureConfig(f, f, 1) for f in FEATURES]
  plan = plan_embeddings(tables, feats, mesh, args.batch, SparseOptimizerConfig(lr=args.lr))
  state = {"emb": init_embedding_state(plan, jax.random.key(seed)),
           "b": jnp.zeros((), jnp.float32), "step": jnp.zeros((), jnp.int32)}

  def step(state, ids, y):
    emb, ids, _ = managed.resolve(plan, state["emb"], ids, state["step"], jax.random.key(seed))
    rows, ctx = gather_rows(plan, emb, ids)

    def loss_fn(rows, b):
      e = pool_rows(plan, rows, ctx)
      logit = sum(jnp.mean(e[f], axis=1) for f in FEATURES) + b          # (B,)
      loss = jnp.mean(jnp.logaddexp(0.0, logit) - y * logit)
      return loss, logit

    (_, logit), (g_rows, g_b) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
        rows, state["b"])
    emb = apply_sparse_updates(plan, emb, ctx, g_rows)
    return {"emb": emb, "b": state["b"] - 0.05 * g_b, "step": state["step"] + 1}, logit

  step = jax.jit(step, donate_argnums=0)
  scores, labels, truth = [], [], []
  for s, (raw, y, true) in enumerate(stream(seed, args.steps, args.batch, args.alive,
                                            args.drift)):
    ids = jax.device_put(prepare_ids(plan, raw), plan.ids_shardings())
    state, logit = step(state, ids, jax.device_put(y, plan.batch_sharding()))
    if s >= args.steps // 2:
      scores.append(np.asarray(logit))
      labels.append(y)
      truth.append(true)
  per_row = 4 * args.dim + 4 + (MAP_BYTES_PER_ROW if policy == "managed" else 0)
  return {"seed": seed, "policy": policy, "rows": rows,
          "table_bytes": int(len(FEATURES) * rows * per_row),
          "auc": float(rank_auc(np.concatenate(scores), np.concatenate(labels))),
          "oracle_auc": float(rank_auc(np.concatenate(truth), np.concatenate(labels)))}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  p.add_argument("--rows", type=int, default=4096)
  p.add_argument("--alive", type=int, default=4096, help="ids in the sliding window")
  p.add_argument("--drift", type=int, default=64, help="new ids per step")
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--batch", type=int, default=1024)
  p.add_argument("--dim", type=int, default=16)
  p.add_argument("--lr", type=float, default=0.2)
  p.add_argument("--probe", type=int, default=8)
  p.add_argument("--eviction", default="lru", choices=["lru", "lfu"])
  args = p.parse_args(argv)
  same_mem = int(args.rows * (4 * args.dim + 4 + MAP_BYTES_PER_ROW) / (4 * args.dim + 4))
  variants = [("managed", args.rows), ("hash", args.rows), ("hash", same_mem)]
  results = []
  for seed in args.seeds:
    for policy, rows in variants:
      r = run(seed, policy, rows, args)
      results.append(r)
      print(json.dumps(r), flush=True)
  for policy, rows in variants:
    a = [r["auc"] for r in results if r["policy"] == policy and r["rows"] == rows]
    print(f"{policy:>8} rows {rows:>6d}: AUC mean {np.mean(a):.4f} (min {np.min(a):.4f}, "
          f"max {np.max(a):.4f}) over {len(a)} seeds")
  return results


if __name__ == "__main__":
  main()
