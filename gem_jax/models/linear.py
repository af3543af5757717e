"""Logistic-regression baseline on the shared input contract (GEM, DLRM, DCNv2 take the same inputs).

With x = [dense; e_1; ...; e_T] (B, n_dense + sum_f D_f), e_f the pooled embedding of
feature f (sequence item features enter as the masked mean over the stream's valid
events, as in DLRM), and one bias per (domain, task):

  logits[b, t] = x[b] . W[:, t] + b_dom[domain[b], t]                       (B, n_tasks)

so each categorical value v of feature f adds the scalar s_f(v) = E_f[v] . W_f[:, t]
(a rank-1 read-out of its embedding): the model is linear in the one-hot features
(plus the dense floats), i.e. logistic regression trained through the same
embedding engine, optimizers and loss as the deep models. It has no feature
interactions by construction.
"""
from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from gem_jax.data.spec import DataSpec
from gem_jax.layers.dense import Dense, param
from gem_jax.models.config import GEMConfig
from gem_jax.models.dlrm import feature_order, masked_mean


class LinearModel(nnx.Module):
  """Logistic regression over [dense; pooled embeddings] with per-domain biases.

  Call: (inputs, return_aux=False) -> logits (B, n_tasks) fp32, or (logits, aux) with
  aux = {'trunk': x (B, n_dense + sum_f D_f)} (the regression's input).

  Args:
    cfg: only the precision fields (dtype, param_dtype) are used.
    spec: the DataSpec (n_dense, pooled features, streams, domains, tasks).
    feature_dims: {feature: table width D_f}.
  """

  def __init__(self, cfg: GEMConfig, spec: DataSpec, feature_dims: Mapping[str, int], *,
               rngs: nnx.Rngs):
    prec = cfg.precision()
    self.pooled, self.seq = feature_order(spec)
    names = self.pooled + tuple(f for _, f in self.seq)
    self.n_dense = spec.n_dense
    self.in_features = spec.n_dense + sum(int(feature_dims[n]) for n in names)
    self.linear = Dense(self.in_features, len(spec.tasks), rngs=rngs, use_bias=False,
                        kernel_axes=(None, None), **prec)
    self.domain_bias = param(rngs, nnx.initializers.zeros_init(),
                             (max(spec.num_domains, 1), len(spec.tasks)), cfg.params_dtype,
                             (None, None))

  def features(self, inputs: Mapping[str, Any]) -> jax.Array:
    """x = [dense; e_f for pooled features; masked-mean e_f for sequence items] -> (B, K)."""
    parts = [inputs["dense"].astype(jnp.float32)]  # (B, n_dense)
    parts += [inputs["sparse"][n].astype(jnp.float32) for n in self.pooled]  # (B, D_f) each
    for stream, f in self.seq:
      s = inputs["seq"][stream]
      parts.append(masked_mean(s["items"][f], s["mask"]))  # (B, D_f)
    return jnp.concatenate(parts, axis=1)  # (B, K)

  def __call__(self, inputs: Mapping[str, Any], return_aux: bool = False):
    x = self.features(inputs)  # (B, K)
    bias = self.domain_bias[...]
    dom = jnp.clip(inputs["domain"].astype(jnp.int32), 0, bias.shape[0] - 1)  # (B,)
    logits = (self.linear(x).astype(jnp.float32)
              + jnp.take(bias, dom, axis=0).astype(jnp.float32))  # (B, n_tasks)
    if return_aux:
      return logits, {"trunk": x}
    return logits


def linear_flops(spec: DataSpec, feature_dims: Mapping[str, int]) -> int:
  """Forward FLOPs per example: 2 * K * n_tasks (the read-out; pooling counts 0)."""
  pooled, seq = feature_order(spec)
  k = spec.n_dense + sum(int(feature_dims[n]) for n in pooled + tuple(f for _, f in seq))
  return 2 * k * len(spec.tasks)
