"""Student Adapter and the distillation loss of knowledge transfer (GEM.md §3.5 [proposal]).

The adapter corrects (stale, other-domain) teacher logits with a small model
trained on the freshest labels, before they supervise a student:

  logit_adapt = a[domain] * logit_T + c[domain] + MLP([logit_T ; x_small])

a starts at 1, c at 0 and the MLP's last layer at 0, so an untrained adapter
is the identity on the teacher logits. The student is then trained with

  L = BCE_masked(y, s) + lambda * mean_{b,t} BCE(sigmoid(stop_grad(logit_adapt)), s).
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from gem_jax.layers.dense import param
from gem_jax.layers.heads import masked_multitask_bce
from gem_jax.layers.mlp import MLP

Dtype = Any


class StudentAdapter(nnx.Module):
  """(teacher_logits (B, T), x_small (B, F), domain (B,)) -> adapted logits (B, T) fp32.

  Args:
    num_tasks: T.  in_features: F, width of the small side features (0 = none).
    num_domains: number of domains (ids clipped to range).
    hidden: hidden widths of the correction MLP (ReLU).
  """

  def __init__(self, num_tasks: int, in_features: int = 0, num_domains: int = 1, *,
               hidden: Sequence[int] = (32,), rngs: nnx.Rngs, dtype: Dtype = jnp.float32,
               param_dtype: Dtype = jnp.float32):
    self.num_domains, self.dtype = num_domains, dtype
    self.scale = param(rngs, nnx.initializers.ones_init(), (num_domains, num_tasks),
                       param_dtype, ("domains", None))
    self.shift = param(rngs, nnx.initializers.zeros_init(), (num_domains, num_tasks),
                       param_dtype, ("domains", None))
    self.mlp = MLP(num_tasks + in_features, tuple(hidden) + (num_tasks,), rngs=rngs,
                   dtype=dtype, param_dtype=param_dtype, in_axis=None, out_axis=None,
                   last_kernel_init=nnx.initializers.zeros_init())

  def __call__(self, teacher_logits: jax.Array, x_small: jax.Array | None = None,
               domain: jax.Array | None = None) -> jax.Array:
    zt = teacher_logits.astype(jnp.float32)  # (B, T)
    if domain is None:
      domain = jnp.zeros(zt.shape[:1], jnp.int32)
    domain = jnp.clip(domain.astype(jnp.int32), 0, self.num_domains - 1)
    a = jnp.take(self.scale[...], domain, axis=0).astype(jnp.float32)  # (B, T)
    c = jnp.take(self.shift[...], domain, axis=0).astype(jnp.float32)  # (B, T)
    feats = zt if x_small is None else jnp.concatenate(
        [zt, x_small.astype(jnp.float32)], axis=-1)  # (B, T + F)
    return a * zt + c + self.mlp(feats).astype(jnp.float32)  # (B, T)


def distillation_loss(student_logits: jax.Array, labels: jax.Array, label_mask: jax.Array,
                      soft_logits: jax.Array, lam: float = 1.0, **bce_kwargs) -> jax.Array:
  """BCE_masked(y, s) + lam * mean BCE(sigmoid(stop_grad(soft_logits)), s)  (fp32 scalar).

  soft_logits are the (adapted) teacher logits; they are soft labels on every
  (example, task), observed or not. `bce_kwargs` go to `masked_multitask_bce`.
  """
  s = student_logits.astype(jnp.float32)
  hard = masked_multitask_bce(s, labels, label_mask, **bce_kwargs)
  p = jax.nn.sigmoid(jax.lax.stop_gradient(soft_logits.astype(jnp.float32)))
  soft = jnp.mean(optax.sigmoid_binary_cross_entropy(s, p))
  return hard + lam * soft
