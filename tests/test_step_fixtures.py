"""Shared helpers (no tests) for the trainer tests: a tiny spec, model and batches.

The model is a two-layer MLP over the pooled embeddings and a masked sum over
the sequence items, small enough to compile in about a second; the embedding
engine, optimizer, metrics and checkpoint code are the real ones.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gem_jax import embedding as emb_lib
from gem_jax.data.spec import DataSpec, SequenceStreamSpec, SparseFeatureSpec
from gem_jax.layers.dense import Dense
from gem_jax.train import metrics, optim
from gem_jax.train import state as state_lib
from gem_jax.train import step as step_lib
from gem_jax.train.setup import embedding_configs

SPEC = DataSpec(
    n_dense=3,
    sparse=(SparseFeatureSpec("user", 64, bag=2), SparseFeatureSpec("ad", 48),
            SparseFeatureSpec("hist_ad", 48)),
    sequences=(SequenceStreamSpec("clicks", 4, ("hist_ad",)),),
    num_domains=2, tasks=("click", "conv"))
DIM = 8


class TinyModel(nnx.Module):
  """logits = W2 relu(W1 [dense; e_user; e_ad; sum_valid e_hist]) (B, 2)."""

  def __init__(self, spec, feature_dims, *, rngs, dtype=jnp.float32):
    del spec
    d = feature_dims["user"]
    self.l1 = Dense(3 + 3 * d, 64, rngs=rngs, dtype=dtype)
    self.l2 = Dense(64, 2, rngs=rngs, dtype=dtype, kernel_axes=("mlp", "heads"))

  def __call__(self, x):
    s = x["seq"]["clicks"]
    hist = jnp.sum(s["items"]["hist_ad"] * s["mask"][..., None], axis=1)  # (B, D)
    h = jnp.concatenate([x["dense"], x["sparse"]["user"], x["sparse"]["ad"], hist], -1)
    return self.l2(jax.nn.relu(self.l1(h))).astype(jnp.float32)  # (B, 2)


def make_batch(seed: int, b: int = 16) -> dict:
  rng = np.random.default_rng(seed)
  return {
      "dense": rng.normal(size=(b, 3)).astype(np.float32),
      "ids": {"user": rng.integers(-1, 64, (b, 2)), "ad": rng.integers(0, 48, (b, 1)),
              "hist_ad": rng.integers(0, 48, (b, 4))},
      "seq": {"clicks": {"len": rng.integers(0, 5, (b,)).astype(np.int32),
                         "action": np.ones((b, 4), np.int32), "surface": np.zeros((b, 4), np.int32),
                         "dt": np.ones((b, 4), np.float32)}},
      "domain": rng.integers(0, 2, (b,)).astype(np.int32),
      "labels": rng.integers(0, 2, (b, 2)).astype(np.float32),
      "label_mask": (rng.random((b, 2)) < 0.8).astype(np.float32),
  }


class Built:
  """Plan, shardings and a jitted step for one mesh (a test helper, not library code)."""

  def __init__(self, mesh, batch_size=16, grad_accum=1, sparse="rowwise_adagrad",
               sharding="row_wise"):
    emb_cfg = type("E", (), dict(dim=DIM, sharding=sharding, id_policy="error"))()
    tables, features = embedding_configs(SPEC, emb_cfg, shared={"hist_ad": "ad"})
    self.plan = emb_lib.plan_embeddings(
        tables, features, mesh, batch_size=batch_size,
        optimizer=emb_lib.SparseOptimizerConfig(kind=sparse, lr=0.1))
    self.mesh = mesh
    self.model_fn = lambda rngs: TinyModel(SPEC, {f.name: DIM for f in SPEC.sparse}, rngs=rngs)
    self.tx, self.schedule = optim.make_optimizer(lr=1e-2, steps=20, warmup_steps=2)
    self.acc_fn = lambda: metrics.init_accumulators(2, 2, 64)
    self.emb_init = functools.partial(emb_lib.init_embedding_state, self.plan)
    self.abstract, self.shardings = state_lib.abstract_train_state(
        self.model_fn, self.tx, self.plan, self.emb_init, self.acc_fn, mesh)
    self.cfg = step_lib.StepConfig(state_lib.model_graphdef(self.model_fn), self.plan, self.tx,
                                   self.schedule, optim.sparse_lr_schedule(0.1, 2), SPEC,
                                   grad_accum)

  def init(self, seed=0):
    return state_lib.init_train_state(jax.random.key(seed), self.model_fn, self.tx,
                                      self.emb_init, self.acc_fn, self.shardings)

  def put(self, batch):
    from gem_jax.train.setup import device_putter  # pylint: disable=import-outside-toplevel
    return device_putter(self.plan, self.mesh)(batch)

  def step_fn(self, batch):
    sh = jax.tree.map(lambda x: x.sharding, batch)
    return step_lib.jit_train_step(self.cfg, self.shardings, sh)
