"""GEMConfig: one dataclass sizing every model (GEM, DLRM, DCNv2, student), and its presets.

  cfg = get_config('tiny')                        # CPU tests: compiles in seconds
  cfg = get_config('small', dtype='bfloat16')     # overrides as keyword arguments
  cfg = dataclasses.replace(cfg, num_blocks=3)

Presets: 'tiny' (tests), 'small' (CPU demo), 'medium' (one H200 / one node,
~100M+ dense params), 'large' (~1B dense params), 'wukong_108' (the published
Wukong 108 GFLOP/example config, for the FLOPs check), 'dlrm_torchrec' (the
TorchRec peer's DLRM), 'dcnv2_mlperf' (the MLPerf DLRM-DCNv2 shape).
Dense-parameter counts quoted for presets are for `reference_spec()`.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from gem_jax.data.spec import DataSpec, SequenceStreamSpec, SparseFeatureSpec

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class GEMConfig:
  """Sizes and switches of a model. Modules receive only the fields they need.

  Front end:
    d_model: token width d of every non-sequence and sequence token.
    n_dense_tokens, dense_hidden: dense MLP -> n_dense_tokens tokens.
  Interaction (Wukong, one layer per InterFormer block in GEM):
    num_blocks: InterFormer blocks (GEM) / Wukong layers (student).
    wukong_nf, wukong_nl, wukong_k, wukong_mlp: FMB outputs, LCB outputs, FM rank, FMB MLP hidden.
    wukong_fm: the FMB's FM, 'projected' (X X^T Y, rank wukong_k) or 'pairs' (every <x_i, x_j>).
    token_mix: GEM mixes the n0 front-end tokens into n = n_F + n_L tokens before the first
      block (True), or the first block's Wukong layer reads the n0 feature tokens (False).
    trunk_pairs: GEM's trunk also reads every dot product <E_i, E_j>, i < j, of the n0
      front-end tokens (default True; docs/RESULTS.md "Interaction benchmark" says why).
    trunk_gate: with trunk_pairs, the deep features (X_N, X_sum, S_sum, T_i) enter the trunk
      scaled by a learned scalar that starts at 0 (ReZero), so training starts from the pairs
      (default False: it helped at table lr 0.05, and costs 0.005 AUC at GEM's tuned 0.2;
      docs/RESULTS.md "Table learning rates").
      token_mix, trunk_pairs and trunk_gate are GEM's: the student's stack reads its raw
      tokens and its trunk only the last Wukong layer.
    cross_layer: cross-layer attention between blocks (GEM.md §3.1 proposal).
  Sequences:
    num_heads, ffn_mult, attn_score ('softmax'|'silu'), attn_mask ('full'|'causal'|'block_local'),
    block_size, rope, time_buckets: the sequence blocks (time_buckets also sizes the front end's
      log-dt embedding; 0 disables it).
    pyramid: tokens kept by each InterFormer block per stream, as a fraction of max_len
      (one entry per block; the most recent events are kept).
    num_cls, num_pma, num_recent: sequence summary tokens (InterFormer cross arch).
    num_x_summary: non-sequence summary tokens X_sum (InterFormer cross arch).
    num_queries: candidate (target) tokens for the final target-aware cross attention.
    seq_layer: the InterFormer branches' sequence sublayer, 'attention' or 'hstu' (the HSTU
      layer, GEM.md 3.2).
    attn_impl, attn_chunk, attn_dense_max: how attention is computed (`AttentionImpl`:
      'auto' is dense up to attn_dense_max keys, above it chunked in attn_chunk-key steps
      with memory linear in L, or cuDNN on GPU where it applies; same results).
    seq_pack_tokens, seq_pack_rows: packed histories (0, 0 = off, padded streams). Each
      batch shard's histories, each with its num_cls CLS slots, are packed first-fit
      decreasing into seq_pack_rows rows of seq_pack_tokens tokens (>= num_cls + max_len of
      every stream); the sequence arch then runs on those rows (segment-masked attention),
      so padding costs only the rows' unfilled tails. A batch shard whose histories do not
      fit gets NaN logits; the trainer checks every batch first and steps a misfit with the
      padded model (gem_jax/train/packing.py): size the rows with margin. Masks 'full' and
      'causal'.
  Heads:
    head_kind ('towers'|'mmoe'), head_hidden, num_experts, expert_hidden, trunk_hidden.
  DLRM / DCNv2 baselines:
    bottom_mlp (the last width is d_model, appended), top_mlp (the logit layer is appended),
    dcn_layers, dcn_rank.
  Student:
    teacher_dim: width of the teacher embedding input (0 = none).
  Precision / memory:
    dtype (compute), param_dtype, fp8 (large dense matmuls), remat (None|'full'|'dots', per block).
  """
  d_model: int = 16
  n_dense_tokens: int = 2
  dense_hidden: tuple[int, ...] = (32,)
  num_blocks: int = 2
  wukong_nf: int = 4
  wukong_nl: int = 4
  wukong_k: int = 4
  wukong_mlp: tuple[int, ...] = (32,)
  wukong_fm: str = "projected"
  token_mix: bool = True
  trunk_pairs: bool = True
  trunk_gate: bool = False
  cross_layer: bool = True
  num_heads: int = 2
  ffn_mult: int = 2
  attn_score: str = "softmax"
  attn_mask: str = "full"
  block_size: int = 64
  rope: bool = False
  time_buckets: int = 16
  pyramid: tuple[float, ...] = (1.0, 0.5)
  num_cls: int = 4
  num_pma: int = 2
  num_recent: int = 2
  num_x_summary: int = 4
  num_queries: int = 2
  seq_layer: str = "attention"
  attn_impl: str = "auto"
  attn_chunk: int = 256
  attn_dense_max: int = 1024
  seq_pack_tokens: int = 0
  seq_pack_rows: int = 0
  head_kind: str = "towers"
  head_hidden: tuple[int, ...] = (16,)
  num_experts: int = 4
  expert_hidden: tuple[int, ...] = (16,)
  trunk_hidden: tuple[int, ...] = (32,)
  bottom_mlp: tuple[int, ...] = (32,)
  top_mlp: tuple[int, ...] = (32,)
  dcn_layers: int = 2
  dcn_rank: int = 8
  teacher_dim: int = 0
  dtype: str = "float32"
  param_dtype: str = "float32"
  fp8: bool = False
  remat: str | None = None

  @property
  def compute_dtype(self) -> Any:
    return _DTYPES[self.dtype]

  @property
  def params_dtype(self) -> Any:
    return _DTYPES[self.param_dtype]

  @property
  def n_interaction(self) -> int:
    """Non-sequence tokens after the first Wukong layer: n_F + n_L."""
    return self.wukong_nf + self.wukong_nl

  def precision(self) -> dict[str, Any]:
    """dtype/param_dtype keyword arguments for modules."""
    return dict(dtype=self.compute_dtype, param_dtype=self.params_dtype)


PRESETS: dict[str, dict[str, Any]] = {
    # CPU tests: a few thousand parameters, compiles in seconds.
    "tiny": dict(d_model=64),
    # CPU demo: thousands of steps of batch ~256 in minutes on 2 cores.
    "small": dict(d_model=32, n_dense_tokens=2, dense_hidden=(64,), num_blocks=2,
                  wukong_nf=8, wukong_nl=8, wukong_k=8, wukong_mlp=(128,), num_heads=2,
                  head_hidden=(32,), expert_hidden=(32,), trunk_hidden=(64,),
                  bottom_mlp=(64,), top_mlp=(64,), dcn_rank=16),
    # One H200 / one 8-GPU node: large matmuls (FMB MLP 3 x 3072) for high MFU; ~150M dense.
    "medium": dict(d_model=128, n_dense_tokens=4, dense_hidden=(512,), num_blocks=4,
                   wukong_nf=32, wukong_nl=32, wukong_k=32, wukong_mlp=(3072, 3072, 3072),
                   num_heads=4, ffn_mult=4, attn_mask="block_local", block_size=64,
                   pyramid=(1.0, 0.5, 0.25, 0.125), head_hidden=(256,), expert_hidden=(512,),
                   trunk_hidden=(1024,), bottom_mlp=(512, 256), top_mlp=(1024, 1024, 512, 256),
                   dcn_layers=3, dcn_rank=512, dtype="bfloat16"),
    # ~1.1B dense parameters (FMB MLP 8192-4096-4096, 6 blocks).
    "large": dict(d_model=256, n_dense_tokens=8, dense_hidden=(1024,), num_blocks=6,
                  wukong_nf=64, wukong_nl=64, wukong_k=64, wukong_mlp=(8192, 4096, 4096),
                  num_heads=8, ffn_mult=4, attn_mask="block_local", block_size=64,
                  pyramid=(1.0, 0.5, 0.5, 0.25, 0.25, 0.125), head_hidden=(512,),
                  expert_hidden=(1024,), trunk_hidden=(2048,), bottom_mlp=(512, 256),
                  top_mlp=(1024, 1024, 512, 256), dcn_layers=3, dcn_rank=512,
                  dtype="bfloat16", remat="dots"),
    # Published Wukong config (l=8, n_F=n_L=192, k=192, MLP 3x16384, d=160, 384 inputs).
    "wukong_108": dict(d_model=160, num_blocks=8, wukong_nf=192, wukong_nl=192, wukong_k=192,
                       wukong_mlp=(16384, 16384, 16384), cross_layer=False),
    # The TorchRec peer (benchmarks/torchrec/bench.py): bottom 13->512->256->64, top 512,256,1.
    "dlrm_torchrec": dict(d_model=64, bottom_mlp=(512, 256), top_mlp=(512, 256)),
    # MLPerf DLRM-DCNv2: dim 128, bottom 512-256-128, 3 cross layers rank 512, top 1024-1024-512-256-1.
    "dcnv2_mlperf": dict(d_model=128, bottom_mlp=(512, 256), top_mlp=(1024, 1024, 512, 256),
                         dcn_layers=3, dcn_rank=512),
}


def get_config(name: str = "tiny", **overrides) -> GEMConfig:
  """The preset `name` with keyword overrides (unknown fields raise TypeError)."""
  if name not in PRESETS:
    raise KeyError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
  return GEMConfig(**{**PRESETS[name], **overrides})


def reference_spec(n_dense: int = 13, n_sparse: int = 26, streams: int = 2, max_len: int = 64,
                   item_features: int = 2, num_domains: int = 2,
                   tasks: tuple[str, ...] = ("click", "conversion")) -> DataSpec:
  """A DataSpec used to size presets, report their FLOPs/params and build demos.

  n_sparse pooled one-hot features plus `streams` event streams, each with
  `item_features` per-event id features.
  """
  sparse = [SparseFeatureSpec(f"c{i}", vocab=1000) for i in range(n_sparse)]
  seqs = []
  for s in range(streams):
    names = tuple(f"s{s}_item{j}" for j in range(item_features))
    sparse += [SparseFeatureSpec(n, vocab=1000) for n in names]
    seqs.append(SequenceStreamSpec(f"stream{s}", max_len=max_len, item_features=names))
  return DataSpec(n_dense=n_dense, sparse=tuple(sparse), sequences=tuple(seqs),
                  num_domains=num_domains, tasks=tasks)
