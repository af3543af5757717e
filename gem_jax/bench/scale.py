"""Inputs of the scale projection taken from a run config: FLOPs, dense parameters, plan volumes.

`plan_volumes` builds the config's real embedding plan on an abstract (R, S) mesh
(no devices needed) for a global batch of b R S and reads its exchange bytes:
`forward_bytes` (the lookup all-to-alls) and `sync_bytes` (the replica sync).
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


def _plan(facts: ModelFacts, config, replicas: int, shards: int, per_device_batch: int,
          replica_sync: str | None = None):
  mesh = AbstractMesh((replicas, shards), ("replica", "shard"))
  opt = emb_lib.SparseOptimizerConfig(kind=config.embedding.optimizer, lr=config.embedding.lr)
  budget = config.embedding.get("memory_budget_gb")
  return emb_lib.plan_embeddings(
      list(facts.tables), list(facts.features), mesh,
      batch_size=per_device_batch * replicas * shards, optimizer=opt,
      memory_budget_bytes=int(budget * 2**30) if budget else None,
      replica_sync=replica_sync or config.embedding.get("replica_sync", "auto"))


def plan_volumes(facts: ModelFacts, config, replicas: int, shards: int, per_device_batch: int,
                 param_bytes: int = 4, grad_bytes: int = 4) -> network.StepVolumes:
  """Bytes per device per step of the config's plan on an (R, S) mesh: the lookup
  exchange, the replica sync as planned, and the sync with row gathers only."""
  plan = _plan(facts, config, replicas, shards, per_device_batch)
  mesh_wide = {n for n, b in plan.buffers.items() if b.kind == "replicated"}

  def split(sync):
    by = plan.sync_bytes(sync)
    return (float(sum(v for n, v in by.items() if n not in mesh_wide)),
            float(sum(v for n, v in by.items() if n in mesh_wide)))

  (sync, sync_mesh), (rows, rows_mesh) = split(None), split("rows")
  return network.StepVolumes(emb_a2a=float(sum(plan.forward_bytes().values())),
                             emb_sync=sync, emb_sync_rows=rows,
                             dense_params=facts.dense_params,
                             param_bytes=param_bytes, grad_bytes=grad_bytes,
                             emb_sync_mesh=sync_mesh, emb_sync_mesh_rows=rows_mesh)


def describe_sharding(facts: ModelFacts, config, shards: int, per_device_batch: int) -> dict:
  """Table -> sharding type chosen by the planner for a 1 x S mesh."""
  return dict(_plan(facts, config, 1, shards, per_device_batch).sharding)

