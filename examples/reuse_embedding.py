"""gem_jax's embedding engine and a gem_jax layer inside another JAX program.

Its own 2x2 CPU mesh, its own NNX model (WukongStack + a small head), its own jitted
train step: optax adam for the dense part, `apply_sparse_updates` for the tables.
Trains on planted data and prints the held-out AUC next to the planted optimum.
  python examples/reuse_embedding.py [--steps 300]
"""
import argparse
import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"   # before jax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gem_jax.embedding import (FeatureConfig, SparseOptimizerConfig, TableConfig,
                               apply_sparse_updates, gather_rows, init_embedding_state, lookup,
                               plan_embeddings, pool_rows, prepare_ids, table_collisions)
from gem_jax.layers.wukong import WukongStack

D, N_DENSE, BATCH, EVAL_BATCH = 16, 4, 256, 2048
TABLES = [TableConfig("ad", 600, D),                 # ids 0..599: default policy 'error'
          TableConfig("cat", 40, D),
          TableConfig("user", 16_384, D, sharding="row_wise", id_policy="hash", vocab=3000)]
FEATURES = [FeatureConfig("ad", "ad"), FeatureConfig("cat", "cat", bag=2, pooling="mean"),
            FeatureConfig("user", "user")]


def planted(rng, n, truth):
  """Raw ids (user ids are arbitrary uint64s), dense inputs, labels and true logits."""
  ids = {"ad": rng.integers(0, 600, (n, 1)), "cat": rng.integers(0, 40, (n, 2)),
         "user": truth["user_raw"][rng.integers(0, len(truth["user_raw"]), (n, 1))]}
  dense = rng.normal(size=(n, N_DENSE)).astype(np.float32)
  user = np.searchsorted(truth["user_raw"], ids["user"][:, 0])   # index of the raw id
  logit = (truth["ad"][ids["ad"][:, 0]] + truth["cat"][ids["cat"]].mean(1)
           + truth["user"][user] * dense[:, 0] + dense @ truth["w"])    # user x dense[0]
  labels = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
  return ids, dense, labels, logit


def auc(score, label):
  """Mann-Whitney: P(score of a positive > score of a negative)."""
  rank = np.empty(len(score)); rank[np.argsort(score)] = np.arange(1, len(score) + 1)
  pos = label > 0.5
  return (rank[pos].sum() - pos.sum() * (pos.sum() + 1) / 2) / (pos.sum() * (~pos).sum())


class Model(nnx.Module):
  """Tokens (B, 3 + 1, D) -> WukongStack -> (B, n_out, D) -> MLP head -> logit (B,)."""

  def __init__(self, rngs):
    self.dense_proj = nnx.Linear(N_DENSE, D, rngs=rngs)
    self.stack = WukongStack(4, D, num_layers=2, n_f=4, n_l=4, k=4, mlp_hidden=(64,), rngs=rngs)
    self.head = nnx.Sequential(nnx.Linear(self.stack.n_out * D, 64, rngs=rngs), nnx.relu,
                               nnx.Linear(64, 1, rngs=rngs))

  def __call__(self, emb, dense):
    tokens = jnp.stack([emb["ad"], emb["cat"], emb["user"], self.dense_proj(dense)], 1)
    x = self.stack(tokens)                                   # (B, n_out, D)
    return self.head(x.reshape(x.shape[0], -1))[:, 0]        # (B,)


def main(steps: int):
  mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("replica", "shard"))
  opt = SparseOptimizerConfig("rowwise_adagrad", lr=0.1)
  kw = dict(optimizer=opt, memory_budget_bytes=64 << 20, replicate_max_bytes=0)  # ad, cat: table-wise
  plan = plan_embeddings(TABLES, FEATURES, mesh, batch_size=BATCH, **kw)
  eval_plan = plan_embeddings(TABLES, FEATURES, mesh, batch_size=EVAL_BATCH, **kw)  # same state
  print(plan.describe())
  emb_state = init_embedding_state(plan, jax.random.key(0))
  graphdef, params = nnx.split(Model(nnx.Rngs(0)))
  params = jax.device_put(params, NamedSharding(mesh, P()))       # dense part: replicated
  tx = optax.adam(3e-3)
  opt_state = jax.device_put(tx.init(params), NamedSharding(mesh, P()))

  def loss_fn(params, rows, ctx, dense, labels):
    logits = nnx.merge(graphdef, params)(pool_rows(plan, rows, ctx), dense)
    return optax.sigmoid_binary_cross_entropy(logits, labels).mean()

  @jax.jit
  def train_step(params, opt_state, emb_state, ids, dense, labels):
    rows, ctx = gather_rows(plan, emb_state, ids)
    loss, (g_params, g_rows) = jax.value_and_grad(loss_fn, (0, 1))(params, rows, ctx, dense,
                                                                   labels)
    updates, opt_state = tx.update(g_params, opt_state, params)
    emb_state = apply_sparse_updates(plan, emb_state, ctx, g_rows)
    return optax.apply_updates(params, updates), opt_state, emb_state, loss

  @jax.jit
  def predict(params, emb_state, ids, dense):           # another batch size: eval_plan
    return nnx.merge(graphdef, params)(lookup(eval_plan, emb_state, ids), dense)

  rng = np.random.default_rng(0)
  raw = np.unique(rng.integers(0, 2**64 - 1, 3000, dtype=np.uint64, endpoint=True))
  truth = {"ad": rng.normal(0, 1.0, 600), "cat": rng.normal(0, 1.0, 40),
           "user": rng.normal(0, 1.0, len(raw)), "w": rng.normal(0, 0.3, N_DENSE),
           "user_raw": raw}
  batch_sh = plan.batch_sharding()                       # P(('replica', 'shard'))
  for step in range(steps):
    ids, dense, labels, _ = planted(rng, BATCH, truth)
    dev_ids = jax.device_put(prepare_ids(plan, ids), plan.ids_shardings())
    params, opt_state, emb_state, loss = train_step(
        params, opt_state, emb_state, dev_ids, jax.device_put(dense, batch_sh),
        jax.device_put(labels, batch_sh))
    if step % 100 == 0:
      print(f"step {step}: loss {float(loss):.4f}, user ids -> rows "
            f"{table_collisions(plan, ids, prepare_ids(plan, ids))['user']}")
  ids, dense, labels, logit = planted(np.random.default_rng(1), EVAL_BATCH, truth)
  pred = predict(params, emb_state, jax.device_put(prepare_ids(eval_plan, ids),
                                                   eval_plan.ids_shardings()),
                 jax.device_put(dense, eval_plan.batch_sharding()))
  print(f"held-out AUC {auc(np.asarray(pred), labels):.4f} "
        f"(planted optimum {auc(logit, labels):.4f})")


if __name__ == "__main__":
  ap = argparse.ArgumentParser()
  ap.add_argument("--steps", type=int, default=300)
  main(ap.parse_args().steps)
