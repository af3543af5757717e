"""Inputs of the scale projection taken from a run config: FLOPs, dense parameters, plan volumes.

`plan_volumes` builds the config's real embedding plan on an abstract (R, S) mesh
(no devices needed) for a global batch of b R S and reads its exchange bytes:
the forward/backward exchange is the R = 1 plan's, the replica sync is the rest.
"""
from __future__ import annotations

import dataclasses

from flax import nnx
from jax.sharding import AbstractMesh

from gem_jax import embedding as emb_lib
from gem_jax import flops as flops_lib
from gem_jax.bench import network
from gem_jax.bench import runner
from gem_jax.data import registry as data_registry
from gem_jax.train import loop


@dataclasses.dataclass(frozen=True)
class ModelFacts:
  """What the projection needs from a config (per example / per model)."""
  train_flops_per_example: float
  dense_params: int
  spec: object
  tables: tuple
  features: tuple


def model_facts(config) -> ModelFacts:
  train_src, _ = data_registry.make_sources(config.data)
  spec = train_src.spec
  shared = getattr(train_src, "shared_vocab", None) if config.embedding.share_tables else None
  tables, features = loop.embedding_configs(spec, config.embedding, shared)
  dims = {f.name: config.embedding.dim for f in spec.sparse}
  model_fn = loop.model_factory(config.model, spec, dims)
  params = flops_lib.count_params(nnx.eval_shape(lambda: model_fn(nnx.Rngs(0))))
  return ModelFacts(runner.analytic_train_flops(config, spec, dims), params, spec,
                    tuple(tables), tuple(features))


def _plan(facts: ModelFacts, config, replicas: int, shards: int, per_device_batch: int):
  mesh = AbstractMesh((replicas, shards), ("replica", "shard"))
  opt = emb_lib.SparseOptimizerConfig(kind=config.embedding.optimizer, lr=config.embedding.lr)
  budget = config.embedding.get("memory_budget_gb")
  return emb_lib.plan_embeddings(
      list(facts.tables), list(facts.features), mesh,
      batch_size=per_device_batch * replicas * shards, optimizer=opt,
      memory_budget_bytes=int(budget * 2**30) if budget else None)


def plan_volumes(facts: ModelFacts, config, replicas: int, shards: int, per_device_batch: int,
                 param_bytes: int = 4, grad_bytes: int = 4) -> network.StepVolumes:
  """Bytes per device per step of the config's plan on an (R, S) mesh (see module doc)."""
  fwd = sum(_plan(facts, config, 1, shards, per_device_batch).exchange_bytes().values())
  plan = _plan(facts, config, replicas, shards, per_device_batch)
  total = sum(plan.exchange_bytes().values())
  local_grad_bytes = sum(buf.local_rows * buf.local_dim * 4 for buf in plan.buffers.values())
  allreduce = 2.0 * (replicas - 1) / replicas * local_grad_bytes if replicas > 1 else 0.0
  return network.StepVolumes(emb_a2a=float(fwd), emb_sync=float(total - fwd),
                             emb_sync_allreduce=allreduce, dense_params=facts.dense_params,
                             param_bytes=param_bytes, grad_bytes=grad_bytes)


def describe_sharding(facts: ModelFacts, config, shards: int, per_device_batch: int) -> dict:
  """Table -> sharding type chosen by the planner for a 1 x S mesh."""
  return dict(_plan(facts, config, 1, shards, per_device_batch).sharding)

