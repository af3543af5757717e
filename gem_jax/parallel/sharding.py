"""Sharding rules: logical axis names -> mesh axes, in one table.

Parameters carry logical axis names in their `logical_axes` metadata (see
`gem_jax.layers.dense.param`), e.g. a Dense kernel is `('embed', 'mlp')`.
`RULES` maps each name to the mesh axis it may be split over:

  batch        -> ('replica', 'shard')   examples are split over every device
  embed, mlp,  -> 'shard'                dense parameters: FSDP inside a replica
  heads, ...                             group, replicated over 'replica' (HSDP)
  norm, tasks, -> None                   never split (tiny axes; `lookup`: per-token
  lookup, ...                            lookup tables, see RULES)
  ...

A dense parameter is split over 'shard' on ONE axis: the largest axis whose
logical name maps to 'shard' and whose size is divisible by the 'shard' size;
if there is none (or the parameter has fewer than `min_elements` entries,
where the all-gather would cost more than the memory it saves) it is
replicated. Names not in the table are treated as 'shard' candidates, so a
new layer is sharded by default. Embedding tables and their slots are not
covered here: the embedding planner decides (`plan.state_shardings()`).

Example on a (2, 4) mesh: kernel (256, 1024) named ('embed', 'mlp') ->
P(None, 'shard'): each device holds (256, 256); the two replicas hold the
same four quarters.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any, Mapping, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

BATCH_AXES = ("replica", "shard")

# The one rules table: logical axis name -> mesh axis (or None = replicated).
RULES: Mapping[str, Any] = {
    "batch": BATCH_AXES,
    "embed": "shard",
    "mlp": "shard",
    "heads": "shard",
    "kv": "shard",
    "qkv": "shard",
    "ffn": "shard",
    "tokens": "shard",
    "features": "shard",
    "vocab": "shard",
    "norm": None,
    "tasks": None,
    "domains": None,
    "layers": None,
    # Both axes of a small table looked up per token (`jnp.take`: action, surface, time
    # buckets, domains, CLS slots): kept whole. Its gradient is a scatter-add of the
    # (B, L, d) token gradients; with the table split on d the SPMD partitioner cannot
    # split those to match and falls back to replicating them ("involuntary full
    # rematerialization" warnings: 5 in gem_xl's step on a 2x4 mesh, 1 in tiny's; none now).
    "lookup": None,
}


# ---- activations ------------------------------------------------------------------
_ACTIVATION_MESH: contextvars.ContextVar = contextvars.ContextVar("activation_mesh",
                                                                  default=None)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh | None):
  """While tracing under it, `constrain_batch` pins activations to `mesh`'s batch split.

  Without such pins the SPMD partitioner may carry a parameter's FSDP split
  ('shard' on a feature axis) into the activations and later has to undo it
  ("involuntary full rematerialization": replicate, then re-split); with them
  it all-gathers the (small) parameter instead. Outside the context (a model
  used on its own) `constrain_batch` does nothing.
  """
  token = _ACTIVATION_MESH.set(mesh)
  try:
    yield
  finally:
    _ACTIVATION_MESH.reset(token)


_PER_REPLICA: contextvars.ContextVar = contextvars.ContextVar("per_replica", default=False)


@contextlib.contextmanager
def per_replica():
  """While tracing a function vmapped over the replicas (the batch as (R, B / R, ...),
  `jax.vmap(..., spmd_axis_name='replica')`), `constrain_batch` and `batch_groups` see
  one replica's batch: split over 'shard' only (the vmap adds 'replica' in front)."""
  token = _PER_REPLICA.set(True)
  try:
    yield
  finally:
    _PER_REPLICA.reset(token)


def _batch_axes() -> tuple[str, ...]:
  return ("shard",) if _PER_REPLICA.get() else BATCH_AXES


def replicas() -> int:
  """'replica' size of the activation mesh (1 outside `activation_sharding`)."""
  mesh = _ACTIVATION_MESH.get()
  return 1 if mesh is None else mesh.shape["replica"]


