"""The train step: one pure function `(state, batch) -> (state, metrics)`.

Per step, for a global batch B split over ('replica', 'shard'):

  rows, ctx = gather_rows(plan, emb, ids)          ids -> owner shards -> local rows
  e         = pool_rows(plan, rows, ctx, w)        {feature: (B, D) | (B, L, D)}
  loss      = masked BCE(model(params; inputs(batch, e)), labels, label_mask)
  g_params, g_e = d loss / d (params, e)           (micro-batched if grad_accum > 1)
  g_rows    = pool_vjp(g_e)                        row gradients, never table-sized
  params    = AdamW(clip(g_params))                dense, fp32 master weights
  emb       = apply_sparse_updates(plan, emb, ctx, g_rows, lr=sparse_lr(step))

Gradient accumulation: the embedding exchange runs once for the whole batch;
the dense model runs `grad_accum` micro-batches in a `lax.scan` (activation
memory / grad_accum), each contributing `loss_i * n_i / n` where n_i counts its
observed labels, so the accumulated gradient equals the full-batch gradient of
the masked mean loss. Micro-batch i takes rows i, i+k, i+2k, ... so every
device keeps its own rows (no resharding).

Precision: params fp32; the model computes in its configured dtype (bf16 on
GPU; on CPU per config: bf16 for the peer configs, fp32 for the small GEM), fp8
and remat switches live in the model config; logits, loss and all gradients are fp32.

Metrics come back as device scalars (no host sync); the loop reads them at
log cadence.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from gem_jax import embedding as emb_lib
from gem_jax.data.spec import DataSpec
from gem_jax.layers import heads
from gem_jax.parallel import sharding
from gem_jax.train.state import TrainState


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """Static things the step closes over (no arrays).

  Args:
    graphdef: the model's nnx.GraphDef.
    plan: the embedding plan.
    tx: dense optax optimizer; `schedule` its lr schedule (for the metrics).
    sparse_lr: step -> embedding learning rate.
    spec: the DataSpec (which features are pooled / sequence items).
    grad_accum: micro-batches per step.
  """
  graphdef: Any
  plan: Any
  tx: optax.GradientTransformation
  schedule: Callable
  sparse_lr: Callable
  spec: DataSpec
  grad_accum: int = 1


def model_inputs(spec: DataSpec, batch: dict, emb: dict) -> dict:
  """The model's input dict (see the model contract) from a batch and its embeddings."""
  seq = {}
  for s in spec.sequences:
    sb = batch["seq"][s.name]
    positions = jnp.arange(s.max_len, dtype=jnp.int32)[None, :]  # (1, L)
    seq[s.name] = {
        "items": {f: emb[f] for f in s.item_features},  # (B, L, D_f)
        "action": sb["action"], "surface": sb["surface"], "dt": sb["dt"],
        "mask": positions < sb["len"][:, None],  # (B, L)
    }
  return {
      "dense": batch["dense"],  # (B, n_dense)
      "sparse": {f.name: emb[f.name] for f in spec.pooled_features},  # (B, D_f)
      "seq": seq,
      "domain": batch["domain"],  # (B,)
  }


def global_norm(tree) -> jax.Array:
  """sqrt(sum_i ||x_i||^2) over the leaves, fp32 (optax.global_norm is deprecated)."""
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def loss_fn(params, emb, batch, model_state, graphdef, spec):
  """Masked multi-task BCE of the model on one (micro-)batch; aux = logits (B, T)."""
  model = nnx.merge(graphdef, params, model_state)
  logits = model(model_inputs(spec, batch, emb)).astype(jnp.float32)  # (B, T)
  loss = heads.masked_multitask_bce(logits, batch["labels"], batch["label_mask"],
                                    domain=batch["domain"])
  return loss, logits


def _dense_part(batch: dict) -> dict:
  """The batch without ids/weights (those went through the embedding exchange)."""
  return {k: v for k, v in batch.items() if k not in ("ids", "weights")}


