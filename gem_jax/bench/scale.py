"""Inputs of the scale projection taken from a run config: FLOPs, dense parameters, plan volumes.

`plan_volumes` builds the config's real embedding plan on an abstract (R, S) mesh
(no devices needed, `setup.make_plan`) for a global batch of b R S and reads its exchange bytes:
`forward_bytes` (the lookup all-to-alls) and `sync_bytes` (the replica sync).
"""
from __future__ import annotations

import dataclasses

from flax import nnx
from jax.sharding import AbstractMesh

from gem_jax import flops as flops_lib
from gem_jax.bench import network
from gem_jax.train import setup as setup_lib


@dataclasses.dataclass(frozen=True)
class ModelFacts:
  """What the projection needs from a config (per example / per model)."""
  train_flops_per_example: float
  dense_params: int
  spec: object
  tables: tuple
  features: tuple
  shared: dict | None = None   # feature -> the feature whose table it reads


def model_facts(config) -> ModelFacts:
  setup_lib.resolve_table_lr(config)
  train_src, _, shared = setup_lib.sources(config)
  spec = train_src.spec
  tables, features = setup_lib.embedding_configs(spec, config.embedding, shared)
  dims = {f.name: config.embedding.dim for f in spec.sparse}
  model_fn = setup_lib.model_factory(config.model, spec, dims)
  params = flops_lib.count_params(nnx.eval_shape(lambda: model_fn(nnx.Rngs(0))))
  return ModelFacts(setup_lib.train_flops_per_example(config.model, spec, dims), params, spec,
                    tuple(tables), tuple(features), shared)


def _plan(facts: ModelFacts, config, replicas: int, shards: int, per_device_batch: int,
          replica_sync: str | None = None):
  mesh = AbstractMesh((replicas, shards), ("replica", "shard"))
  exchange = config.embedding.get("rw_exchange", "auto")   # 'auto' on the projected GPUs:
  return setup_lib.make_plan(facts.spec, config.embedding, mesh,
                             per_device_batch * replicas * shards, facts.shared,
                             replica_sync=replica_sync,
                             rw_exchange="ragged" if exchange == "auto" else exchange)


def plan_volumes(facts: ModelFacts, config, replicas: int, shards: int, per_device_batch: int,
                 param_bytes: int = 4, grad_bytes: float = 4,
                 gather_bytes: float | None = None,
                 replica_grad_bytes: float | None = None) -> network.StepVolumes:
  """Bytes per device per step of the config's plan on an (R, S) mesh: the lookup
  exchange, the replica sync as planned, and the sync with row gathers only; the dense
  parameters' bytes as given (`network.StepVolumes`)."""
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
                             emb_sync_mesh=sync_mesh, emb_sync_mesh_rows=rows_mesh,
                             gather_bytes=gather_bytes,
                             replica_grad_bytes=replica_grad_bytes)


def describe_sharding(facts: ModelFacts, config, shards: int, per_device_batch: int) -> dict:
  """Table -> sharding type chosen by the planner for a 1 x S mesh."""
  return dict(_plan(facts, config, 1, shards, per_device_batch).sharding)

