"""The student train and eval steps: pure functions over the trainer's `TrainState`.

Per step, for a global batch B (raw features + `batch['teacher']` knowledge):

  e               = pool_rows(plan, gather_rows(plan, emb, ids))      as in train/step.py
  inputs          = model_inputs(batch, e) [+ teacher_emb = knowledge[field]]
  s               = student(inputs)                                    (B, T)
  z~              = z_T or adapter(z_T, dense, domain)                 (B, T)
  L, parts        = transfer_loss(s, y, m, z_T, z~, valid, w, T)        gem_jax.transfer.losses
  g               = dL/d(params, e); frozen params: g = 0 and update = 0
  params, emb     = AdamW(params, g), sparse optimizer(emb, g_rows)
  emb[frozen rows]= emb_old[frozen rows]                               bit-identical sharing

It reuses the trainer's pieces (`TrainState`, `model_inputs`, the embedding
engine's gather/pool/update, the optimizer) and adds only the transfer loss,
the extra input and the freezing, so `gem_jax/train/step.py` stays unchanged.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from gem_jax import embedding as emb_lib
from gem_jax.data.spec import DataSpec
from gem_jax.parallel import sharding
from gem_jax.train import metrics as metrics_lib
from gem_jax.train.state import TrainState
from gem_jax.train.step import global_norm, model_inputs
from gem_jax.transfer import losses
from gem_jax.transfer.student import TransferOptions, apply_mask

METRICS = ("train_loss", "loss_hard", "loss_soft", "loss_adapt", "grad_norm", "lr")


@dataclasses.dataclass(frozen=True)
class StudentStepConfig:
  """Static things the student step closes over.

  Args:
    graphdef: StudentBundle's nnx.GraphDef.
    plan: the student's embedding plan.
    tx, schedule, sparse_lr: dense optimizer, its schedule, embedding lr schedule.
    spec: the DataSpec.
    opts: the TransferOptions.
    trainable: params-shaped pytree of Python bools (`student.trainable_mask`).
    frozen_rows: {buffer: ((start, stop), ...)} of frozen tables.
  """
  graphdef: Any
  plan: Any
  tx: optax.GradientTransformation
  schedule: Callable
  sparse_lr: Callable
  spec: DataSpec
  opts: TransferOptions
  trainable: Any
  frozen_rows: Mapping[str, tuple] = dataclasses.field(default_factory=dict)


def student_inputs(spec: DataSpec, batch: dict, emb: dict, opts: TransferOptions) -> dict:
  """The Student's inputs: the model contract plus `teacher_emb` when configured."""
  inputs = model_inputs(spec, batch, emb)
  if opts.teacher_emb:
    inputs["teacher_emb"] = batch["teacher"][opts.teacher_emb]  # (B, D_t)
  return inputs


def loss_fn(params, emb, batch, model_state, graphdef, spec, opts: TransferOptions):
  """(L, parts) of the student (and adapter) on one batch."""
  model = nnx.merge(graphdef, params, model_state)
  s = model.student(student_inputs(spec, batch, emb, opts)).astype(jnp.float32)  # (B, T)
  if not opts.uses_teacher_logits:
    return losses.transfer_loss(s, batch["labels"], batch["label_mask"])
  kn = batch["teacher"]
  zt = kn["logits"].astype(jnp.float32)  # (B, T)
  za = model.adapter(zt, batch["dense"], batch["domain"]) if opts.adapter else None
  return losses.transfer_loss(
      s, batch["labels"], batch["label_mask"], teacher_logits=zt, adapted_logits=za,
      valid=kn["valid"], task_weights=jnp.asarray(opts.distill_weights, jnp.float32),
      temperature=opts.temperature)


def student_train_step(state: TrainState, batch: dict, *, cfg: StudentStepConfig
                       ) -> tuple[TrainState, dict]:
  """One optimizer step of the student run. Pure; jit with donate_argnums=0."""
  plan = cfg.plan
  rows, ctx = emb_lib.gather_rows(plan, state.emb, batch["ids"])
  emb, pool_vjp = jax.vjp(lambda r: emb_lib.pool_rows(plan, r, ctx, batch.get("weights")), rows)
  dense = {k: v for k, v in batch.items() if k not in ("ids", "weights")}
  grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)
  with sharding.activation_sharding(plan.mesh):
    (loss, parts), (g_params, g_emb) = grad_fn(state.params, emb, dense, state.model_state,
                                               cfg.graphdef, cfg.spec, cfg.opts)
  g_params = apply_mask(g_params, cfg.trainable)
  updates, opt_state = cfg.tx.update(g_params, state.opt_state, state.params)
  params = optax.apply_updates(state.params, apply_mask(updates, cfg.trainable))
  if not cfg.opts.train_student:
    new_emb = state.emb  # adapter-only: the student's tables are frozen too
  else:
    (g_rows,) = pool_vjp(g_emb)
    new_emb = emb_lib.apply_sparse_updates(plan, state.emb, ctx, g_rows,
                                           lr=cfg.sparse_lr(state.step), frozen=cfg.frozen_rows)
  metrics = {"train_loss": loss, "loss_hard": parts["hard"], "loss_soft": parts["soft"],
             "loss_adapt": parts["adapt"], "grad_norm": global_norm(g_params),
             "lr": jnp.asarray(cfg.schedule(state.step), jnp.float32)}
  new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state, emb=new_emb)
  return new_state, metrics


def jit_student_train_step(cfg: StudentStepConfig, state_shardings: TrainState,
                           batch_shardings: dict):
  """`student_train_step` jitted once with explicit shardings, the state donated."""
  rep = jax.sharding.NamedSharding(state_shardings.rng.mesh, jax.sharding.PartitionSpec())
  return jax.jit(functools.partial(student_train_step, cfg=cfg),
                 in_shardings=(state_shardings, batch_shardings),
                 out_shardings=(state_shardings, {k: rep for k in METRICS}),
                 donate_argnums=0)


def student_eval_step(state: TrainState, batch: dict, *, cfg: StudentStepConfig) -> dict:
  """The metric accumulators after adding the student's predictions on `batch`."""
  emb = emb_lib.lookup(cfg.plan, state.emb, batch["ids"], batch.get("weights"))
  model = nnx.merge(cfg.graphdef, state.params, state.model_state)
  logits = model.student(student_inputs(cfg.spec, batch, emb, cfg.opts)).astype(jnp.float32)
  return metrics_lib.update(state.metrics, logits, batch["labels"], batch["label_mask"],
                            batch["domain"])


def jit_student_eval_step(cfg: StudentStepConfig, state_shardings: TrainState,
                          batch_shardings: dict):
  return jax.jit(functools.partial(student_eval_step, cfg=cfg),
                 in_shardings=(state_shardings, batch_shardings),
                 out_shardings=state_shardings.metrics)


def adapter_eval_logits(state: TrainState, batch: dict, *, cfg: StudentStepConfig) -> jax.Array:
  """The adapted teacher logits z~ (B, T) of a batch (diagnostics: how good is the target)."""
  model = nnx.merge(cfg.graphdef, state.params, state.model_state)
  zt = batch["teacher"]["logits"].astype(jnp.float32)
  return model.adapter(zt, batch["dense"], batch["domain"]) if cfg.opts.adapter else zt