def _to_micro(x, k):
  """(B, ...) -> (k, B/k, ...): micro-batch i holds rows i, i+k, ... (no resharding)."""
  return jnp.swapaxes(x.reshape((x.shape[0] // k, k) + x.shape[1:]), 0, 1)


def _from_micro(x, k):
  """Inverse of `_to_micro`: (k, B/k, ...) -> (B, ...)."""
  x = jnp.swapaxes(x, 0, 1)
  return x.reshape((x.shape[0] * k,) + x.shape[2:])


def dense_grads(params, emb, batch, model_state, graphdef, spec, grad_accum: int):
  """(loss, g_params, g_emb) of the masked mean loss, over `grad_accum` micro-batches."""
  grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)
  if grad_accum == 1:
    (loss, _), (g_params, g_emb) = grad_fn(params, emb, batch, model_state, graphdef, spec)
    return loss, g_params, g_emb
  k = grad_accum
  n_total = jnp.maximum(jnp.sum(batch["label_mask"]), 1.0)
  micro = jax.tree.map(lambda x: _to_micro(x, k), (emb, batch))

  def body(acc, xs):
    emb_i, batch_i = xs
    w_i = jnp.sum(batch_i["label_mask"]) / n_total  # share of observed labels
    (loss_i, _), (g_p, g_e) = grad_fn(params, emb_i, batch_i, model_state, graphdef, spec)
    loss_acc, gp_acc = acc
    gp_acc = jax.tree.map(lambda a, g: a + w_i * g, gp_acc, g_p)
    return (loss_acc + w_i * loss_i, gp_acc), jax.tree.map(lambda g: w_i * g, g_e)

  zeros = jax.tree.map(jnp.zeros_like, params)
  (loss, g_params), g_emb = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), micro)
  return loss, g_params, jax.tree.map(lambda g: _from_micro(g, k), g_emb)


def train_step(state: TrainState, batch: dict, *, cfg: StepConfig,
               skip_nonfinite: bool = False) -> tuple[TrainState, dict]:
  """One optimizer step on a global batch. Pure; jit with donate_argnums=0.

  skip_nonfinite: when the loss or the dense gradient norm is not finite, keep
  the dense params and optimizer state (a select over dense-sized arrays) and
  turn the sparse update into a no-op (no table-sized select: the tables stay
  updated in place).
  """
  plan = cfg.plan
  rows, ctx = emb_lib.gather_rows(plan, state.emb, batch["ids"])
  emb, pool_vjp = jax.vjp(lambda r: emb_lib.pool_rows(plan, r, ctx, batch.get("weights")), rows)
  with sharding.activation_sharding(plan.mesh):
    loss, g_params, g_emb = dense_grads(state.params, emb, _dense_part(batch), state.model_state,
                                        cfg.graphdef, cfg.spec, cfg.grad_accum)
  (g_rows,) = pool_vjp(g_emb)

  grad_norm = global_norm(g_params)
  ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm) if skip_nonfinite else None

  updates, opt_state = cfg.tx.update(g_params, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  if skip_nonfinite:
    keep = lambda new, old: jnp.where(ok, new, old)  # noqa: E731
    params = jax.tree.map(keep, params, state.params)
    opt_state = jax.tree.map(keep, opt_state, state.opt_state)
  sparse_lr = cfg.sparse_lr(state.step)
  new_emb = emb_lib.apply_sparse_updates(plan, state.emb, ctx, g_rows, lr=sparse_lr, enabled=ok)
  rng, _ = jax.random.split(jax.random.wrap_key_data(state.rng))

  metrics = {
      "train_loss": loss,
      "grad_norm": grad_norm,
      "lr": jnp.asarray(cfg.schedule(state.step), jnp.float32),
      "sparse_lr": jnp.asarray(sparse_lr, jnp.float32),
      "labels_observed": jnp.sum(batch["label_mask"]),
  }
  new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state, emb=new_emb,
                            rng=jax.random.key_data(rng))
  return new_state, metrics


def jit_train_step(cfg: StepConfig, state_shardings: TrainState, batch_shardings: dict):
  """`train_step` jitted once: explicit in/out shardings, the state donated."""
  rep = jax.sharding.NamedSharding(state_shardings.rng.mesh, jax.sharding.PartitionSpec())
  metric_sh = {k: rep for k in ("train_loss", "grad_norm", "lr", "sparse_lr", "labels_observed")}
  return jax.jit(lambda s, b: train_step(s, b, cfg=cfg),
                 in_shardings=(state_shardings, batch_shardings),
                 out_shardings=(state_shardings, metric_sh),
                 donate_argnums=0)
