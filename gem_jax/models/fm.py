"""Factorization machine (FM, Rendle 2010) and field-weighted FM (FwFM, Pan et al. 2018)
baselines on the shared input contract (GEM, DLRM, DCNv2 and LR take the same inputs).

With e_1..e_F (B, D) the field embeddings (the pooled embedding of each pooled sparse
feature, then each sequence item feature as the masked mean over its stream's valid
events, as in LinearModel and DLRM), x = [dense; e_1; ...; e_F] and one bias per
(domain, task), both models are LinearModel's logistic regression plus pairwise terms:

  FM:    logits[b, t] = x[b] . W[:, t] + b_dom[domain[b], t]
                        + s_t * sum_{i<j} <e_i, e_j>
         sum_{i<j} <e_i, e_j> = 0.5 * (||sum_i e_i||^2 - sum_i ||e_i||^2)    O(F D)

  FwFM:  logits[b, t] = x[b] . W[:, t] + b_dom[domain[b], t]
                        + sum_{i<j} r[(i,j), t] <e_i, e_j>

s (n_tasks,) is a learned per-task scale of the FM pair sum (initialised to 1); r
(n_pairs, n_tasks) are FwFM's learned field-pair weights, per task, initialised to
1 / F (small and positive: the pair sum then starts at the scale of an average
pair, not of F^2 / 2 of them). The factor vectors are the embedding-table rows
themselves: FM's rank k is the table width (config.embedding.dim), so every field
must have the same width D. The dense floats enter only the linear part (they have
no factor vector).

Precision: the field embeddings are cast to cfg.compute_dtype for the pair terms,
whose reductions accumulate in fp32 (the linear part is LinearModel's Dense); the
logits are fp32.
"""
from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from gem_jax.data.spec import DataSpec
from gem_jax.layers.dense import param
from gem_jax.models.config import GEMConfig
from gem_jax.layers.pairs import dot_pairs, upper_pairs
from gem_jax.models.dlrm import feature_order
from gem_jax.models.linear import LinearModel, linear_flops


def _field_width(spec: DataSpec, feature_dims: Mapping[str, int], model: str) -> tuple[int, int]:
  """(F, D) of the fields; ValueError unless there are >= 2 and they share one width."""
  pooled, seq = feature_order(spec)
  names = pooled + tuple(f for _, f in seq)
  widths = {n: int(feature_dims[n]) for n in names}
  if len(set(widths.values())) > 1:
    raise ValueError(f"{model}: the pairwise terms need one embedding width for all "
                     f"fields, got {widths} (set one config.embedding.dim)")
  if len(names) < 2:
    raise ValueError(f"{model}: the pairwise terms need at least 2 fields, got {names}")
  return len(names), next(iter(widths.values()))


class _Pairwise(LinearModel):
  """LinearModel + a pairwise term of the field embeddings (FM and FwFM set `pair_term`)."""

  def __init__(self, cfg: GEMConfig, spec: DataSpec, feature_dims: Mapping[str, int], *,
               rngs: nnx.Rngs):
    self.num_fields, self.dim = _field_width(spec, feature_dims, type(self).__name__)
    super().__init__(cfg, spec, feature_dims, rngs=rngs)
    self.dtype = cfg.compute_dtype

  def fields(self, x: jax.Array) -> jax.Array:
    """e (B, F, D) in the compute dtype: the embedding part of x = [dense; e_1..e_F]."""
    return x[:, self.n_dense:].reshape(x.shape[0], self.num_fields, self.dim).astype(self.dtype)

  def pair_term(self, e: jax.Array) -> tuple[jax.Array, jax.Array]:
    raise NotImplementedError

  def __call__(self, inputs: Mapping[str, Any], return_aux: bool = False):
    logits, aux = super().__call__(inputs, return_aux=True)  # linear part + b_dom (B, T) fp32
    pair_logits, inter = self.pair_term(self.fields(aux["trunk"]))
    logits = logits + pair_logits  # (B, n_tasks) fp32
    if return_aux:
      return logits, {"trunk": aux["trunk"], "interaction": inter}
    return logits


