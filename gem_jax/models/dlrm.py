"""DLRM (dot interaction) and DCNv2 (low-rank cross net) baselines, TorchRec-compatible.

Same input contract as GEM (see gem_jax/models/gem.py). With D = cfg.d_model:

  dense_out = ReLU-MLP(dense)             13 -> bottom_mlp... -> D, ReLU after every layer
  e_f       = sparse[f] (projected to D when its table width differs)
  Z         = [dense_out; e_1; ...; e_T]                               (B, T+1, D)
  DLRM:   inter = concat(dense_out, triu_{+1}(Z Z^T) row-major)        (B, D + T(T+1)/2)
  DCNv2:  inter = CrossNet(flatten(Z)),  x <- x0 * (W_l (V_l x) + b_l) + x  (B, (T+1) D)
          (run as (W_l V_l) x when that is fewer FLOPs, rank > (T+1) D / 2: layers/cross.py)
  logits  = Linear(ReLU-MLP(inter))        top_mlp..., then a linear layer to n_tasks

This is exactly TorchRec's `DLRM` / `DLRM_DCN` forward (DenseArch, InteractionArch /
InteractionDCNArch, OverArch); `load_torchrec_state` copies a TorchRec state dict in.
Event streams, if the spec has any, enter as extra rows of Z: the masked mean
over valid events of each stream's item-feature embeddings (one row per item feature).
"""
from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gem_jax.data.spec import DataSpec
from gem_jax.layers.cross import LowRankCrossNet
from gem_jax.layers.dense import Dense
from gem_jax.layers.features import SparseProjector
from gem_jax.layers.mlp import MLP
from gem_jax.layers.pairs import dot_pairs, upper_pairs
from gem_jax.models.config import GEMConfig


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
  """mean over valid positions: x (B, L, D), mask (B, L) -> (B, D); 0 when none is valid."""
  m = mask.astype(jnp.float32)[..., None]  # (B, L, 1)
  s = jnp.sum(jnp.where(m > 0, x.astype(jnp.float32), 0.0), axis=1)  # (B, D)
  return s / jnp.maximum(jnp.sum(m, axis=1), 1.0)


def feature_order(spec: DataSpec) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
  """(pooled feature names, (stream, item feature) pairs) in the order the models use."""
  pooled = tuple(f.name for f in spec.pooled_features)
  seq = tuple((s.name, f) for s in spec.sequences for f in s.item_features)
  return pooled, seq


