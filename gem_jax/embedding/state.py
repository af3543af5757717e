"""Embedding state: creation in place, and the canonical (checkpoint) form.

State: {buffer: {'weight': array, <slots>}} with the layouts of `plan.Buffer`,
each leaf created directly in its sharding (jit out_shardings).

Canonical form (`export_state`): {table: {'weight': (rows, dim), 'accumulator':
(rows,) | 'm', 'v': (rows, dim), 'step': ()}}: unpadded global arrays, split by
rows over 'shard' where the rows divide evenly (`layout.canonical_spec`), so a
checkpoint of it restores onto any mesh through `import_state`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from gem_jax.embedding import managed, tw_move
from gem_jax.embedding.plan import MAP_LEAVES, EmbeddingPlan


def _default_slots(opt, rows: int, dim: int) -> dict:
  out = {}
  for s in opt.slot_names():
    if s == "accumulator":
      out[s] = jnp.full((rows,), opt.initial_accumulator, jnp.float32)
    elif s == "step":
      out[s] = jnp.zeros((), jnp.int32)
    else:
      out[s] = jnp.zeros((rows, dim), jnp.float32)
  return out


def _init_canonical(plan: EmbeddingPlan, key) -> dict:
  """Fresh canonical state; table i uses fold_in(key, i), so it does not depend on the mesh."""
  shard = plan.canonical_shardings()
  out = {}
  for i, (name, t) in enumerate(plan.tables.items()):
    w = t.initializer(jax.random.fold_in(key, i), (t.rows, t.dim), t.dtype)
    w = jax.lax.with_sharding_constraint(w.astype(t.dtype), shard[name]["weight"])
    out[name] = {"weight": w, **_default_slots(plan.table_optimizer(name), t.rows, t.dim)}
    if t.id_policy == "managed":
      out[name].update(managed.empty_map(t.rows))
  return out


def _layout(plan: EmbeddingPlan, canon: dict) -> dict:
  """Canonical tables -> padded, packed buffers (a pure function, jitted by callers)."""
  shard = plan.canonical_shardings()
  state = {}
  for name, buf in plan.buffers.items():
    leaves = ["weight", *buf.optimizer.slot_names()]
    if plan.is_managed(name):
      leaves += list(MAP_LEAVES)
    out = {}
    for leaf in leaves:
      if leaf in ("step", "map_used"):
        out[leaf] = canon[buf.tables[0]][leaf].astype(jnp.int32)
        continue
      per_row = leaf == "accumulator" or leaf.startswith("map_")
      dtype = (buf.dtype if leaf == "weight" else
               jnp.int32 if leaf.startswith("map_") else jnp.float32)
      if buf.kind == "table_wise":
        block = (buf.local_rows,) if per_row else (buf.local_rows, buf.dim)
        x = tw_move.pack(plan, buf, [canon[t][leaf] for t in buf.tables], block, dtype)
      else:
        x = canon[buf.tables[0]][leaf].astype(dtype)
        if buf.kind == "row_wise":
          pad = [(0, buf.rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1)
          x = jnp.pad(x, pad, constant_values=-1 if leaf == "map_hi" else 0)
        elif buf.kind == "column_wise" and not per_row:
          x = jnp.pad(x, ((0, 0), (0, buf.shape[1] - buf.dim)))
      out[leaf] = x
    state[name] = out
  return state


def _unlayout(plan: EmbeddingPlan, state: dict) -> dict:
  """Buffers -> unpadded canonical tables (inverse of `_layout`)."""
  shard = plan.canonical_shardings()
  canon = {t: {} for t in plan.tables}
  for name, buf in plan.buffers.items():
    if buf.kind == "table_wise":
      for leaf, x in state[name].items():
        if leaf == "step":
          for t in buf.tables:
            canon[t][leaf] = x
          continue
        specs = [shard[t][leaf].spec for t in buf.tables]
        for t, y in zip(buf.tables, tw_move.unpack(plan, buf, x, specs)):
          canon[t][leaf] = y
      continue
    for i, t in enumerate(buf.tables):
      rows, out = plan.tables[t].rows, {}
      for leaf, x in state[name].items():
        if leaf in ("step", "map_used"):
          out[leaf] = x
        elif buf.kind == "column_wise" and x.ndim == 2:
          out[leaf] = x[:, :buf.dim]
        else:
          out[leaf] = x[:rows]
      canon[t] = out
  return canon


def init_embedding_state(plan: EmbeddingPlan, key) -> dict:
  """Initial state, every leaf created in `plan.state_shardings()` (no full gather)."""
  fn = plan.cached_jit("init", lambda: jax.jit(
      lambda k: _layout(plan, _init_canonical(plan, k)), out_shardings=plan.state_shardings()))
  return fn(key)


def export_state(plan: EmbeddingPlan, state) -> dict:
  """{table: {'weight': (rows, dim), <slot>: ...}}: unpadded, sharded global arrays.

  The live `state` is keyed by *buffer*, not by table: table-wise tables of one
  (dim, dtype) share a packed buffer named `tw_d{dim}_{dtype}` (e.g.
  `tw_d16_float32`), every other table is the buffer of its own name.
  `plan.buffer_of[table]` gives the buffer, `plan.table_placement(table)` the
  rows it occupies, and `plan.describe()` prints both for every table. Read
  weights through this function, not from `state[...]` (padding, packing).
  """
  fn = plan.cached_jit("export", lambda: jax.jit(
      lambda s: _unlayout(plan, s), out_shardings=plan.canonical_shardings()))
  return fn(state)


def import_state(plan: EmbeddingPlan, canonical) -> dict:
  """Canonical arrays (from any mesh, or numpy) -> this plan's state.

  Slots missing from `canonical` (e.g. another optimizer's checkpoint) start fresh.
  """
  shard = plan.canonical_shardings()
  full = {}
  for name, t in plan.tables.items():
    if name not in canonical:
      raise KeyError(f"table {name!r} missing from the canonical state; got {sorted(canonical)}")
    src = canonical[name]
    want = (t.rows, t.dim)
    if tuple(src["weight"].shape) != want:
      raise ValueError(f"table {name!r}: canonical weight of shape {tuple(src['weight'].shape)},"
                       f" the plan expects {want}")
    leaves = {"weight": src["weight"]}
    leaves.update(managed.check_canonical_map(name, t, src))
    defaults = None
    for s in plan.table_optimizer(name).slot_names():
      if s in src:
        leaves[s] = src[s]
      else:
        if defaults is None:
          defaults = _default_slots(plan.table_optimizer(name), t.rows, t.dim)
        leaves[s] = defaults[s]
    full[name] = {k: jax.device_put(v, shard[name][k]) for k, v in leaves.items()}
  fn = plan.cached_jit("import", lambda: jax.jit(
      lambda c: _layout(plan, c), out_shardings=plan.state_shardings()))
  return fn(full)
