"""Analytic FLOPs per example (GEM.md §5) and parameter counts.

Conventions: forward FLOPs per example; a matmul m x k x n costs 2 m k n;
embedding gathers, norms, activations, softmax and other elementwise work
count 0; training = 3 x forward (recomputation from remat is not counted).

  MLP:            sum_j 2 h_j h_{j+1}
  FM:             4 n d k                      (X^T Y, then X (X^T Y))
  FMB:            FM + MLP(n k -> hidden... -> n_F d)
  LCB:            2 n_L n d
  residual:       2 n (n_F + n_L) d            (only when n != n_F + n_L)
  self-attention: 8 L d^2 + 4 L L_k d          (L_k = L; block-local: b, L padded to b)
  HSTU layer:     10 L d^2 + 4 L L_k d         (`hstu_flops`)
  FFN:            4 e L d^2
  cross-attn:     4 Q d^2 + 4 L d^2 + 4 Q L d
  PMA (k seeds):  4 L d^2 + 4 k L d + 4 k d^2
  InterFormer:    X_sum once + one stream branch per event stream
                  (`interformer_flops`, `sequence_branch_flops` of gem_jax.layers.interformer)
Jagged histories: `gem_flops(..., lengths=)` and `real_token_flops` count real tokens only
(useful FLOPs); the default counts the padded lengths (what the device computes);
`packed_flops` is what a packed batch computes.

Command line:
  python -m gem_jax.flops --preset wukong_108        # one JSON line
  python -m gem_jax.flops --preset medium --model gem
"""
from __future__ import annotations

import argparse
import json
import math
from typing import Callable, Mapping, Sequence

import jax
import numpy as np
from flax import nnx

from gem_jax.layers import cross
from gem_jax.layers.hstu import hstu_flops  # noqa: F401
from gem_jax.layers.interformer import interformer_flops, sequence_branch_flops  # noqa: F401
from gem_jax.layers.mlp import mlp_flops


def fm_flops(n: int, d: int, k: int, mode: str = "projected") -> int:
  """'projected': X (X^T Y), 4 n d k; 'pairs': the Gram matrix X X^T, 2 n^2 d."""
  return 4 * n * d * k if mode == "projected" else 2 * n * n * d


def fm_width(n: int, k: int, mode: str = "projected") -> int:
  return n * k if mode == "projected" else n * (n - 1) // 2


def fmb_flops(n: int, d: int, k: int, n_f: int, mlp_hidden: Sequence[int],
              fm: str = "projected") -> int:
  return fm_flops(n, d, k, fm) + mlp_flops(fm_width(n, k, fm), tuple(mlp_hidden) + (n_f * d,))


def lcb_flops(n: int, d: int, n_l: int) -> int:
  return 2 * n_l * n * d


def wukong_layer_flops(n: int, d: int, n_f: int, n_l: int, k: int,
                       mlp_hidden: Sequence[int], fm: str = "projected") -> int:
  """FMB + LCB + residual projection (when n changes)."""
  res = 2 * n * (n_f + n_l) * d if n != n_f + n_l else 0
  return fmb_flops(n, d, k, n_f, mlp_hidden, fm) + lcb_flops(n, d, n_l) + res


def cross_layer_flops(num_layers: int, n: int, n_out: int, d: int) -> int:
  """Cross-layer attention: X_0 projection (if n != n_out) + weighted sums 2 J n_out d."""
  if num_layers < 2:
    return 0
  proj = 2 * n_out * n * d if n != n_out else 0
  return proj + sum(2 * (l + 1) * n_out * d for l in range(1, num_layers))


def wukong_stack_flops(n: int, d: int, num_layers: int, n_f: int, n_l: int, k: int,
                       mlp_hidden: Sequence[int], cross_layer: bool = False) -> int:
  n_out = n_f + n_l
  total = sum(wukong_layer_flops(n if i == 0 else n_out, d, n_f, n_l, k, mlp_hidden)
              for i in range(num_layers))
  return total + (cross_layer_flops(num_layers, n, n_out, d) if cross_layer else 0)