class FM(_Pairwise):
  """Factorization machine: LinearModel + s_t * sum_{i<j} <e_i, e_j> (module docstring).

  Call: (inputs, return_aux=False) -> logits (B, n_tasks) fp32, or (logits, aux) with
  aux = {'trunk': x (B, n_dense + F D) (the linear part's input),
         'interaction': sum_{i<j} <e_i, e_j> (B,) fp32}.

  Args:
    cfg: only the precision fields (dtype, param_dtype) are used.
    spec: the DataSpec (n_dense, pooled features, streams, domains, tasks).
    feature_dims: {feature: table width D}, one D for every field (ValueError otherwise).
  """

  def __init__(self, cfg: GEMConfig, spec: DataSpec, feature_dims: Mapping[str, int], *,
               rngs: nnx.Rngs):
    super().__init__(cfg, spec, feature_dims, rngs=rngs)
    self.pair_scale = param(rngs, nnx.initializers.ones_init(), (len(spec.tasks),),
                            cfg.params_dtype, (None,))

  def pair_term(self, e: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(pair logits (B, n_tasks), sum_{i<j} <e_i, e_j> (B,)), both fp32, in O(F D)."""
    e = e.astype(jnp.float32)
    total = jnp.sum(e, axis=1)  # (B, D)
    pairs = 0.5 * (jnp.sum(total * total, axis=1) - jnp.sum(e * e, axis=(1, 2)))  # (B,)
    return pairs[:, None] * self.pair_scale[...].astype(jnp.float32), pairs


class FwFM(_Pairwise):
  """Field-weighted FM: LinearModel + sum_{i<j} r[(i,j), t] <e_i, e_j> (module docstring).

  Pairs (i, j), i < j, in field order (pooled features, then sequence item features),
  row-major over the strict upper triangle (as DLRM's), through layers.pairs.dot_pairs.
  r (n_pairs, n_tasks) starts at 1 / F.

  Call: (inputs, return_aux=False) -> logits (B, n_tasks) fp32, or (logits, aux) with
  aux = {'trunk': x (B, n_dense + F D), 'interaction': <e_i, e_j> (B, n_pairs) fp32}.

  Args: as FM.
  """

  def __init__(self, cfg: GEMConfig, spec: DataSpec, feature_dims: Mapping[str, int], *,
               rngs: nnx.Rngs):
    super().__init__(cfg, spec, feature_dims, rngs=rngs)
    self.triu = upper_pairs(self.num_fields)
    self.pair_weight = param(rngs, nnx.initializers.constant(1.0 / self.num_fields),
                             (len(self.triu[0]), len(spec.tasks)), cfg.params_dtype,
                             (None, None))

  def pair_term(self, e: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(pair logits (B, n_tasks), <e_i, e_j> (B, n_pairs)), both fp32."""
    pairs = dot_pairs(e, *self.triu)  # (B, P) fp32
    r = self.pair_weight[...].astype(jnp.float32)  # (P, n_tasks)
    return jnp.dot(pairs, r, precision=jax.lax.Precision.HIGHEST), pairs


def fm_flops(spec: DataSpec, feature_dims: Mapping[str, int]) -> int:
  """Forward FLOPs per example: linear_flops + 3 F D + 2 D + n_tasks (the pair sum:
  F D adds for sum_i e_i, 2 D for its squared norm, 2 F D for the F squared norms;
  then the per-task scale). Elementwise, but counted: it is the model's interaction."""
  f, d = _field_width(spec, feature_dims, "FM")
  return linear_flops(spec, feature_dims) + 3 * f * d + 2 * d + len(spec.tasks)


def fwfm_flops(spec: DataSpec, feature_dims: Mapping[str, int]) -> int:
  """Forward FLOPs per example: linear_flops + 2 F^2 D (the full F x F Gram matrix
  dot_pairs computes, as dlrm_flops counts it) + 2 P n_tasks (pairs . r), P = F (F-1)/2."""
  f, d = _field_width(spec, feature_dims, "FwFM")
  p = f * (f - 1) // 2
  return linear_flops(spec, feature_dims) + 2 * f * f * d + 2 * p * len(spec.tasks)
