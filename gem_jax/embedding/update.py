"""`apply_sparse_updates`: row gradients -> deduplicated in-place optimizer steps.

Replica consistency. Each replica group computed row gradients for its own part
of the batch, on the owners of the rows. Instead of all-reducing tables, each
owner all-gathers the (row, gradient) pairs of the same buffer block from the
other replicas (`all_gather` over 'replica': R x the per-device row count, a
size set by the batch, not the table), then every replica deduplicates and
applies exactly the same computation to exactly the same inputs, so replicas
stay bit-identical (an all-reduce is not guaranteed to give bitwise identical
sums on every participant; a gather followed by the same local sum is).
Replicated tables gather over ('replica', 'shard') the same way.

Worked example (R = 2, S = 1, one table): replica 0 looked up rows [4, 7],
replica 1 rows [7, .]; after the gather both hold rows [4, 7, 7, .] with their
gradients, dedup gives [4, 7] with g7 = g7' + g7'', and both apply it.

Column-wise tables keep one row-wise Adagrad accumulator per row (FBGEMM
semantics over the full width D): each shard sums g^2 over its columns, the
partial sums are all-gathered over 'shard' and added in shard order, so every
shard holds the same accumulator (stored replicated).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from gem_jax.embedding.exchange import DEV
from gem_jax.embedding.optimizers import apply_rows, dedup_rows
from gem_jax.embedding.plan import EmbeddingPlan


def apply_sparse_updates(plan: EmbeddingPlan, state, ctx, row_grads, lr=None):
  """Applies d loss / d rows to the owning shards, in place.

  Args:
    plan: the embedding plan.
    state: the embedding state (donate it to the enclosing jit for in-place updates).
    ctx: the `ctx` returned by `gather_rows` for these rows.
    row_grads: {unit: gradient}, the same structure as `rows`.
    lr: learning rate overriding `plan.optimizer.lr` (may be traced, for schedules).
  Returns:
    The updated state (same structure and shardings).
  """
  opt = plan.optimizer
  lr = jnp.asarray(opt.lr if lr is None else lr, jnp.float32)
  specs = plan.state_specs()

  def body(state, row_idx, grads, lr):
    new = {}
    for name, buf in plan.buffers.items():
      units = [u for u in plan.units.values() if u.buffer == name]
      if not units:
        new[name] = state[name]
        continue
      width = buf.local_dim
      rows = jnp.concatenate([row_idx[u.name][0, 0].reshape(-1) for u in units])  # (n,)
      g = jnp.concatenate([grads[u.name][0, 0].reshape(-1, width).astype(jnp.float32)
                           for u in units])                                     # (n, Dl)
      axes = ("replica", "shard") if buf.kind == "replicated" else ("replica",)
      if any(plan.mesh.shape[a] > 1 for a in axes):
        rows = jax.lax.all_gather(rows, axes, axis=0, tiled=True)     # (R n,) same everywhere
        g = jax.lax.all_gather(g, axes, axis=0, tiled=True)           # (R n, Dl)
      uniq, gsum = dedup_rows(rows, g)
      g2 = jnp.sum(gsum * gsum, axis=1)                               # (n,)
      if buf.kind == "column_wise" and plan.num_shards > 1:
        g2 = jnp.sum(jax.lax.all_gather(g2, "shard", axis=0), axis=0)  # full-width sum
      new[name] = apply_rows(opt, state[name], uniq, gsum, g2 / buf.dim, lr)
    return new

  in_specs = (specs, {n: DEV for n in plan.units}, {n: DEV for n in plan.units}, P())
  # check_vma=False: the outputs are replicated over 'replica' (and, for the
  # column-wise accumulator, over 'shard') by construction: every holder of a
  # block computes on identical gathered inputs (tested bitwise).
  fn = jax.shard_map(body, mesh=plan.mesh, in_specs=in_specs, out_specs=specs, check_vma=False)
  return fn(state, ctx["row"], row_grads, lr)
