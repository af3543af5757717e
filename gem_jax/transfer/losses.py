"""Student losses of knowledge transfer (GEM.md §3.5).

With s the student logits, z the teacher logits, y/m the fresh labels and their
mask, v the valid-row mask of the knowledge (0 on padding rows), T the
temperature and w_t the per-task distillation weights:

  soft target   z~ = z                                  plain distillation
                z~ = a[d] z + c[d] + MLP([z ; x_small])  Student Adapter (adapted teacher)
  L_hard  = sum_{b,t} m_bt BCE(s_bt, y_bt) / sum m
  L_soft  = T^2 sum_{b,t} v_b w_t BCE(s_bt / T, sigmoid(sg(z~_bt) / T)) / sum_b v_b
  L_adapt = sum_{b,t} m_bt BCE(z~_bt, y_bt) / sum m      (trains the adapter only)
  L = L_hard + L_soft + L_adapt

sg = stop-gradient: the adapter learns only from the fresh labels, the student
only follows the adapted teacher (for T = 1 and w_t = lambda this is GEM.md's
BCE(y, s) + lambda BCE(sigmoid(logit_adapt), s)). The T^2 factor keeps the
soft-target gradient scale independent of T (Hinton et al.).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from gem_jax.layers.heads import masked_multitask_bce


def soft_target_loss(student_logits: jax.Array, teacher_logits: jax.Array, valid: jax.Array,
                     task_weights: jax.Array, temperature: float = 1.0) -> jax.Array:
  """T^2 sum_{b,t} v_b w_t BCE(s/T, sigmoid(sg(z)/T)) / max(1, sum v)  (fp32 scalar).

  Args:
    student_logits, teacher_logits: (B, T).
    valid: (B,) 1 for rows with knowledge, 0 for padding rows.
    task_weights: (T,) per-task weights (0 switches a task's distillation off).
    temperature: T > 0.
  """
  t = jnp.float32(temperature)
  s = student_logits.astype(jnp.float32) / t  # (B, T)
  p = jax.nn.sigmoid(jax.lax.stop_gradient(teacher_logits.astype(jnp.float32)) / t)  # (B, T)
  v = valid.astype(jnp.float32)  # (B,)
  w = jnp.asarray(task_weights, jnp.float32)  # (T,)
  bce = optax.sigmoid_binary_cross_entropy(s, p)  # (B, T)
  return t * t * jnp.sum(v[:, None] * w[None, :] * bce) / jnp.maximum(jnp.sum(v), 1.0)


def transfer_loss(student_logits: jax.Array, labels: jax.Array, label_mask: jax.Array, *,
                  teacher_logits: jax.Array | None = None, adapted_logits: jax.Array | None = None,
                  valid: jax.Array | None = None, task_weights: jax.Array | None = None,
                  temperature: float = 1.0) -> tuple[jax.Array, dict]:
  """(L, parts) with parts = {'hard', 'soft', 'adapt'} (module docstring).

  teacher_logits None: no distillation (L = L_hard). adapted_logits given: the
  soft target is the adapted teacher and L_adapt trains the adapter.
  """
  hard = masked_multitask_bce(student_logits, labels, label_mask)
  zero = jnp.zeros((), jnp.float32)
  parts = {"hard": hard, "soft": zero, "adapt": zero}
  if teacher_logits is None:
    return hard, parts
  target = teacher_logits if adapted_logits is None else adapted_logits
  if valid is None:
    valid = jnp.ones(student_logits.shape[:1], jnp.float32)
  if task_weights is None:
    task_weights = jnp.ones(student_logits.shape[1:], jnp.float32)
  parts["soft"] = soft_target_loss(student_logits, target, valid, task_weights, temperature)
  if adapted_logits is not None:
    parts["adapt"] = masked_multitask_bce(adapted_logits, labels, label_mask)
  return parts["hard"] + parts["soft"] + parts["adapt"], parts