class DLRM(nnx.Module):
  """DLRM (interaction='dot') or DCNv2 (interaction='dcn') on the shared input contract.

  Args:
    cfg: d_model (= D), bottom_mlp, top_mlp, dcn_layers, dcn_rank, precision fields.
    spec: the DataSpec (n_dense, pooled features, streams, tasks).
    feature_dims: {feature: table width D_f}.
    interaction: 'dot' or 'dcn'.
  """

  interaction_kind = "dot"

  def __init__(self, cfg: GEMConfig, spec: DataSpec, feature_dims: Mapping[str, int], *,
               rngs: nnx.Rngs, interaction: str | None = None):
    self.interaction = interaction or self.interaction_kind
    if self.interaction not in ("dot", "dcn"):
      raise ValueError(f"interaction={self.interaction!r}: expected 'dot' or 'dcn'")
    d = cfg.d_model
    prec = cfg.precision()
    self.pooled, self.seq = feature_order(spec)
    names = self.pooled + tuple(f for _, f in self.seq)
    self.dtype = cfg.compute_dtype
    self.bottom = MLP(spec.n_dense, tuple(cfg.bottom_mlp) + (d,), rngs=rngs,
                      final_activation="relu", fp8=cfg.fp8, in_axis=None, **prec)
    self.project = SparseProjector({n: feature_dims[n] for n in names}, d, rngs=rngs, **prec)
    t = len(names)
    self.num_rows = t + 1
    if self.interaction == "dot":
      self.triu = upper_pairs(t + 1)
      width = d + t * (t + 1) // 2
      self.crossnet = None
    else:
      width = (t + 1) * d
      self.crossnet = LowRankCrossNet(width, cfg.dcn_layers, cfg.dcn_rank, rngs=rngs,
                                      fp8=cfg.fp8, **prec)
    self.top = MLP(width, tuple(cfg.top_mlp), rngs=rngs, final_activation="relu",
                   fp8=cfg.fp8, in_axis="mlp", out_axis="mlp", **prec)
    self.out = Dense(cfg.top_mlp[-1], len(spec.tasks), rngs=rngs, kernel_axes=("mlp", None),
                     **prec)

  def embeddings(self, inputs: Mapping[str, Any]) -> dict[str, jax.Array]:
    """{feature: (B, D_f)}: pooled features as given, sequence items mean-pooled."""
    emb = {n: inputs["sparse"][n] for n in self.pooled}
    for stream, f in self.seq:
      s = inputs["seq"][stream]
      emb[f] = masked_mean(s["items"][f], s["mask"])
    return emb

  def __call__(self, inputs: Mapping[str, Any], return_aux: bool = False):
    dense_out = self.bottom(inputs["dense"])  # (B, D)
    e = self.project(self.embeddings(inputs))  # (B, T, D)
    z = jnp.concatenate([dense_out[:, None, :].astype(self.dtype), e], axis=1)  # (B, T+1, D)
    if self.crossnet is None:
      pairs = dot_pairs(z, *self.triu)  # (B, T(T+1)/2): strict upper triangle of Z Z^T
      inter = jnp.concatenate([dense_out.astype(jnp.float32), pairs], axis=1)
    else:
      inter = self.crossnet(z.reshape(z.shape[0], -1))  # (B, (T+1) D)
    trunk = self.top(inter.astype(self.dtype))  # (B, top_mlp[-1])
    logits = self.out(trunk).astype(jnp.float32)  # (B, n_tasks)
    if return_aux:
      return logits, {"trunk": trunk, "interaction": inter}
    return logits


class DCNv2(DLRM):
  """DLRM with the DCNv2 low-rank cross net as interaction (TorchRec `DLRM_DCN`)."""

  interaction_kind = "dcn"


def load_torchrec_state(model: DLRM, state: Mapping[str, Any]) -> None:
  """Copies the dense weights of a TorchRec `DLRM`/`DLRM_DCN` state dict into `model`.

  `state` maps TorchRec names to arrays (torch tensors or numpy). torch.nn.Linear
  stores (out, in), so kernels are transposed. Embedding tables are not part of
  the model here (the trainer owns them): use the
  `sparse_arch.embedding_bag_collection.embedding_bags.<table>.weight` entries there.
  """
  def get(name):
    v = state[name]
    return np.asarray(v.detach().cpu().numpy() if hasattr(v, "detach") else v, np.float32)

  def set_dense(layer: Dense, prefix: str):
    layer.kernel[...] = jnp.asarray(get(prefix + ".weight").T, layer.kernel[...].dtype)
    layer.bias[...] = jnp.asarray(get(prefix + ".bias"), layer.bias[...].dtype)

  for j, layer in enumerate(model.bottom.layers):
    set_dense(layer, f"dense_arch.model._mlp.{j}._linear")
  for j, layer in enumerate(model.top.layers):
    set_dense(layer, f"over_arch.model.0._mlp.{j}._linear")
  set_dense(model.out, "over_arch.model.1")
  if model.crossnet is not None:
    for l, (v, w) in enumerate(zip(model.crossnet.v, model.crossnet.w)):
      v.kernel[...] = jnp.asarray(get(f"inter_arch.crossnet.V_kernels.{l}").T, v.kernel[...].dtype)
      w.kernel[...] = jnp.asarray(get(f"inter_arch.crossnet.W_kernels.{l}").T, w.kernel[...].dtype)
      w.bias[...] = jnp.asarray(get(f"inter_arch.crossnet.bias.{l}"), w.bias[...].dtype)
