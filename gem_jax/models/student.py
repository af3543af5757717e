"""A small vertical (student) model for knowledge transfer (GEM.md §3.5).

  X = [DenseTokenizer(dense); SparseProjector(sparse); mean_valid(items) per stream item
       feature (projected); W_t teacher_emb (n_t tokens, optional)]         (B, n0, d)
  X' = WukongStack(X)                                                      (B, n_F + n_L, d)
  trunk = MLP(flatten(X'))                                                 (B, H)
  logits = MultiTaskHeads(trunk, domain)                                   (B, T) fp32

Representation transfer: `inputs['teacher_emb']` (B, cfg.teacher_dim), e.g. the
teacher's aux['trunk'] or aux['seq_summary'], becomes `teacher_tokens` extra tokens
(no teacher cost at serving time when it is precomputed / cached).
Parameter sharing: `shared={'dense_tok': teacher.dense_tok, 'sparse_proj': ...}`
reuses teacher modules (the same nnx objects, so a joint update trains both);
embedding tables live outside the model and are shared by feeding the student the
same lookups.
"""
from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from gem_jax.data.spec import DataSpec
from gem_jax.layers.dense import Dense
from gem_jax.layers.features import DenseTokenizer, SparseProjector
from gem_jax.layers.heads import MultiTaskHeads
from gem_jax.layers.mlp import MLP
from gem_jax.layers.wukong import WukongStack
from gem_jax.models.config import GEMConfig
from gem_jax.models.dlrm import feature_order, masked_mean


class Student(nnx.Module):
  """Student(cfg, spec, feature_dims, rngs=..., shared=None, teacher_tokens=2).

  cfg fields used: d_model, n_dense_tokens, dense_hidden, num_blocks (Wukong layers),
  wukong_*, cross_layer, trunk_hidden, head_*, teacher_dim, precision.
  Call: (inputs[, return_aux]) -> logits (B, T) fp32 [, {'trunk': (B, H)}].
  """

  def __init__(self, cfg: GEMConfig, spec: DataSpec, feature_dims: Mapping[str, int], *,
               rngs: nnx.Rngs, shared: Mapping[str, nnx.Module] | None = None,
               teacher_tokens: int = 2):
    d, prec = cfg.d_model, cfg.precision()
    shared = dict(shared or {})
    self.dtype, self.d = cfg.compute_dtype, d
    self.pooled, self.seq = feature_order(spec)
    self.dense_tok = shared.get("dense_tok") or DenseTokenizer(
        spec.n_dense, cfg.n_dense_tokens, d, cfg.dense_hidden, rngs=rngs, **prec)
    self.sparse_proj = shared.get("sparse_proj") or SparseProjector(
        {f: feature_dims[f] for f in self.pooled}, d, rngs=rngs, **prec)
    self.seq_proj = SparseProjector({f: feature_dims[f] for _, f in self.seq}, d, rngs=rngs,
                                    **prec) if self.seq else None
    self.teacher_tokens = teacher_tokens if cfg.teacher_dim else 0
    self.teacher_proj = (Dense(cfg.teacher_dim, self.teacher_tokens * d, rngs=rngs,
                               kernel_axes=(None, "embed"), **prec)
                         if cfg.teacher_dim else None)
    n0 = (self.dense_tok.n_tokens + len(self.pooled) + len(self.seq) + self.teacher_tokens)
    self.wukong = WukongStack(n0, d, num_layers=cfg.num_blocks, n_f=cfg.wukong_nf,
                              n_l=cfg.wukong_nl, k=cfg.wukong_k, mlp_hidden=cfg.wukong_mlp,
                              cross_layer=cfg.cross_layer, fm=cfg.wukong_fm, rngs=rngs, fp8=cfg.fp8,
                              remat=cfg.remat, **prec)
    self.trunk = MLP(cfg.n_interaction * d, cfg.trunk_hidden, rngs=rngs,
                     final_activation="relu", in_axis="mlp", out_axis="mlp", **prec)
    self.heads = MultiTaskHeads(cfg.trunk_hidden[-1], len(spec.tasks), max(spec.num_domains, 1),
                                kind=cfg.head_kind, hidden=cfg.head_hidden,
                                num_experts=cfg.num_experts, expert_hidden=cfg.expert_hidden,
                                rngs=rngs, **prec)

  def __call__(self, inputs: Mapping[str, Any], return_aux: bool = False):
    b = inputs["dense"].shape[0]
    parts = [self.dense_tok(inputs["dense"])]  # (B, n_dt, d)
    if self.pooled:
      parts.append(self.sparse_proj(inputs["sparse"]))  # (B, n_sp, d)
    if self.seq_proj is not None:
      pooled = {f: masked_mean(inputs["seq"][s]["items"][f], inputs["seq"][s]["mask"])
                for s, f in self.seq}
      parts.append(self.seq_proj(pooled))  # (B, n_seq, d)
    if self.teacher_proj is not None:
      t = self.teacher_proj(jax.lax.stop_gradient(inputs["teacher_emb"]))
      parts.append(t.reshape(b, self.teacher_tokens, self.d))  # (B, n_t, d)
    x = jnp.concatenate([p.astype(self.dtype) for p in parts], axis=1)  # (B, n0, d)
    x = self.wukong(x)  # (B, n_F + n_L, d)
    trunk = self.trunk(x.reshape(b, -1))  # (B, H)
    logits = self.heads(trunk, inputs["domain"])  # (B, T)
    return (logits, {"trunk": trunk}) if return_aux else logits
