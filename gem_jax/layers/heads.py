"""Multi-domain multi-task heads and the masked multi-task BCE loss (GEM.md §3.4 [proposal]).

Two head kinds on a shared trunk vector h (B, H):

  'towers': one MLP tower per domain, one logit per task:
      logits[b] = Tower_{domain[b]}(h[b])                            -> (B, T)
  'mmoe':   E shared experts, a softmax gate per (domain, task), a tower per task:
      g_{b,t} = softmax(h[b] G_{domain[b], t})                       (E,)
      z_{b,t} = sum_e g_{b,t,e} Expert_e(h[b])                       (H_e,)
      logits[b, t] = Tower_t(z_{b,t})

Per-domain (resp. per-task) weights are stacked along a leading axis and every
domain (task) is computed with one batched einsum; the example's own domain is
then selected. This spends (num_domains - 1) extra tower passes on small towers
in exchange for dense, shape-static matmuls.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from gem_jax.layers.dense import lowp_einsum, param
from gem_jax.layers.mlp import ACTIVATIONS

Dtype = Any


class GroupedMLP(nnx.Module):
  """G independent MLPs run as batched einsums: (B, G, K) or (B, K) -> (B, G, N).

  Layer j: h_{j+1}[:, g] = act(h_j[:, g] W_j[g] + b_j[g]), last layer linear
  (or `final_activation`). A (B, K) input is shared by all G groups.

  Args:
    groups: G.  in_features: K.  features: widths of every layer (last = N).
    group_axis: logical name of the group axis ('domains', 'tasks', 'experts').
  """

  def __init__(self, groups: int, in_features: int, features: Sequence[int], *,
               rngs: nnx.Rngs, activation: str = "relu", final_activation: str = "none",
               dtype: Dtype = jnp.float32, param_dtype: Dtype = jnp.float32,
               group_axis: str = "heads", zero_last: bool = False):
    self.groups, self.dtype = groups, dtype
    self.activation, self.final_activation = activation, final_activation
    dims = (in_features,) + tuple(features)
    ws, bs = [], []
    for j, (k, n) in enumerate(zip(dims[:-1], dims[1:])):
      last = j == len(features) - 1
      init = (nnx.initializers.zeros_init() if (last and zero_last)
              else nnx.initializers.normal(1.0 / math.sqrt(k)))
      ws.append(param(rngs, init, (groups, k, n), param_dtype, (group_axis, None, None)))
      bs.append(param(rngs, nnx.initializers.zeros_init(), (groups, n), param_dtype,
                      (group_axis, None)))
    self.kernels, self.biases = nnx.List(ws), nnx.List(bs)

  def __call__(self, x: jax.Array) -> jax.Array:
    act, final = ACTIVATIONS[self.activation], ACTIVATIONS[self.final_activation]
    x = x.astype(self.dtype)
    n = len(self.kernels)
    for j, (w, b) in enumerate(zip(self.kernels, self.biases)):
      w = w[...]  # (G, K, N) fp32: lowp_einsum casts it, its gradient stays fp32
      g_, k_, n_ = w.shape
      if x.ndim == 2:  # shared input: one (B, K) x (K, G N) matmul
        wk = jnp.transpose(w, (1, 0, 2)).reshape(k_, g_ * n_)
        y = lowp_einsum("bk,km->bm", x, wk, self.dtype)
        y = y.reshape(-1, g_, n_)  # (B, G, N)
      else:  # per-group 2-D matmuls (XLA:CPU lacks batched bf16 x bf16 -> f32 dots)
        y = jnp.stack([lowp_einsum("bk,kn->bn", x[:, g], w[g], self.dtype)
                       for g in range(g_)], axis=1)  # (B, G, N)
      x = (y + b[...].astype(jnp.float32)[None]).astype(self.dtype)
      x = final(x) if j == n - 1 else act(x)
    return x  # (B, G, N)


def _select(x: jax.Array, index: jax.Array) -> jax.Array:
  """x (B, G, ...) , index (B,) -> x[b, index[b]]  (B, ...)."""
  return jnp.take_along_axis(x, index.reshape((-1,) + (1,) * (x.ndim - 1)), axis=1)[:, 0]


class MultiTaskHeads(nnx.Module):
  """Logits (B, T) fp32 from a trunk vector h (B, H) and the domain id (B,).

  Args:
    in_features: H.  num_tasks: T.  num_domains: D (domain ids are clipped to [0, D)).
    kind: 'towers' (per-domain MLP towers) or 'mmoe' (module docstring).
    hidden: hidden widths of each tower.
    num_experts, expert_hidden: MMoE experts (each an MLP H -> expert_hidden, ReLU).
  """

  def __init__(self, in_features: int, num_tasks: int, num_domains: int = 1, *,
               kind: str = "towers", hidden: Sequence[int] = (64,), num_experts: int = 4,
               expert_hidden: Sequence[int] = (64,), rngs: nnx.Rngs,
               dtype: Dtype = jnp.float32, param_dtype: Dtype = jnp.float32):
    if kind not in ("towers", "mmoe"):
      raise ValueError(f"kind={kind!r}: expected 'towers' or 'mmoe'")
    self.kind, self.num_tasks, self.num_domains = kind, num_tasks, num_domains
    self.dtype = dtype
    kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    if kind == "towers":
      self.towers = GroupedMLP(num_domains, in_features, tuple(hidden) + (num_tasks,),
                               group_axis="domains", **kw)
    else:
      self.experts = GroupedMLP(num_experts, in_features, tuple(expert_hidden),
                                final_activation="relu", group_axis="experts", **kw)
      self.gates = param(rngs, nnx.initializers.zeros_init(),
                         (num_domains, in_features, num_tasks * num_experts), param_dtype,
                         ("domains", None, None))
      self.task_towers = GroupedMLP(num_tasks, expert_hidden[-1], tuple(hidden) + (1,),
                                    group_axis="tasks", **kw)
      self.num_experts = num_experts

  def __call__(self, h: jax.Array, domain: jax.Array | None = None) -> jax.Array:
    b = h.shape[0]
    if domain is None:
      domain = jnp.zeros((b,), jnp.int32)
    domain = jnp.clip(domain.astype(jnp.int32), 0, self.num_domains - 1)
    h = h.astype(self.dtype)
    if self.kind == "towers":
      all_logits = self.towers(h)  # (B, D, T)
      return _select(all_logits, domain).astype(jnp.float32)  # (B, T)
    experts = self.experts(h)  # (B, E, H_e)
    g_all = lowp_einsum("bk,dkm->bdm", h, self.gates[...], self.dtype)  # (B, D, T * E)
    g = _select(g_all, domain)  # (B, T * E)
    g = jax.nn.softmax(g.reshape(b, self.num_tasks, self.num_experts), axis=-1)  # (B, T, E)
    z = lowp_einsum("bte,beh->bth", g, experts, self.dtype).astype(self.dtype)  # (B, T, H_e)
    logits = self.task_towers(z)  # (B, T, 1)
    return logits[..., 0].astype(jnp.float32)  # (B, T)


def masked_multitask_bce(logits: jax.Array, labels: jax.Array, label_mask: jax.Array,
                         task_weights: jax.Array | None = None, domain: jax.Array | None = None,
                         domain_weights: jax.Array | None = None) -> jax.Array:
  """Mean BCE-with-logits over observed labels, optionally weighted.

    loss = sum_{b,t} m_{bt} w_t v_{domain[b]} BCE(z_{bt}, y_{bt}) / max(1, sum_{b,t} m_{bt})

  BCE(z, y) = max(z, 0) - z y + log(1 + exp(-|z|)). Weights scale the terms but
  the denominator counts observed labels, so all-ones weights give the plain mean.

  Args:
    logits, labels, label_mask: (B, T); label_mask is 1 where the label is observed.
    task_weights: optional (T,).  domain, domain_weights: optional (B,) ids and (D,).
  Returns:
    a float32 scalar.
  """
  z = logits.astype(jnp.float32)
  y = labels.astype(jnp.float32)
  m = label_mask.astype(jnp.float32)
  bce = optax.sigmoid_binary_cross_entropy(z, y)  # (B, T)
  w = m
  if task_weights is not None:
    w = w * jnp.asarray(task_weights, jnp.float32)[None, :]
  if domain_weights is not None:
    if domain is None:
      raise ValueError("domain_weights needs domain")
    w = w * jnp.take(jnp.asarray(domain_weights, jnp.float32), domain, axis=0,
                     mode="clip")[:, None]
  return jnp.sum(w * bce) / jnp.maximum(jnp.sum(m), 1.0)
