"""The train step: one pure function `(state, batch) -> (state, metrics)`.

Per step, for a global batch B split over ('replica', 'shard'):

  rows, ctx = gather_rows(plan, emb, ids)          ids -> owner shards -> local rows
  e         = pool_rows(plan, rows, ctx, w)        {feature: (B, D) | (B, L, D)}
  loss      = sum of loss_fn's terms (default: masked BCE(model(inputs(batch, e)), labels))
  g_params, g_e = d loss / d (params, e)           (micro-batched if grad_accum > 1)
  g_rows    = pool_vjp(g_e)                        row gradients, never table-sized
  params    = AdamW(clip(g_params))                dense, fp32 master weights
  emb       = apply_sparse_updates(plan, emb, ctx, g_rows, lr=sparse_lr(step))

Managed-collision tables (id_policy='managed') map their raw ids to rows first
(`embedding.managed.resolve`: the maps, held in `emb`, are updated in the step); their
counters come back as `mc_*` metrics. A step the non-finite guard skips still records
its ids in the maps (their rows are fresh then, a valid state).

The same step trains the knowledge-transfer student (gem_jax/transfer/step.py):
its own `loss_fn` (distillation terms), a `trainable` mask (frozen dense blocks:
zero gradients and updates) and `frozen` embedding rows. `skip_nonfinite=True`
is the non-finite guard (gem_jax/train/nonfinite.py).

Gradient accumulation: the embedding exchange runs once for the whole batch;
the dense model runs `grad_accum` micro-batches in a `lax.scan` (activation
memory / grad_accum), each term contributing `loss_i * n_i / n` where n_i counts
its items (observed labels for BCE, see `Loss`), so the accumulated gradient
equals the full-batch gradient of the masked mean loss. Micro-batch i takes rows i, i+k, i+2k, ... so every
device keeps its own rows (no resharding).

Precision: params fp32; the model computes in its configured dtype (bf16 on
GPU; on CPU per config: bf16 for the peer configs, fp32 for the small GEM), fp8
and remat switches live in the model config; logits, loss and all gradients are fp32.

Metrics come back as device scalars (no host sync); the loop reads them at
log cadence.
"""
from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from gem_jax import embedding as emb_lib
from gem_jax.data.spec import DataSpec
from gem_jax.layers import dense, heads
from gem_jax.parallel import sharding
from gem_jax.train import nonfinite
from gem_jax.train.optim import global_norm
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
    grad_reduce_dtype: dtype of the dense weight gradients' cross-device reductions
      (`loss_grads`); None: fp32.
  """
  graphdef: Any
  plan: Any
  tx: optax.GradientTransformation
  schedule: Callable
  sparse_lr: Callable
  spec: DataSpec
  grad_accum: int = 1
  grad_reduce_dtype: Any = None


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


def forward(model, spec: DataSpec, batch: dict, emb: dict) -> jax.Array:
  """The model's logits (B, T) in fp32: the trainer's forward (eval and the BCE loss)."""
  return model(model_inputs(spec, batch, emb)).astype(jnp.float32)


class Loss(NamedTuple):
  """A training loss: a sum of terms, each a mean over some items of the batch.

    terms(params, emb, batch, model_state, graphdef, spec) -> {name: fp32 scalar}
    counts(batch) -> {name: items the term averages over (its denominator, before max(1, .))}

  The step minimises the sum of the terms. Under grad_accum, micro-batch i's term
  t counts counts_i[t] / max(1, counts[t]) (counts of the whole batch), so the
  accumulated gradient is the full-batch one for terms of the form sum / max(1, count).
  """
  terms: Callable
  counts: Callable


def _bce_terms(params, emb, batch, model_state, graphdef, spec):
  model = nnx.merge(graphdef, params, model_state)
  logits = forward(model, spec, batch, emb)  # (B, T)
  return {"bce": heads.masked_multitask_bce(logits, batch["labels"], batch["label_mask"],
                                            domain=batch["domain"])}


# The trainer's loss: masked multi-task BCE over the observed labels.
BCE = Loss(_bce_terms, lambda batch: {"bce": jnp.sum(batch["label_mask"])})


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


def _total(terms: dict) -> jax.Array:
  return functools.reduce(operator.add, terms.values())


def loss_grads(params, emb, batch, model_state, graphdef, spec, grad_accum: int,
               loss: Loss = BCE, reduce_dtype=None):
  """(loss, terms, g_params, g_emb) of `loss` (the sum of its terms), over `grad_accum`
  micro-batches.

  Accumulating on a mesh with replicas (R > 1), each micro-batch's gradient is taken per
  replica (`vmap` over (R, B / (k R)) with spmd_axis_name='replica') into an (R, ...)
  accumulator, summed over R once after the loop: the gradients are reduced over
  'shard' per micro-batch but across replicas (between nodes) once per step, not k
  times. Same gradient; summation order differs.

  `reduce_dtype` (e.g. bf16; None: fp32): the dense weight gradients' cross-device
  reductions run in it (`dense.weight_grad_dtype`; the accumulator's sum over replicas
  too), at half the bytes of fp32 for bf16; each device's partial sum is rounded to it
  once before the reduction, and the gradient is fp32 again after it.
  """
  with dense.weight_grad_dtype(reduce_dtype):
    return _loss_grads(params, emb, batch, model_state, graphdef, spec, grad_accum, loss,
                       reduce_dtype)


def _loss_grads(params, emb, batch, model_state, graphdef, spec, grad_accum, loss,
                reduce_dtype):
  def total(p, e, b):
    t = loss.terms(p, e, b, model_state, graphdef, spec)
    return _total(t), t

  grad_fn = jax.value_and_grad(total, argnums=(0, 1), has_aux=True)
  if grad_accum == 1:
    (total_loss, terms), (g_params, g_emb) = grad_fn(params, emb, batch)
    return total_loss, terms, g_params, g_emb
  k, R = grad_accum, sharding.replicas()
  full = {n: jnp.maximum(c, 1.0) for n, c in loss.counts(batch).items()}
  micro = jax.tree.map(lambda x: _to_micro(x, k), (emb, batch))   # (k, B/k, ...)

  def weighted_grads(emb_i, batch_i):
    """(weighted terms, g_params, g_emb) of one micro-batch (or one replica's part)."""
    w = {n: c / full[n] for n, c in loss.counts(batch_i).items()}  # shares of the batch's items
    if len(w) == 1:  # one term: its gradient, scaled by its share
      (_, t_i), (g_p, g_e) = grad_fn(params, emb_i, batch_i)
      (w_i,) = w.values()
      g_p, g_e = jax.tree.map(lambda g: w_i * g, (g_p, g_e))
    else:  # several: the gradient of their weighted sum
      def weighted(p, e):
        t = loss.terms(p, e, batch_i, model_state, graphdef, spec)
        return _total({n: w[n] * v for n, v in t.items()}), t
      (_, t_i), (g_p, g_e) = jax.value_and_grad(weighted, argnums=(0, 1), has_aux=True)(
          params, emb_i)
    return {n: w[n] * t_i[n] for n in w}, g_p, g_e

  if R > 1:   # (k, R, B / (k R), ...): a micro-batch's rows of replica r are contiguous
    micro = jax.tree.map(lambda x: x.reshape((k, R, x.shape[1] // R) + x.shape[2:]), micro)

    def step_grads(emb_i, batch_i):
      with sharding.per_replica():
        wt, g_p, g_e = jax.vmap(weighted_grads, spmd_axis_name="replica")(emb_i, batch_i)
      return {n: jnp.sum(v) for n, v in wt.items()}, g_p, g_e   # g_p: (R, ...) per replica
  else:
    step_grads = weighted_grads

  def body(acc, xs):
    wt, g_p, g_e = step_grads(*xs)
    terms_acc, gp_acc = acc
    terms_acc = {n: terms_acc[n] + wt[n] for n in terms_acc}
    return (terms_acc, jax.tree.map(operator.add, gp_acc, g_p)), g_e

  zeros = (jax.tree.map(lambda _: jnp.zeros((), jnp.float32), full),
           jax.tree.map(lambda p: jnp.zeros(((R,) if R > 1 else ()) + p.shape, p.dtype), params))
  (terms, g_params), g_emb = jax.lax.scan(body, zeros, micro)
  if R > 1:   # across replicas, once (lax.reduce: jnp.sum would sum bf16 in fp32)
    rd = jnp.dtype(reduce_dtype or jnp.float32)
    g_params = jax.tree.map(lambda g: jax.lax.reduce(g.astype(rd), jnp.zeros((), rd),
                                                     jax.lax.add, (0,)).astype(g.dtype),
                            g_params)
    g_emb = jax.tree.map(lambda g: g.reshape((k, -1) + g.shape[3:]), g_emb)
  return _total(terms), terms, g_params, jax.tree.map(lambda g: _from_micro(g, k), g_emb)


def dense_grads(params, emb, batch, model_state, graphdef, spec, grad_accum: int,
                loss: Loss = BCE):
  """(loss, g_params, g_emb) of the masked mean loss, over `grad_accum` micro-batches."""
  total_loss, _, g_params, g_emb = loss_grads(params, emb, batch, model_state, graphdef, spec,
                                              grad_accum, loss)
  return total_loss, g_params, g_emb


def _masked(tree, mask):
  """Zeros the leaves of `tree` whose (static, Python bool) mask is False."""
  return jax.tree.map(lambda x, keep: x if keep else jnp.zeros_like(x), tree, mask)


def train_step(state: TrainState, batch: dict, *, cfg: StepConfig, loss_fn: Loss = BCE,
               trainable=None, frozen=None, skip_nonfinite: bool = False,
               inject_nan_step: int = 0) -> tuple[TrainState, dict]:
  """One optimizer step on a global batch. Pure; jit with donate_argnums=0.

  Args:
    state, batch: the train state and a global device batch.
    cfg: the static step config.
    loss_fn: the `Loss` (default: the trainer's masked BCE); several terms are
      reported as `loss_<name>` next to `train_loss` (their sum).
    trainable: params-shaped pytree of Python bools; False leaves get zero
      gradients and updates (None: everything trains).
    frozen: {buffer: ((start, stop), ...)} embedding rows kept bit for bit (a
      buffer frozen whole is not updated at all); None: none.
    skip_nonfinite: the non-finite guard (`gem_jax.train.nonfinite`): a step
      whose loss or dense gradient norm is not finite keeps params, optimizer
      state and tables, counts itself, and flags itself in the metrics.
    inject_nan_step: debug: the 1-based step whose batch gets NaN dense features.
  """
  plan = cfg.plan
  if inject_nan_step:
    batch = nonfinite.inject_nan(batch, state.step + 1 == inject_nan_step)
  # Managed tables: raw ids -> rows through their maps (updated, new rows re-initialised).
  emb_state, ids, mc, known = emb_lib.managed.resolve(
      plan, state.emb, batch["ids"], state.step, jax.random.wrap_key_data(state.rng),
      distinct=True)                       # their distinct rows: the lookup does not sort again
  rows, ctx = emb_lib.gather_rows(plan, emb_state, ids, known)
  emb, pool_vjp = jax.vjp(lambda r: emb_lib.pool_rows(plan, r, ctx, batch.get("weights")), rows)
  with sharding.activation_sharding(plan.mesh):
    loss, terms, g_params, g_emb = loss_grads(state.params, emb, _dense_part(batch),
                                              state.model_state, cfg.graphdef, cfg.spec,
                                              cfg.grad_accum, loss_fn, cfg.grad_reduce_dtype)
  (g_rows,) = pool_vjp(g_emb)
  if trainable is not None:
    g_params = _masked(g_params, trainable)

  grad_norm = global_norm(g_params)
  flags = nonfinite.flags(loss, grad_norm) if skip_nonfinite else None
  ok = None if flags is None else ~(flags[0] | flags[1])

  updates, opt_state = cfg.tx.update(g_params, state.opt_state, state.params)
  if trainable is not None:
    updates = _masked(updates, trainable)
  params = optax.apply_updates(state.params, updates)
  if skip_nonfinite:
    params, opt_state = nonfinite.keep_if(ok, (params, opt_state), (state.params, state.opt_state))
    opt_state = nonfinite.count_skipped(opt_state, ~ok)
  sparse_lr = cfg.sparse_lr(state.step)
  new_emb = emb_lib.apply_sparse_updates(plan, emb_state, ctx, g_rows, lr=sparse_lr, enabled=ok,
                                         frozen=frozen)
  rng, _ = jax.random.split(jax.random.wrap_key_data(state.rng))

  metrics = {
      "train_loss": loss,
      **({f"loss_{n}": v for n, v in terms.items()} if len(terms) > 1 else {}),
      "grad_norm": grad_norm,
      "lr": jnp.asarray(cfg.schedule(state.step), jnp.float32),
      "sparse_lr": jnp.asarray(sparse_lr, jnp.float32),
      "labels_observed": jnp.sum(batch["label_mask"]),
  }
  metrics.update(emb_lib.managed.step_metrics(plan, mc))
  if skip_nonfinite:
    metrics = nonfinite.flagged_metrics(metrics, *flags)
  new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state, emb=new_emb,
                            rng=jax.random.key_data(rng))
  return new_state, metrics


def jit_train_step(cfg: StepConfig, state_shardings: TrainState, batch_shardings: dict,
                   **step_kwargs):
  """`train_step(..., **step_kwargs)` jitted once: explicit in/out shardings, the state
  donated, every metric the step returns replicated."""
  rep = jax.sharding.NamedSharding(state_shardings.rng.mesh, jax.sharding.PartitionSpec())
  return jax.jit(functools.partial(train_step, cfg=cfg, **step_kwargs),
                 in_shardings=(state_shardings, batch_shardings),
                 out_shardings=(state_shardings, rep),
                 donate_argnums=0)
