"""The train state: one pytree holding everything a step reads and writes.

  TrainState(
    step:        int32 ()                       optimizer steps taken
    params:      nnx.State                      dense parameters, fp32 master weights
    model_state: nnx.State                      non-trainable model variables (often empty)
    opt_state:   optax state                    dense optimizer (AdamW moments, ...)
    emb:         embedding state                tables + sparse optimizer slots (plan layout)
    rng:         uint32 (2,)                    raw key data; advanced once per step
    metrics:     eval metric accumulators       `gem_jax.train.metrics` (survive checkpoints)
  )

It is built in three moves ("shapes before arrays"):
  1. `jax.eval_shape` of the init function -> abstract state (no memory used);
  2. shardings from the abstract state: dense params through the rules table
     (`gem_jax.parallel.sharding`), optimizer moments like their params,
     embedding state as the planner says, the rest replicated;
  3. `jax.jit(init, out_shardings=...)`: every array is created directly in its
     shard; no table or parameter is ever whole on one device.

The model's structure (`nnx.GraphDef`) is static and kept outside the state;
`nnx.merge(graphdef, params, model_state)` rebuilds the module inside the step.
"""
from __future__ import annotations

from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from gem_jax.parallel import sharding as shd


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  model_state: Any
  opt_state: Any
  emb: Any
  rng: jax.Array
  metrics: Any


def split_model(model: nnx.Module):
  """(graphdef, params, rest): params are nnx.Param, rest every other variable."""
  return nnx.split(model, nnx.Param, ...)


def _dense_init(key, model_fn, tx, acc_fn):
  """Everything but the embedding state, from one key (pure; run under jit)."""
  k_model, k_rng = jax.random.split(key)
  model = model_fn(nnx.Rngs(k_model))
  _, params, rest = split_model(model)
  return dict(step=jnp.zeros((), jnp.int32), params=params, model_state=rest,
              opt_state=tx.init(params), rng=jax.random.key_data(k_rng), metrics=acc_fn())


def model_graphdef(model_fn: Callable[[nnx.Rngs], nnx.Module]) -> nnx.GraphDef:
  """The model's static structure, without allocating its parameters."""
  out = {}

  def build(key):
    g, p, r = split_model(model_fn(nnx.Rngs(key)))
    out["g"] = g
    return p, r

  jax.eval_shape(build, jax.random.key(0))
  return out["g"]


def abstract_train_state(model_fn: Callable[[nnx.Rngs], nnx.Module], tx, plan, emb_init: Callable,
                         acc_fn: Callable, mesh: Mesh):
  """(abstract TrainState, TrainState of NamedShardings); allocates nothing.

  Args:
    model_fn: rngs -> model (e.g. `lambda rngs: GEM(cfg, spec, dims, rngs=rngs)`).
    tx: the dense optax optimizer.
    plan: the embedding plan (gives `state_shardings()`).
    emb_init: key -> embedding state (`functools.partial(init_embedding_state, plan)`).
    acc_fn: () -> metric accumulators.
    mesh: the ('replica', 'shard') mesh.
  """
  key = jax.random.key(0)
  dense = jax.eval_shape(lambda k: _dense_init(k, model_fn, tx, acc_fn), key)
  emb = jax.eval_shape(emb_init, key)
  abstract = TrainState(emb=emb, **dense)
  rep = shd.replicated(mesh)
  p_sh = shd.dense_param_shardings(dense["params"], mesh)
  shardings = TrainState(
      step=rep,
      params=p_sh,
      model_state=jax.tree.map(lambda _: rep, dense["model_state"]),
      opt_state=shd.optimizer_state_shardings(tx, dense["opt_state"], p_sh, mesh),
      emb=plan.state_shardings(),
      rng=rep,
      metrics=jax.tree.map(lambda _: rep, dense["metrics"]))
  abstract = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
  return abstract, shardings


def init_train_state(key: jax.Array, model_fn, tx, emb_init: Callable, acc_fn: Callable,
                     shardings: TrainState) -> TrainState:
  """A fresh TrainState, every array created inside jit directly in `shardings`.

  The embedding state comes from `emb_init` (the engine's own sharded init);
  the dense part from one jit with `out_shardings`.
  """
  k_dense, k_emb = jax.random.split(key)
  dense_sh = {f: getattr(shardings, f) for f in
              ("step", "params", "model_state", "opt_state", "rng", "metrics")}
  dense = jax.jit(lambda k: _dense_init(k, model_fn, tx, acc_fn), out_shardings=dense_sh)(k_dense)
  emb = jax.jit(emb_init, out_shardings=shardings.emb)(k_emb)
  return TrainState(emb=emb, **dense)
