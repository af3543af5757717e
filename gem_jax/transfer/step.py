"""The student train and eval steps: the trainer's steps with the student's loss, masks
and forward (no step of its own).

  train: train.step.train_step(state, batch, cfg=step_cfg, loss_fn=student_loss(opts),
                               trainable=trainable_mask, frozen=frozen rows,
                               skip_nonfinite=True)
  eval:  train.evaluate.eval_step(state, batch, cfg=eval_cfg, forward=student_forward(opts))

so the student gets everything the trainer's step does (RNG advance, the
non-finite guard, grad_accum, activation pinning). What is the student's:

  inputs          = model_inputs(batch, e) [+ teacher_emb = knowledge[field]]
  s               = student(inputs)                                    (B, T)
  z~              = z_T or adapter(z_T, dense, domain)                 (B, T)
  terms           = transfer_loss(s, y, m, z_T, z~, valid, w, T)        gem_jax.transfer.losses
                    {hard: over observed labels, soft: over valid rows, adapt: over labels}
  frozen params   (trainable False): gradient and update 0
  frozen tables   rows kept bit for bit by the sparse update; adapter-only runs
                  (train_student=False) freeze every buffer whole (no sparse update)
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from gem_jax.data.spec import DataSpec
from gem_jax.train import evaluate as eval_lib
from gem_jax.train import step as step_lib
from gem_jax.train.state import TrainState
from gem_jax.train.step import model_inputs
from gem_jax.transfer import losses
from gem_jax.transfer.student import TransferOptions


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
    grad_accum: micro-batches per step.
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
  grad_accum: int = 1

  @property
  def step_cfg(self) -> step_lib.StepConfig:
    """The trainer's StepConfig of this student."""
    return step_lib.StepConfig(self.graphdef, self.plan, self.tx, self.schedule, self.sparse_lr,
                               self.spec, self.grad_accum)

  @property
  def frozen(self) -> dict:
    """The `frozen` rows of the step: every buffer whole when only the adapter trains."""
    if not self.opts.train_student:
      return {name: ((0, buf.rows),) for name, buf in self.plan.buffers.items()}
    return dict(self.frozen_rows)

  def train_kwargs(self) -> dict:
    """`train_step`'s keyword arguments for the student (loss, masks, the guard)."""
    return dict(loss_fn=student_loss(self.opts), trainable=self.trainable, frozen=self.frozen,
                skip_nonfinite=True)

  def eval_kwargs(self) -> dict:
    """`eval_step`'s keyword arguments for the student (its forward)."""
    return dict(forward=student_forward(self.opts))


def student_inputs(spec: DataSpec, batch: dict, emb: dict, opts: TransferOptions) -> dict:
  """The Student's inputs: the model contract plus `teacher_emb` when configured."""
  inputs = model_inputs(spec, batch, emb)
  if opts.teacher_emb:
    inputs["teacher_emb"] = batch["teacher"][opts.teacher_emb]  # (B, D_t)
  return inputs


def student_forward(opts: TransferOptions) -> Callable:
  """forward(model, spec, batch, emb) -> the student's logits (B, T) (for `eval_step`)."""
  def forward(model, spec, batch, emb):
    return model.student(student_inputs(spec, batch, emb, opts)).astype(jnp.float32)
  return forward


def loss_fn(params, emb, batch, model_state, graphdef, spec, opts: TransferOptions):
  """(L, parts) of the student (and adapter) on one batch."""
  model = nnx.merge(graphdef, params, model_state)
  s = student_forward(opts)(model, spec, batch, emb)  # (B, T)
  if not opts.uses_teacher_logits:
    return losses.transfer_loss(s, batch["labels"], batch["label_mask"])
  kn = batch["teacher"]
  zt = kn["logits"].astype(jnp.float32)  # (B, T)
  za = model.adapter(zt, batch["dense"], batch["domain"]) if opts.adapter else None
  return losses.transfer_loss(
      s, batch["labels"], batch["label_mask"], teacher_logits=zt, adapted_logits=za,
      valid=kn["valid"], task_weights=jnp.asarray(opts.distill_weights, jnp.float32),
      temperature=opts.temperature)


def student_loss(opts: TransferOptions) -> step_lib.Loss:
  """The student's `Loss`: terms hard / soft / adapt (reported as loss_hard, ...)."""
  def terms(params, emb, batch, model_state, graphdef, spec):
    return loss_fn(params, emb, batch, model_state, graphdef, spec, opts)[1]

  def counts(batch):
    m = jnp.sum(batch["label_mask"])
    v = jnp.sum(batch["teacher"]["valid"]) if opts.uses_teacher_logits else m
    return {"hard": m, "soft": v, "adapt": m}
  return step_lib.Loss(terms, counts)


def student_train_step(state: TrainState, batch: dict, *, cfg: StudentStepConfig
                       ) -> tuple[TrainState, dict]:
  """One optimizer step of the student run: the trainer's step. Pure; donate the state."""
  return step_lib.train_step(state, batch, cfg=cfg.step_cfg, **cfg.train_kwargs())


def jit_student_train_step(cfg: StudentStepConfig, state_shardings: TrainState,
                           batch_shardings: dict):
  """The trainer's jitted step with the student's loss and masks."""
  return step_lib.jit_train_step(cfg.step_cfg, state_shardings, batch_shardings,
                                 **cfg.train_kwargs())


def student_eval_step(state: TrainState, batch: dict, *, cfg: StudentStepConfig) -> dict:
  """The metric accumulators after adding the student's predictions on `batch`."""
  return eval_lib.eval_step(state, batch, cfg=cfg.step_cfg, **cfg.eval_kwargs())


def jit_student_eval_step(cfg: StudentStepConfig, state_shardings: TrainState,
                          batch_shardings: dict):
  """The trainer's jitted eval step with the student's forward."""
  return eval_lib.jit_eval_step(cfg.step_cfg, state_shardings, batch_shardings,
                                **cfg.eval_kwargs())


def adapter_eval_logits(state: TrainState, batch: dict, *, cfg: StudentStepConfig) -> jax.Array:
  """The adapted teacher logits z~ (B, T) of a batch (diagnostics: how good is the target)."""
  model = nnx.merge(cfg.graphdef, state.params, state.model_state)
  zt = batch["teacher"]["logits"].astype(jnp.float32)
  return model.adapter(zt, batch["dense"], batch["domain"]) if cfg.opts.adapter else zt
