"""Dense optimizer and learning-rate schedules.

Default: AdamW with linear warm-up then cosine decay, after global-norm
clipping:

  g <- g * min(1, clip_norm / ||g||_2)                 (over all dense params)
  lr(t) = lr * t / warmup                     t < warmup
        = lr * (f + (1 - f) * (1 + cos(pi * (t - warmup) / (T - warmup))) / 2)
                                              otherwise  (f = final_lr_fraction)
  AdamW(lr(t), b1, b2, eps, weight_decay)

The sparse (embedding) optimizer is the embedding engine's; it gets the same
warm-up shape through `sparse_lr_schedule` so early huge row updates do not
blow up freshly initialised rows.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax


def lr_schedule(lr: float, steps: int, warmup_steps: int = 0, decay: str = "cosine",
                final_lr_fraction: float = 0.1) -> optax.Schedule:
  """Warm-up (linear from 0) then 'cosine' (to final_lr_fraction * lr) or 'constant'."""
  warmup_steps = max(0, min(int(warmup_steps), max(int(steps) - 1, 0)))
  if decay == "cosine":
    after = optax.cosine_decay_schedule(lr, max(int(steps) - warmup_steps, 1),
                                        alpha=final_lr_fraction)
  elif decay == "constant":
    after = optax.constant_schedule(lr)
  else:
    raise ValueError(f"optim.decay={decay!r}: expected 'cosine' or 'constant'")
  if warmup_steps == 0:
    return after
  warm = optax.linear_schedule(0.0, lr, warmup_steps)
  return optax.join_schedules([warm, after], [warmup_steps])


def global_norm(tree) -> jax.Array:
  """sqrt(sum_i ||x_i||^2) over the leaves, fp32 (optax.global_norm is deprecated)."""
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
  """g <- g * min(1, max_norm / ||g||_2): optax's clip, in one pass less over memory.

  The same state (`optax.EmptyState`, so checkpoints do not change) and values to a few ulp:
  optax selects g or (g / ||g||) * max_norm, and XLA writes that clipped copy out
  because its division is too dear to repeat in both Adam moments' fusions; a
  multiply by one scalar is repeated instead, so each moment reads g directly.
  `medium`'s 172 M dense parameters, clip + AdamW alone on one CPU device: 349 ->
  218 ms (docs/PERFORMANCE.md). The norm is `global_norm`, the step's own
  `grad_norm` metric: XLA computes it once (the same reductions with or without the metric).
  """
  def update(updates, state, params=None):
    del params
    scale = jnp.minimum(1.0, max_norm / global_norm(updates))  # ||g|| = 0: 1; NaN: NaN
    return jax.tree.map(lambda g: g * scale.astype(g.dtype), updates), state
  return optax.GradientTransformation(optax.init_empty_state, update)


def make_optimizer(name: str = "adamw", *, lr: float, steps: int, warmup_steps: int = 0,
                   decay: str = "cosine", weight_decay: float = 0.0,
                   clip_norm: float | None = 1.0, b1: float = 0.9, b2: float = 0.999,
                   eps: float = 1e-8) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """The dense optimizer and its schedule.

  Args:
    name: 'adamw', 'sgd' or 'adagrad'.
    lr, steps, warmup_steps, decay: see `lr_schedule`.
    weight_decay: decoupled weight decay (AdamW only).
    clip_norm: global-norm clip (None or <= 0: off).
  """
  schedule = lr_schedule(lr, steps, warmup_steps, decay)
  if name == "adamw":
    opt = optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
  elif name == "sgd":
    opt = optax.sgd(schedule)
  elif name == "adagrad":
    opt = optax.adagrad(schedule)
  else:
    raise ValueError(f"optim.name={name!r}: expected 'adamw', 'sgd' or 'adagrad'")
  if clip_norm:
    opt = optax.chain(clip_by_global_norm(clip_norm), opt)
  return opt, schedule


def sparse_lr_schedule(lr: float, warmup_steps: int = 0) -> Callable:
  """Embedding lr: linear warm-up to `lr`, then constant (Adagrad decays by itself)."""
  def schedule(step):
    if warmup_steps <= 0:
      return jnp.asarray(lr, jnp.float32)
    return lr * jnp.minimum(1.0, (step.astype(jnp.float32) + 1.0) / warmup_steps)
  return schedule


def optimizer_from_config(optim_cfg, steps: int):
  """`make_optimizer` from the `optim` block of a run config."""
  return make_optimizer(
      optim_cfg.name, lr=optim_cfg.lr, steps=steps, warmup_steps=optim_cfg.warmup_steps,
      decay=optim_cfg.decay, weight_decay=optim_cfg.weight_decay,
      clip_norm=optim_cfg.clip_norm)