def constrain_batch(x: jax.Array) -> jax.Array:
  """x with its leading (batch) axis split over ('replica', 'shard'), the rest whole
  (under `per_replica`: over 'shard')."""
  mesh = _ACTIVATION_MESH.get()
  if mesh is None or x.ndim == 0:
    return x
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(_batch_axes())))


def batch_groups(mesh: Mesh | None = None) -> int:
  """Batch shards of `mesh`, by default of the activation mesh (1 outside
  `activation_sharding`; under `per_replica`, one replica's)."""
  axes = _batch_axes() if mesh is None else BATCH_AXES
  mesh = _ACTIVATION_MESH.get() if mesh is None else mesh
  return 1 if mesh is None else math.prod(mesh.shape[a] for a in axes)


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) axis split over ('replica', 'shard'); other axes whole."""
  return NamedSharding(mesh, P(RULES["batch"]))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def dense_param_spec(shape: Sequence[int], logical_axes: Sequence[str | None] | None,
                     mesh: Mesh, *, rules: Mapping[str, Any] = RULES,
                     min_elements: int = 1024) -> P:
  """PartitionSpec of one dense parameter (see the module docstring).

  Args:
    shape: the parameter's shape.
    logical_axes: its logical axis names (None: every axis is a candidate).
    mesh: a ('replica', 'shard') mesh.
    rules: logical name -> mesh axis.
    min_elements: parameters smaller than this are replicated.
  """
  shape = tuple(shape)
  if logical_axes is None:
    logical_axes = (None,) * len(shape)
  if len(logical_axes) != len(shape):
    raise ValueError(f"logical axes {tuple(logical_axes)} do not match shape {shape}")
  n_shard = mesh.shape["shard"]
  size = 1
  for s in shape:
    size *= s
  spec = [None] * len(shape)
  if n_shard == 1 or size < min_elements:
    return P(*spec)
  best = None
  for i, (dim, name) in enumerate(zip(shape, logical_axes)):
    target = rules.get(name, "shard") if name is not None else "shard"
    if target != "shard" or dim % n_shard:
      continue
    if best is None or dim > shape[best]:
      best = i
  if best is not None:
    spec[best] = "shard"
  return P(*spec)


def dense_param_shardings(abstract_params, mesh: Mesh, **kw):
  """NamedSharding for every leaf of an nnx.State of params (same tree structure).

  `abstract_params` is the output of `jax.eval_shape` (nnx.Variable leaves
  holding ShapeDtypeStructs and their `logical_axes` metadata).
  """
  def one(v):
    if _is_variable(v):
      axes = v.get_metadata().get("logical_axes")
      return v.replace(NamedSharding(mesh, dense_param_spec(v.get_value().shape, axes, mesh, **kw)))
    return NamedSharding(mesh, dense_param_spec(v.shape, None, mesh, **kw))
  return jax.tree.map(one, abstract_params, is_leaf=_is_variable)


def optimizer_state_shardings(tx, abstract_opt_state, param_shardings, mesh: Mesh):
  """Shardings of an optax state: moment trees follow the params, the rest is replicated."""
  import optax  # local: only the trainer needs it
  return optax.tree_map_params(
      tx, lambda _, s: s, abstract_opt_state, param_shardings,
      transform_non_params=lambda _: replicated(mesh),
      is_leaf=lambda x: isinstance(x, NamedSharding))


def batch_shardings(batch, mesh: Mesh, ids_shardings: Mapping[str, NamedSharding] | None = None):
  """Shardings for a batch dict: every leaf split on its leading axis, `ids`
  (and `weights`) per feature as the embedding plan says."""
  b = batch_sharding(mesh)
  out = jax.tree.map(lambda _: b, batch)
  if ids_shardings is not None:
    for key in ("ids", "weights"):
      if key in batch:
        out[key] = {f: ids_shardings.get(f, b) for f in batch[key]}
  return out

