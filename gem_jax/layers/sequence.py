"""Sequence blocks and the pyramid-parallel stack (GEM.md §3.2).

SequenceBlock (pre-norm transformer block on a jagged sequence):
  x = x + Attention(LN(x), valid, dt)
  x = x + W_2 gelu(W_1 LN(x))              W_1: (D, e D), W_2: (e D, D)
FLOPs: attention_flops(L, D, mask, b) + 4 e L D^2.
With layer='hstu' the stack's blocks are HSTU layers instead
(`gem_jax.layers.hstu.HSTU`: y = x + W_2(LN(A V) * U), no FFN; FLOPs `hstu_flops`).

PyramidStack [proposal, GEM.md §3.2]: one branch per event stream, branches
independent (parallel). Branch with stage_lengths (L_0, L_1, ..., L_{S-1}):
  stage 0: the newest L_0 events (longer inputs are cropped, shorter ones run
           at their own length), `blocks_per_stage` SequenceBlocks;
  stage s: reduce the tokens to L_s, then `blocks_per_stage` SequenceBlocks;
  summary: reduce to `num_summary` tokens, then LayerNorm.
Reduction to n tokens:
  * 'recent': keep tokens [0, n) (the newest; events are most-recent-first)
    with their validity and dt (a stage runs on min(n, L) tokens); the
    summary is padded to exactly n tokens and its invalid tokens are set to 0.
  * 'pma':    PMA onto n learned seeds (`gem_jax.layers.attention.PMA`); the
    n outputs are all valid, their dt is 0 (= now) and their RoPE positions
    are 0..n-1.
Output: the branches' summaries concatenated, (B, num_streams * num_summary, D).
Padded events never change the output.
FLOPs: `pyramid_flops`.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from gem_jax.layers.attention import PMA, Attention, AttentionImpl, attention_flops, pma_flops
from gem_jax.layers.dense import Dense
from gem_jax.layers.hstu import HSTU, hstu_flops
from gem_jax.layers.mlp import REMAT_POLICIES  # noqa: F401  (re-exported)
from gem_jax.layers.mlp import checkpoint_call as remat_call
from gem_jax.layers.norm import LayerNorm

Dtype = Any
REDUCTIONS = ("recent", "pma")
LAYERS = ("transformer", "hstu")
HSTU_OPTIONS = ("mask", "block_size", "recent_first", "time_buckets", "pos_buckets", "norm_len",
                "impl", "remat")


class FeedForward(nnx.Module):
  """y = W_2 gelu(W_1 x + b_1) + b_2,  (..., D) -> (..., D); FLOPs 4 e D^2 per token.

  Args:
    d_model: width D.  ffn_mult: e, hidden width e D.  rngs: `nnx.Rngs`.
    dtype, param_dtype: compute / parameter dtypes (default float32).  fp8: default False.
  """

  def __init__(self, d_model: int, ffn_mult: int, *, rngs: nnx.Rngs, dtype: Dtype = jnp.float32,
               param_dtype: Dtype = jnp.float32, fp8: bool = False):
    kw = dict(dtype=dtype, param_dtype=param_dtype, fp8=fp8, rngs=rngs)
    self.up = Dense(d_model, ffn_mult * d_model, kernel_axes=("embed", "mlp"), **kw)
    self.down = Dense(ffn_mult * d_model, d_model, kernel_axes=("mlp", "embed"), **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down(jax.nn.gelu(self.up(x)))  # (..., D)


def sequence_block_flops(L: int, d_model: int, ffn_mult: int, *, mask: str = "full",
                         block_size: int = 64) -> int:
  """Forward FLOPs of a SequenceBlock on L tokens: attention + 4 e L D^2."""
  return attention_flops(L, d_model, mask=mask, block_size=block_size) + \
      4 * ffn_mult * L * d_model ** 2


class SequenceBlock(nnx.Module):
  """Pre-norm attention + FFN block with residuals (module docstring).

  Args:
    d_model, num_heads, ffn_mult: D, H and the FFN expansion e.
    score, mask, block_size, rope, time_buckets, qk_norm, recent_first, impl: see
      `gem_jax.layers.attention.Attention`.
    dtype, param_dtype, fp8: precision policy; the residual stream is kept
      in `dtype`.
    remat: activation checkpointing of the whole block: None, 'full', 'dots'.

  Call: (x (B, L, D), valid bool (B, L), dt (B, L) or None) -> (B, L, D) in dtype.
  """

  def __init__(self, d_model: int, num_heads: int, ffn_mult: int = 4, *, rngs: nnx.Rngs,
               score: str = "softmax", mask: str = "full", block_size: int = 64,
               rope: bool = False, time_buckets: int = 0, qk_norm: bool = True,
               recent_first: bool = True, impl: AttentionImpl = AttentionImpl(),
               dtype: Dtype = jnp.float32, param_dtype: Dtype = jnp.float32, fp8: bool = False,
               remat: str | None = None):
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.dtype, self.remat = dtype, remat
    self.norm1 = LayerNorm(d_model, **kw)
    self.attn = Attention(d_model, num_heads, score=score, qk_norm=qk_norm, rope=rope,
                          time_buckets=time_buckets, mask=mask, block_size=block_size,
                          recent_first=recent_first, impl=impl, fp8=fp8, **kw)
    self.norm2 = LayerNorm(d_model, **kw)
    self.ffn = FeedForward(d_model, ffn_mult, fp8=fp8, **kw)

  def _forward(self, x, valid, dt):
    x = x.astype(self.dtype)  # (B, L, D)
    x = x + self.attn(self.norm1(x), valid, dt)  # (B, L, D)
    return x + self.ffn(self.norm2(x))  # (B, L, D)

  def __call__(self, x: jax.Array, valid: jax.Array, dt: jax.Array | None = None) -> jax.Array:
    return remat_call(type(self)._forward, self.remat, self, x, valid, dt)


class HSTUBlock(nnx.Module):
  """`HSTU` with the stack's call signature and activation checkpointing.

  Args: d_model, num_heads, mask, block_size, recent_first, time_buckets, impl,
  dtype, param_dtype, fp8 (see `HSTU`); remat: None, 'full' or 'dots'.
  Call: (x (B, L, D), valid bool (B, L), dt (B, L) or None) -> (B, L, D).
  """

  def __init__(self, d_model: int, num_heads: int, *, rngs: nnx.Rngs, remat: str | None = None,
               **hstu_kw):
    self.remat = remat
    self.layer = HSTU(d_model, num_heads, rngs=rngs, **hstu_kw)

  def _forward(self, x, valid, dt):
    return self.layer(x, valid, dt if self.layer.time_bias is not None else None)

  def __call__(self, x: jax.Array, valid: jax.Array, dt: jax.Array | None = None) -> jax.Array:
    return remat_call(type(self)._forward, self.remat, self, x, valid, dt)


def make_block(layer: str, d_model: int, num_heads: int, ffn_mult: int, *, rngs: nnx.Rngs,
               **kw) -> nnx.Module:
  """A 'transformer' `SequenceBlock` or an 'hstu' `HSTUBlock` (HSTU takes HSTU_OPTIONS only)."""
  if layer == "transformer":
    return SequenceBlock(d_model, num_heads, ffn_mult, rngs=rngs, **kw)
  if layer != "hstu":
    raise ValueError(f"layer={layer!r}: expected one of {LAYERS}")
  prec = {k: kw.pop(k) for k in ("dtype", "param_dtype", "fp8") if k in kw}
  bad = sorted(set(kw) - set(HSTU_OPTIONS))
  if bad:
    raise ValueError(f"{bad} are not options of the HSTU layer (it takes {HSTU_OPTIONS})")
  return HSTUBlock(d_model, num_heads, rngs=rngs, **prec, **kw)


def _keep_recent(x, valid, dt, n, pad_to_n):
  """Tokens [0, n) (newest first); if pad_to_n, pads with invalid tokens when L < n."""
  L = x.shape[1]
  if pad_to_n and L < n:
    pad = n - L
    x = jnp.pad(x, [(0, 0), (0, pad), (0, 0)])
    valid = jnp.pad(valid, [(0, 0), (0, pad)])
    dt = jnp.pad(dt, [(0, 0), (0, pad)])
  return x[:, :n], valid[:, :n], dt[:, :n]


class PyramidBranch(nnx.Module):
  """One event stream's branch of `PyramidStack` (see the module docstring).

  Call: (x (B, L, D), valid bool (B, L), dt (B, L) or None) -> (B, num_summary, D).

  Args:
    d_model, num_heads: width D and attention heads.
    stage_lengths: tokens kept after each stage, non-increasing, e.g. (64, 16).
    reduce: 'recent' (default: keep the most recent tokens) or 'pma' (pool onto seeds).
    num_summary: output tokens (default 4).  rngs: `nnx.Rngs`.
    blocks_per_stage: blocks per stage (default 1).  ffn_mult: default 4.
    layer: 'transformer' (`SequenceBlock`, default) or 'hstu' (`HSTUBlock`, no FFN).
    pma_heads: heads of the PMA reductions (default None: num_heads).
    dtype, param_dtype: default float32.  fp8: default False.
    **block_kw: passed to every block (score, mask, rope, impl, ...).
  """

  def __init__(self, d_model: int, num_heads: int, stage_lengths: Sequence[int],
               reduce: str = "recent", num_summary: int = 4, *, rngs: nnx.Rngs,
               blocks_per_stage: int = 1, ffn_mult: int = 4, layer: str = "transformer",
               pma_heads: int | None = None, dtype: Dtype = jnp.float32,
               param_dtype: Dtype = jnp.float32, fp8: bool = False, **block_kw):
    if reduce not in REDUCTIONS:
      raise ValueError(f"reduce={reduce!r}: expected one of {REDUCTIONS}")
    if not stage_lengths or list(stage_lengths) != sorted(stage_lengths, reverse=True):
      raise ValueError(f"stage_lengths must be non-empty and non-increasing: {stage_lengths}")
    self.stage_lengths, self.reduce = tuple(stage_lengths), reduce
    self.num_summary, self.dtype = num_summary, dtype
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.stages = nnx.List([
        nnx.List([make_block(layer, d_model, num_heads, ffn_mult, fp8=fp8, **block_kw, **kw)
                  for _ in range(blocks_per_stage)])
        for _ in stage_lengths])
    # PMA reducers: into stage 1..S-1, then into the summary.
    targets = list(self.stage_lengths[1:]) + [num_summary]
    self.pmas = nnx.List([
        PMA(d_model, n, pma_heads or num_heads, score=block_kw.get("score", "softmax"),
            impl=block_kw.get("impl", AttentionImpl()), fp8=fp8, **kw)
        for n in targets] if reduce == "pma" else [])
    self.final_norm = LayerNorm(d_model, **kw)

  def _reduce(self, i, x, valid, dt, n):
    if self.reduce == "recent":  # stages run on min(n, L) tokens; the summary has exactly n
      return _keep_recent(x, valid, dt, n, pad_to_n=i == len(self.stages) - 1)
    x = self.pmas[i](x, valid)  # (B, n, D)
    B = x.shape[0]
    return x, jnp.ones((B, n), bool), jnp.zeros((B, n), jnp.float32)

  def __call__(self, x: jax.Array, valid: jax.Array, dt: jax.Array | None = None) -> jax.Array:
    B, L, _ = x.shape
    dt = jnp.zeros((B, L), jnp.float32) if dt is None else dt.astype(jnp.float32)
    L0 = self.stage_lengths[0]
    x, valid, dt = x[:, :L0].astype(self.dtype), valid[:, :L0], dt[:, :L0]  # (B, <=L0, D)
    for s, blocks in enumerate(self.stages):
      if s > 0:
        x, valid, dt = self._reduce(s - 1, x, valid, dt, self.stage_lengths[s])  # (B, L_s, D)
      for block in blocks:
        x = block(x, valid, dt)  # (B, L_s, D)
    x, valid, _ = self._reduce(len(self.stages) - 1, x, valid, dt, self.num_summary)
    x = self.final_norm(x)  # (B, k, D)
    return jnp.where(valid[:, :, None], x, jnp.zeros((), x.dtype))  # (B, k, D)


class PyramidStack(nnx.Module):
  """Pyramid-parallel sequence stack: one `PyramidBranch` per event stream.

  Args:
    num_streams: number of event streams (branches, separate parameters).
    d_model, num_heads: D and H.
    stage_lengths: (L_0, L_1, ...) non-increasing token counts of the stages.
    reduce: 'recent' or 'pma' (between stages and into the summary).
    num_summary: k summary tokens per branch.
    blocks_per_stage, ffn_mult, layer, score, mask, block_size, rope, time_buckets,
    qk_norm, recent_first, impl, dtype, param_dtype, fp8, remat: passed to every
      block (and PMA); see `PyramidBranch`.

  Call: (streams: list of (x (B, L_i, D), valid bool (B, L_i), dt (B, L_i) or None))
  -> (B, num_streams * num_summary, D).
  FLOPs: `pyramid_flops`.
  """

  def __init__(self, num_streams: int, d_model: int, num_heads: int,
               stage_lengths: Sequence[int] = (64,), reduce: str = "recent",
               num_summary: int = 4, *, rngs: nnx.Rngs, **kw):
    self.num_streams = num_streams
    self.branches = nnx.List([
        PyramidBranch(d_model, num_heads, stage_lengths, reduce, num_summary, rngs=rngs, **kw)
        for _ in range(num_streams)])

  def __call__(self, streams: Sequence[tuple]) -> jax.Array:
    if len(streams) != self.num_streams:
      raise ValueError(f"expected {self.num_streams} streams, got {len(streams)}")
    outs = [branch(*stream) for branch, stream in zip(self.branches, streams)]
    return jnp.concatenate(outs, axis=1)  # (B, num_streams * k, D)


def pyramid_flops(L: int, d_model: int, stage_lengths: Sequence[int], reduce: str = "recent",
                  num_summary: int = 4, *, blocks_per_stage: int = 1, ffn_mult: int = 4,
                  mask: str = "full", block_size: int = 64, layer: str = "transformer") -> int:
  """Forward FLOPs of one PyramidBranch on an input of L tokens (sum over branches yourself).

  sum_s blocks_per_stage * block FLOPs(L_s) (`sequence_block_flops`, or `hstu_flops`
  for layer='hstu') + (for 'pma') the PMA reductions pma_flops(L_s, L_{s+1}) and
  pma_flops(L_last, k); 'recent' costs 0.
  """
  lengths = [min(L, stage_lengths[0])]
  for n in stage_lengths[1:]:
    lengths.append(n if reduce == "pma" else min(n, lengths[-1]))
  def block(n):
    if layer == "hstu":
      return hstu_flops(n, d_model, mask=mask, block_size=block_size)
    return sequence_block_flops(n, d_model, ffn_mult, mask=mask, block_size=block_size)

  total = sum(blocks_per_stage * block(n) for n in lengths)
  if reduce == "pma":
    targets = list(stage_lengths[1:]) + [num_summary]
    total += sum(pma_flops(n, t, d_model) for n, t in zip(lengths, targets))
  return total