def attention_flops(L: int, d: int, *, mask: str = "full", block_size: int = 64) -> int:
  """Self-attention: projections 8 L d^2 + scores/values 4 L L_k d."""
  if mask == "block_local":
    lp = -(-L // block_size) * block_size
    return 8 * L * d * d + 4 * lp * block_size * d
  return 8 * L * d * d + 4 * L * L * d


def ffn_flops(L: int, d: int, ffn_mult: int) -> int:
  return 4 * ffn_mult * L * d * d


def sequence_block_flops(L: int, d: int, ffn_mult: int, *, mask: str = "full",
                         block_size: int = 64) -> int:
  return attention_flops(L, d, mask=mask, block_size=block_size) + ffn_flops(L, d, ffn_mult)


def cross_attention_flops(q: int, L: int, d: int) -> int:
  """Q queries onto L keys: q/out projections 4 Q d^2, k/v 4 L d^2, scores/values 4 Q L d."""
  return 4 * q * d * d + 4 * L * d * d + 4 * q * L * d


def pma_flops(L: int, k: int, d: int) -> int:
  """PMA onto k learned seeds = cross attention with k queries."""
  return cross_attention_flops(k, L, d)


def heads_flops(in_features: int, num_tasks: int, num_domains: int, kind: str,
                hidden: Sequence[int], num_experts: int, expert_hidden: Sequence[int]) -> int:
  """All domain towers are computed (then one is selected), so D x tower FLOPs."""
  if kind == "towers":
    return num_domains * mlp_flops(in_features, tuple(hidden) + (num_tasks,))
  experts = num_experts * mlp_flops(in_features, tuple(expert_hidden))
  gates = 2 * in_features * num_domains * num_tasks * num_experts
  mix = 2 * num_tasks * num_experts * expert_hidden[-1]
  towers = num_tasks * mlp_flops(expert_hidden[-1], tuple(hidden) + (1,))
  return experts + gates + mix + towers


def train_flops(forward: float) -> float:
  """Training FLOPs = 3 x forward (backward = 2 x forward)."""
  return 3 * forward


def count_params(model: nnx.Module) -> int:
  """Number of scalar parameters (nnx.Param leaves) of a module or an abstract one."""
  state = nnx.state(model, nnx.Param)
  return int(sum(math.prod(v.shape) for v in jax.tree.leaves(state)))


def real_token_flops(lengths: Sequence[int], per_length: Callable[[int], float]) -> float:
  """Mean over examples of per_length(n_b): FLOPs of the real tokens only.

  For attention this is GEM.md §5's jagged rule (mean(L) for the linear terms, mean(L^2)
  for the score terms); compare with per_length(max_len), what a padded batch computes.
  """
  lengths = list(lengths)
  return sum(per_length(int(n)) for n in lengths) / max(len(lengths), 1)


def packed_flops(rows: int, capacity: int, examples: int,
                 per_length: Callable[[int], float]) -> float:
  """FLOPs per example a packed batch computes: rows x per_length(capacity) / examples.

  (Attention over a packed row of T tokens computes all T x T scores and masks them to the
  segments, so its score terms cost T^2 per row, not sum of n_i^2.)
  """
  return rows * per_length(capacity) / max(examples, 1)


def gem_flops(cfg, spec, feature_dims: Mapping[str, int],
              lengths: Mapping[str, Sequence[int]] | None = None) -> dict[str, float]:
  """Forward FLOPs per example of `gem_jax.models.gem.GEM`, per block and in total.

  lengths=None: sequences counted at their padded (max_len / pyramid) lengths, which is
  what the device computes. lengths={stream: (N,) real history lengths}: the sequence terms
  (embedder, InterFormer branches, target attention) are the mean over the N examples of
  each example's FLOPs at its real length, min(n, L_l) events in block l: useful FLOPs
  (`real_token_flops`). Streams missing from `lengths` count at max_len.
  """
  from gem_jax.models.gem import front_tokens, pyramid_lengths  # pylint: disable=import-outside-toplevel
  d, n = cfg.d_model, cfg.n_interaction
  n0 = front_tokens(cfg, spec)
  n_s = cfg.num_cls + cfg.num_pma + cfg.num_recent
  out = {}
  out["dense_tokenizer"] = mlp_flops(spec.n_dense, tuple(cfg.dense_hidden) +
                                     (cfg.n_dense_tokens * d,))
  out["sparse_projector"] = sum(2 * feature_dims[f.name] * d for f in spec.pooled_features
                                if feature_dims[f.name] != d)
  if cfg.token_mix:
    out["token_mix"] = 2 * n * n0 * d
  elif cfg.cross_layer and cfg.num_blocks > 1:
    out["history_proj"] = 2 * n * n0 * d  # X_0 into the cross-layer history
  # One branch per stream (a single 1-event dummy branch when the spec has no streams).
  sched = [pyramid_lengths(cfg, s.max_len) for s in spec.sequences] or [(1,) * cfg.num_blocks]
  k = len(sched)
  width = [sum(feature_dims[f] for f in s.item_features) for s in spec.sequences]

  def seq_terms(real: Sequence[int]) -> dict[str, float]:
    """The sequence-dependent terms for one example with `real` events per stream."""
    t = {"sequence_embedder": sum(2 * r * d * w for r, w in zip(real, width))}
    for l in range(cfg.num_blocks):
      n_in = n0 if (l == 0 and not cfg.token_mix) else n
      t[f"block{l}/interformer"] = interformer_flops(
          n_in, [min(r, ls[l]) for r, ls in zip(real, sched)], d,
          num_x_summary=cfg.num_x_summary, num_cls=cfg.num_cls, num_pma=cfg.num_pma,
          num_recent=cfg.num_recent, mask=cfg.attn_mask, block_size=cfg.block_size,
          seq_layer=cfg.seq_layer)
    t["target_attention"] = 2 * cfg.num_queries * n * d + sum(
        cross_attention_flops(cfg.num_queries, min(r, ls[-1]), d) for r, ls in zip(real, sched))
    return t

  pad = [s.max_len for s in spec.sequences] or [1]
  if lengths is None:
    seq = seq_terms(pad)
  else:
    cols = [np.minimum(np.asarray(lengths[s.name]), s.max_len) if s.name in lengths else None
            for s in spec.sequences]
    m = max((len(c) for c in cols if c is not None), default=1)
    per = [seq_terms([int(c[b]) if c is not None else p for c, p in zip(cols, pad)])
           for b in range(m)]
    seq = {key: sum(e[key] for e in per) / m for key in per[0]}
  out["sequence_embedder"] = seq.pop("sequence_embedder")
  for l in range(cfg.num_blocks):
    n_in = n0 if (l == 0 and not cfg.token_mix) else n
    out[f"block{l}/interformer"] = seq.pop(f"block{l}/interformer")
    out[f"block{l}/wukong"] = wukong_layer_flops(n_in + k * n_s, d, cfg.wukong_nf, cfg.wukong_nl,
                                                 cfg.wukong_k, cfg.wukong_mlp, cfg.wukong_fm)
  if cfg.cross_layer and cfg.num_blocks > 1:
    out["cross_layer"] = cross_layer_flops(cfg.num_blocks, n, n, d)
  out["target_attention"] = seq.pop("target_attention")
  trunk_in = (n + cfg.num_x_summary + k * (n_s + cfg.num_queries)) * d
  if cfg.trunk_pairs:
    out["front_pairs"] = fm_flops(n0, d, 0, "pairs")
    trunk_in += fm_width(n0, 0, "pairs")
  out["trunk"] = mlp_flops(trunk_in, cfg.trunk_hidden)
  out["heads"] = heads_flops(cfg.trunk_hidden[-1], len(spec.tasks), max(spec.num_domains, 1),
                             cfg.head_kind, cfg.head_hidden, cfg.num_experts, cfg.expert_hidden)
  out["total"] = sum(out.values())
  return out


def dlrm_flops(cfg, spec, feature_dims: Mapping[str, int], interaction: str = "dot") -> dict:
  """Forward FLOPs per example of `gem_jax.models.dlrm.DLRM` / `DCNv2`.

  dot: the full (T+1) x (T+1) Gram matrix is computed, 2 (T+1)^2 D.
  dcn: per cross layer 4 N r (V then W), N = (T+1) D; 2 N^2 where the layer runs the
    product form (r > N / 2, `gem_jax.layers.cross`; its per-batch 2 N^2 r for U is
    left out of this per-example count).
  """
  d = cfg.d_model
  names = [f.name for f in spec.pooled_features] + [f for s in spec.sequences
                                                    for f in s.item_features]
  t = len(names)
  out = {"bottom_mlp": mlp_flops(spec.n_dense, tuple(cfg.bottom_mlp) + (d,)),
         "sparse_projector": sum(2 * feature_dims[f] * d for f in names if feature_dims[f] != d)}
  if interaction == "dot":
    out["interaction"] = 2 * (t + 1) ** 2 * d
    width = d + t * (t + 1) // 2
  else:
    width = (t + 1) * d
    per_layer = (2 * width * width if cross.resolve_form("auto", width, cfg.dcn_rank, cfg.fp8)
                 == "product" else 4 * width * cfg.dcn_rank)
    out["interaction"] = cfg.dcn_layers * per_layer
  out["top_mlp"] = mlp_flops(width, tuple(cfg.top_mlp) + (len(spec.tasks),))
  out["total"] = sum(out.values())
  return out


def wukong_preset_flops(cfg, n_inputs: int = 384) -> dict:
  """The plain Wukong stack of a preset on n_inputs embeddings (wukong_108: 384)."""
  fwd = wukong_stack_flops(n_inputs, cfg.d_model, cfg.num_blocks, cfg.wukong_nf, cfg.wukong_nl,
                           cfg.wukong_k, cfg.wukong_mlp, cfg.cross_layer)
  return {"wukong_stack": fwd, "total": fwd}


def abstract_params(model_cls, cfg, spec, feature_dims) -> int:
  """Parameter count without allocating (nnx.eval_shape)."""
  model = nnx.eval_shape(lambda: model_cls(cfg, spec, feature_dims, rngs=nnx.Rngs(0)))
  return count_params(model)


def main(argv=None) -> dict:
  from gem_jax.models.config import get_config, reference_spec  # pylint: disable=import-outside-toplevel
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--preset", default="wukong_108")
  p.add_argument("--model", default=None, choices=["wukong", "gem", "dlrm", "dcnv2"],
                 help="default: wukong for wukong_108, dlrm/dcnv2 for their presets, else gem")
  p.add_argument("--no-params", action="store_true", help="skip the parameter count")
  args = p.parse_args(argv)
  cfg = get_config(args.preset)
  model = args.model or {"wukong_108": "wukong", "dlrm_torchrec": "dlrm",
                         "dcnv2_mlperf": "dcnv2"}.get(args.preset, "gem")
  spec = reference_spec()
  fd = {f.name: cfg.d_model for f in spec.sparse}
  if model == "wukong":
    blocks, params = wukong_preset_flops(cfg), None
    if not args.no_params:
      from gem_jax.layers.wukong import WukongStack  # pylint: disable=import-outside-toplevel
      params = count_params(nnx.eval_shape(lambda: WukongStack(
          384, cfg.d_model, num_layers=cfg.num_blocks, n_f=cfg.wukong_nf, n_l=cfg.wukong_nl,
          k=cfg.wukong_k, mlp_hidden=cfg.wukong_mlp, cross_layer=cfg.cross_layer,
          rngs=nnx.Rngs(0))))
  else:
    from gem_jax.models.dlrm import DCNv2, DLRM  # pylint: disable=import-outside-toplevel
    from gem_jax.models.gem import GEM  # pylint: disable=import-outside-toplevel
    if model == "gem":
      blocks, cls = gem_flops(cfg, spec, fd), GEM
    else:
      blocks = dlrm_flops(cfg, spec, fd, "dot" if model == "dlrm" else "dcn")
      cls = DLRM if model == "dlrm" else DCNv2
    params = None if args.no_params else abstract_params(cls, cfg, spec, fd)
  fwd = blocks["total"]
  out = {"preset": args.preset, "model": model,
         "forward_gflops_per_example": fwd / 1e9,
         "train_gflops_per_example": train_flops(fwd) / 1e9,
         "dense_params": params,
         "blocks_gflops": {k: v / 1e9 for k, v in blocks.items() if k != "total"}}
  print(json.dumps(out))
  return out


if __name__ == "__main__":
  main()
