"""Multi-head attention for event sequences: self, target-aware cross, and PMA.

Shapes: B batch, L (or Lq, Lk) tokens, D = d_model, H heads, dh = D / H.

Scores (per head, s = scale * q.k + bias, scale = 1/sqrt(dh)):
  * 'softmax': a = softmax over the allowed keys of s.
  * 'silu' (HSTU-style pointwise): a = silu(s) / N on allowed keys, 0 elsewhere,
    with N the size of the key window: Lk for 'full'/'causal' (the padded
    key length, as HSTU divides by the max sequence length), block_size for
    'block_local'. HSTU uses no 1/sqrt(dh) scale; we keep it so that the two
    score types see the same logits (with QK-norm the logit scale is learned
    through the norm scales anyway).
  out = sum_k a_qk v_k, then an output projection.

Masks (key j allowed for query i); `valid` (B, L) marks real events, events are
most-recent-first (index 0 = newest):
  * 'full': valid_j.
  * 'causal': valid_j and j >= i when `recent_first` (an event sees itself and
    OLDER events), j <= i otherwise (chronological order).
  * 'block_local': valid_j and i // b == j // b: non-overlapping blocks of
    b = block_size tokens (L padded up to a multiple of b with invalid tokens);
    each block attends only to itself. Computed block-diagonally on
    (B, L/b, b, H, dh) tensors: the score tensor is (B, L/b, H, b, b), never
    (B, H, L, L).
A query row with no allowed key gives a zero output (finite, no NaN), and
outputs at invalid query positions are zeroed before the output projection
(so they equal the projection bias). Padded events never change a valid
output: their scores are replaced (not added to), so results are bit-exact.

Packed rows: segment ids seg (B, L) restrict key j to queries i of the same segment
(several users' histories in one row, `gem_jax.data.packing`); a learned relative
position bias pos_table[min(|p_i - p_j|, P - 1)] takes in-segment positions p.

Implementations (`AttentionImpl`, all the same function): 'dense' builds the
(B, H, Lq, Lk) scores; 'chunked' (`gem_jax.layers.chunked`) runs an online softmax
over query x key tiles (skipping tiles with nothing allowed) with a recomputing custom
VJP, memory linear in L; 'cudnn' calls
`jax.nn.dot_product_attention` (softmax, no bias or segments, 'full' or
chronological 'causal', prefix-valid rows); 'auto' (default) is dense up to
dense_max keys, above it cuDNN on GPU where that applies, else chunked.
Block-local attention is block-diagonal in every case.

Position / time information (optional, both may be on):
  * RoPE on q and k with positions 0..L-1 (`gem_jax.layers.rope`).
  * Relative time bias: a learned (num_buckets, H) table indexed by
    bucket(dt_i - dt_j), bucket(t) = min(num_buckets - 1, floor(log2(1 + |t|)))
    with t in seconds (bucket 20 ~ 12 days, 25 ~ 1 year). For cross attention
    (the candidate is "now"), bucket(dt_j) of the key's age is used.

Precision: projections through `Dense` (dtype / param_dtype / fp8); scores,
softmax and QK-norm in fp32; probabilities cast to the compute dtype for the
value matmul (fp32 accumulation); outputs in the compute dtype.

FLOPs (forward, per example, matmuls only; see `attention_flops` & co):
  self-attention: 8 L D^2 + 4 L Lk_eff D, Lk_eff = L (full, causal: the
  causal mask is applied to the full score matrix) or b (block-local, L
  rounded up to a multiple of b) -- GEM.md §5.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from gem_jax.layers.chunked import (Bias, bias_buckets, bias_values, chunked_attention,
                                    segment_allowed, time_bucket)  # noqa: F401
from gem_jax.layers.dense import Dense, lowp_einsum, param
from gem_jax.layers.norm import LayerNorm, RMSNorm
from gem_jax.layers.rope import apply_rope

Dtype = Any
SCORES = ("softmax", "silu")
MASKS = ("full", "causal", "block_local")
IMPLS = ("auto", "dense", "chunked", "cudnn", "xla_sdpa")


@dataclasses.dataclass(frozen=True)
class AttentionImpl:
  """How the attention core is computed (never what it computes).

  kind: 'auto' (dense up to dense_max keys, above it cuDNN on GPU where it applies,
    else chunked), 'dense' ((Lq, Lk) scores), 'chunked' (`gem_jax.layers.chunked`,
    memory linear in L), 'cudnn' (`jax.nn.dot_product_attention`, cuDNN; raises where it
    does not apply), 'xla_sdpa' (the same call with implementation='xla': the cuDNN
    route's reference, runs on CPU).
  chunk_size: key tokens per step of the chunked path.
  dense_max: the longest key length 'auto' computes densely.
  Block-local attention is always block-diagonal (memory linear in L) whatever kind says.
  """
  kind: str = "auto"
  chunk_size: int = 256
  dense_max: int = 1024

  def __post_init__(self):
    if self.kind not in IMPLS:
      raise ValueError(f"attention impl kind={self.kind!r}: expected one of {IMPLS}")


def sdpa_applies(*, score: str, mask: str, recent_first: bool, Lq: int, Lk: int, dh: int,
                 dtype: Dtype, has_bias: bool, has_segments: bool, cudnn: bool) -> bool:
  """Whether `jax.nn.dot_product_attention` computes exactly this attention.

  Softmax only; no time/position bias and no segments (they would need a (Lq, Lk) bias
  or mask tensor); 'full', or 'causal' in chronological order (is_causal: key j <= query
  i). Keys are masked by lengths = sum(valid), so valid must be a prefix of each row
  (padding at the end, as in every gem_jax batch). cuDNN also needs bf16/fp16 and
  dh % 8 == 0, dh <= 128.
  """
  if score != "softmax" or has_bias or has_segments:
    return False
  if mask not in ("full", "causal") or (mask == "causal" and (recent_first or Lq != Lk)):
    return False
  if cudnn and (jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16) or dh % 8 or dh > 128):
    return False
  return True


def select_impl(impl: AttentionImpl, *, mask: str, Lk: int, platform: str | None = None,
                **sdpa_kw) -> str:
  """'blocked' | 'dense' | 'chunked' | 'cudnn' | 'xla_sdpa' for one call (`AttentionImpl`).

  platform: jax.default_backend() by default; sdpa_kw: the arguments of `sdpa_applies`
  except cudnn.
  """
  if mask == "block_local":
    return "blocked"
  kind = impl.kind
  if kind in ("cudnn", "xla_sdpa"):
    if not sdpa_applies(mask=mask, Lk=Lk, cudnn=kind == "cudnn", **sdpa_kw):
      raise ValueError(f"impl {kind!r} does not apply to this attention "
                       f"(mask={mask!r}, {sdpa_kw})")
    return kind
  if kind != "auto":
    return kind
  if Lk <= impl.dense_max:
    return "dense"
  platform = platform or jax.default_backend()
  if platform == "gpu" and sdpa_applies(mask=mask, Lk=Lk, cudnn=True, **sdpa_kw):
    return "cudnn"
  return "chunked"


def _sdpa(q, k, v, k_valid, *, causal, scale, implementation, dtype):
  """jax.nn.dot_product_attention with key lengths sum(valid) (prefix-valid rows)."""
  lengths = jnp.sum(k_valid, axis=1).astype(jnp.int32)  # (B,)
  o = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                   key_value_seq_lengths=lengths,
                                   implementation=implementation)  # (B, Lq, H, dh)
  return jnp.where((lengths > 0)[:, None, None, None], o, jnp.zeros((), o.dtype)).astype(dtype)


def attention_weights(s: jax.Array, allowed: jax.Array, score: str, norm: float) -> jax.Array:
  """Scores -> attention weights, fp32.

  s: fp32 (..., H, Lq, Lk); allowed: bool, broadcastable to s. Disallowed
  entries get weight exactly 0; a row with no allowed entry is all zeros.
  """
  if score == "softmax":
    s = jnp.where(allowed, s, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))  # (..., Lq, 1)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)  # exp(-inf) = 0 on disallowed keys
    den = jnp.sum(p, axis=-1, keepdims=True)  # (..., Lq, 1)
    return p / jnp.where(den > 0, den, 1.0)
  if score == "silu":
    return jnp.where(allowed, jax.nn.silu(s), 0.0) / norm
  raise ValueError(f"score={score!r}: expected one of {SCORES}")


def _attend(q, k, v, allowed, bias, *, score, scale, norm, dtype):
  """q (..., Lq, H, dh), k/v (..., Lk, H, dh) -> (..., Lq, H, dh) in dtype.

  The two products run head-major, (..., H, L, dh), so that every batch axis leads
  in both operands: XLA:CPU has bf16 x bf16 -> fp32 kernels only for that form
  (the backward of `lowp_einsum` needs them); elsewhere the layout is free.
  """
  q, k, v = (jnp.moveaxis(t, -2, -3) for t in (q, k, v))  # (..., H, L, dh)
  s = lowp_einsum("...hqd,...hkd->...hqk", q, k, q.dtype) * scale  # (..., H, Lq, Lk) fp32
  if bias is not None:
    s = s + bias
  p = attention_weights(s, allowed, score, norm)  # (..., H, Lq, Lk) fp32
  o = lowp_einsum("...hqk,...hkd->...hqd", p, v, v.dtype)  # (..., H, Lq, dh) fp32
  return jnp.moveaxis(o, -3, -2).astype(dtype)  # (..., Lq, H, dh)


def _dense_allowed(b: Bias, k_valid, causal, recent_first, Lq, Lk):
  allowed = k_valid[..., None, None, :]  # (..., 1, 1, Lk)
  if causal:
    i = jnp.arange(Lq)[:, None]
    j = jnp.arange(Lk)[None, :]
    allowed = allowed & ((j >= i) if recent_first else (j <= i))  # (..., 1, Lq, Lk)
  seg = segment_allowed(b)
  return allowed if seg is None else allowed & seg


def multihead_attention(q: jax.Array, k: jax.Array, v: jax.Array, k_valid: jax.Array, *,
                        score: str = "softmax", mask: str = "full", block_size: int = 64,
                        recent_first: bool = True, scale: float | None = None,
                        time_table: jax.Array | None = None, dt_q: jax.Array | None = None,
                        dt_k: jax.Array | None = None, pos_table: jax.Array | None = None,
                        pos_q: jax.Array | None = None, pos_k: jax.Array | None = None,
                        seg_q: jax.Array | None = None, seg_k: jax.Array | None = None,
                        norm: float | None = None, impl: AttentionImpl = AttentionImpl(),
                        dtype: Dtype = None) -> jax.Array:
  """The attention core on projected heads (see the module docstring).

  Args:
    q: (B, Lq, H, dh); k, v: (B, Lk, H, dh); k_valid: bool (B, Lk).
    score: 'softmax' | 'silu'.  mask: 'full' | 'causal' | 'block_local'.
    block_size: b for 'block_local' (needs Lq == Lk).
    recent_first: direction of 'causal' (True: key j >= query i allowed).
    scale: logit scale, default 1/sqrt(dh).
    time_table: (NB, H) bias table; with dt_q (B, Lq) and dt_k (B, Lk) the
      bias is table[bucket(dt_q_i - dt_k_j)]; with dt_k only, table[bucket(dt_k_j)].
    pos_table: (P, H) bias table[min(|pos_q_i - pos_k_j|, P - 1)]; positions (B, L)
      default to 0..L-1.
    seg_q, seg_k: int (B, Lq), (B, Lk) segment ids: key j allowed for query i only
      when seg_q_i == seg_k_j (packed sequences).
    norm: N of the silu score (default: Lk, or b for 'block_local').
    impl: how it is computed (`AttentionImpl`); every choice computes the same function.
    dtype: output dtype (default q.dtype).
  Returns:
    (B, Lq, H, dh).
  """
  if mask not in MASKS:
    raise ValueError(f"mask={mask!r}: expected one of {MASKS}")
  dtype = dtype or q.dtype
  B, Lq, H, dh = q.shape
  Lk = k.shape[1]
  scale = 1.0 / math.sqrt(dh) if scale is None else scale
  if pos_table is not None:
    pos_q = jnp.broadcast_to(jnp.arange(Lq), (B, Lq)) if pos_q is None else pos_q
    pos_k = jnp.broadcast_to(jnp.arange(Lk), (B, Lk)) if pos_k is None else pos_k
  if (seg_q is None) != (seg_k is None):
    raise ValueError("pass both seg_q and seg_k, or neither")
  if time_table is not None and dt_k is None:
    raise ValueError("a time bias needs dt_k")
  bias = Bias(time_table, dt_q, dt_k, pos_table, pos_q, pos_k, seg_q, seg_k)
  path = select_impl(impl, mask=mask, Lk=Lk, score=score, recent_first=recent_first,
                     Lq=Lq, dh=dh, dtype=q.dtype,
                     has_bias=time_table is not None or pos_table is not None,
                     has_segments=seg_q is not None)
  if path == "blocked":
    if Lq != Lk:
      raise ValueError(f"block_local attention needs Lq == Lk, got {Lq} and {Lk}")
    b = block_size
    nb = -(-Lk // b)
    pad = nb * b - Lk

    def blocks(t, fill=0):  # (B, L, ...) -> (B, nb, b, ...)
      if t is None:
        return None
      t = jnp.pad(t, [(0, 0), (0, pad)] + [(0, 0)] * (t.ndim - 2), constant_values=fill)
      return t.reshape((B, nb, b) + t.shape[2:])

    qb, kb, vb = blocks(q), blocks(k), blocks(v)  # (B, nb, b, H, dh)
    dtk = blocks(None if dt_k is None else dt_k.astype(jnp.float32))  # (B, nb, b)
    dtq = dtk if dt_q is None else blocks(dt_q.astype(jnp.float32))
    bb = Bias(time_table, dtq, dtk, pos_table, blocks(pos_q), blocks(pos_k), blocks(seg_q),
              blocks(seg_k))
    allowed = blocks(k_valid, False)[:, :, None, None, :]  # (B, nb, 1, 1, b)
    seg = segment_allowed(bb)
    allowed = allowed if seg is None else allowed & seg  # (B, nb, 1, b, b)
    bv = bias_values(bb, *bias_buckets(bb))  # (B, nb, H, b, b)
    o = _attend(qb, kb, vb, allowed, bv, score=score, scale=scale,
                norm=float(b) if norm is None else norm, dtype=dtype)  # (B, nb, b, H, dh)
    return o.reshape(B, nb * b, H, dh)[:, :Lq]
  norm = float(Lk) if norm is None else norm
  causal = mask == "causal"
  if path == "chunked":
    return chunked_attention(q, k, v, k_valid, bias, score=score, scale=scale, norm=norm,
                             causal=causal, recent_first=recent_first,
                             chunk=impl.chunk_size, dtype=dtype)  # (B, Lq, H, dh)
  if path in ("cudnn", "xla_sdpa"):
    return _sdpa(q, k, v, k_valid, causal=causal, scale=scale, dtype=dtype,
                 implementation="cudnn" if path == "cudnn" else "xla")  # (B, Lq, H, dh)
  allowed = _dense_allowed(bias, k_valid, causal, recent_first, Lq, Lk)  # (B, 1, Lq|1, Lk)
  bv = bias_values(bias, *bias_buckets(bias))  # (B, H, Lq|1, Lk)
  return _attend(q, k, v, allowed, bv, score=score, scale=scale, norm=norm,
                 dtype=dtype)  # (B, Lq, H, dh)


def attention_flops(L: int, d_model: int, *, mask: str = "full", block_size: int = 64) -> int:
  """Forward FLOPs of `Attention` on L tokens: 8 L D^2 + 4 L Lk_eff D.

  Lk_eff = L for 'full'/'causal', b for 'block_local' (L rounded up to a
  multiple of b, as computed). Norms, RoPE, bias and softmax are not counted.
  """
  if mask == "block_local":
    Lp = -(-L // block_size) * block_size
    return 8 * L * d_model ** 2 + 4 * Lp * block_size * d_model
  return 8 * L * d_model ** 2 + 4 * L * L * d_model


def cross_attention_flops(Q: int, L: int, d_model: int) -> int:
  """Forward FLOPs of `CrossAttention`: 4 Q D^2 (q, out) + 4 L D^2 (k, v) + 4 Q L D."""
  return 4 * Q * d_model ** 2 + 4 * L * d_model ** 2 + 4 * Q * L * d_model


def pma_flops(L: int, num_seeds: int, d_model: int) -> int:
  """Forward FLOPs of `PMA`: GEM.md's 4 L D^2 + 4 k L D, plus 4 k D^2 (seed q, out)."""
  return cross_attention_flops(num_seeds, L, d_model)


class _Heads(nnx.Module):
  """Shared pieces: QK-norm, optional time-bias table, output projection."""

  def _init_common(self, d_model, num_heads, *, score, qk_norm, time_buckets, dtype,
                   param_dtype, fp8, rngs):
    if d_model % num_heads:
      raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
    if score not in SCORES:
      raise ValueError(f"score={score!r}: expected one of {SCORES}")
    self.d_model, self.num_heads, self.head_dim = d_model, num_heads, d_model // num_heads
    self.score, self.dtype = score, dtype
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.q_norm = RMSNorm(self.head_dim, **kw) if qk_norm else None
    self.k_norm = RMSNorm(self.head_dim, **kw) if qk_norm else None
    self.time_bias = (param(rngs, nnx.initializers.zeros_init(), (time_buckets, num_heads),
                            param_dtype, (None, "heads")) if time_buckets else None)
    self.out = Dense(d_model, d_model, fp8=fp8, kernel_axes=("heads", "embed"), **kw)

  def _split(self, t: jax.Array) -> jax.Array:
    return t.reshape(t.shape[:2] + (self.num_heads, self.head_dim))  # (B, L, H, dh)

  def _norm_qk(self, q, k):
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    return q, k

  def _table(self):
    return None if self.time_bias is None else self.time_bias[...]

  def _project_out(self, o: jax.Array, q_valid: jax.Array | None) -> jax.Array:
    B, Lq = o.shape[:2]
    if q_valid is not None:
      o = jnp.where(q_valid[:, :, None, None], o, jnp.zeros((), o.dtype))
    return self.out(o.reshape(B, Lq, self.d_model))  # (B, Lq, D)


class Attention(_Heads):
  """Multi-head self-attention over a jagged event sequence.

  y = W_o concat_h( attend(q_h, k_h, v_h) ),  [q, k, v] = x W_qkv, with
  optional QK-norm (RMSNorm per head on q and k), RoPE, a log-time-delta
  bucket bias, and the score/mask variants of the module docstring.
  FLOPs: `attention_flops` = 8 L D^2 + 4 L Lk_eff D.

  Args:
    d_model, num_heads: D and H (D % H == 0).
    score: 'softmax' or 'silu'.
    qk_norm: RMS-normalize q and k per head (learned scale per head dim).
    rope: rotary positions 0..L-1 on q and k.
    time_buckets: number of log2 time-delta buckets of the bias (0 = off);
      needs `dt` at call time.
    mask: 'full', 'causal' or 'block_local'; block_size: b of 'block_local'.
    recent_first: sequences are newest-first (direction of 'causal').
    impl: how the core is computed (`AttentionImpl`: dense, chunked, cuDNN).
    dtype, param_dtype, fp8: precision policy of `Dense`.

  Call: (x (B, L, D), valid bool (B, L), dt (B, L) seconds or None) -> (B, L, D).
  """

  def __init__(self, d_model: int, num_heads: int, *, rngs: nnx.Rngs, score: str = "softmax",
               qk_norm: bool = True, rope: bool = False, time_buckets: int = 0,
               mask: str = "full", block_size: int = 64, recent_first: bool = True,
               impl: AttentionImpl = AttentionImpl(), dtype: Dtype = jnp.float32,
               param_dtype: Dtype = jnp.float32, fp8: bool = False):
    if mask not in MASKS:
      raise ValueError(f"mask={mask!r}: expected one of {MASKS}")
    self._init_common(d_model, num_heads, score=score, qk_norm=qk_norm,
                      time_buckets=time_buckets, dtype=dtype, param_dtype=param_dtype,
                      fp8=fp8, rngs=rngs)
    self.rope, self.mask, self.block_size, self.recent_first = rope, mask, block_size, recent_first
    self.impl = impl
    self.qkv = Dense(d_model, 3 * d_model, dtype=dtype, param_dtype=param_dtype, fp8=fp8,
                     kernel_axes=("embed", "heads"), rngs=rngs)

  def __call__(self, x: jax.Array, valid: jax.Array, dt: jax.Array | None = None, *,
               seg: jax.Array | None = None, pos: jax.Array | None = None,
               norm: float | None = None) -> jax.Array:
    """seg, pos (B, L): packed rows (segment ids, in-segment positions for RoPE);
    norm: N of the silu score (default: the key window)."""
    B, L, D = x.shape
    if seg is not None and self.mask == "block_local":
      raise ValueError("block_local attention has no packed-rows form (blocks would cross "
                       "segments): use mask 'full' or 'causal'")
    qkv = self.qkv(x).reshape(B, L, 3, self.num_heads, self.head_dim)  # (B, L, 3, H, dh)
    # split, not indexing: the backward is then one concatenate, not three padded copies summed
    q, k, v = (jnp.squeeze(t, 2) for t in jnp.split(qkv, 3, axis=2))  # (B, L, H, dh)
    q, k = self._norm_qk(q, k)
    if self.rope:
      p = jnp.arange(L) if pos is None else pos
      q, k = apply_rope(q, p), apply_rope(k, p)
    if self.time_bias is not None and dt is None:
      raise ValueError("time_buckets > 0 needs dt (B, L)")
    o = multihead_attention(q, k, v, valid, score=self.score, mask=self.mask,
                            block_size=self.block_size, recent_first=self.recent_first,
                            time_table=self._table(), dt_q=dt, dt_k=dt, seg_q=seg, seg_k=seg,
                            norm=norm, impl=self.impl, dtype=self.dtype)  # (B, L, H, dh)
    return self._project_out(o, valid)  # (B, L, D)


class CrossAttention(_Heads):
  """Target-aware cross attention: Q query tokens (e.g. candidate ads) attend to history.

  y = W_o concat_h( attend(q_h, k_h, v_h) ), q = x_q W_q, [k, v] = kv W_kv,
  mask 'full' over the valid keys; optional QK-norm and a time bias on the
  key's age bucket(dt_j). FLOPs: `cross_attention_flops`.

  Call: (q (B, Q, D), kv (B, L, D), kv_valid bool (B, L), kv_dt (B, L) or None)
  -> (B, Q, D). A row with no valid key gives W_o 0 + bias.

  Args:
    d_model: width D of queries, keys and output.  num_heads: H (D % H == 0).
    rngs: `nnx.Rngs`.
    score: 'softmax' (default) or the other scores of `attention_weights`.
    qk_norm: RMS-normalize q and k per head (default True).
    time_buckets: size of the learned time-bias table over age buckets (0, default: none).
    impl: how the core is computed (`AttentionImpl`).
    dtype, param_dtype: compute / parameter dtypes (default float32).
    fp8: fp8 projections (default False).
  """

  def __init__(self, d_model: int, num_heads: int, *, rngs: nnx.Rngs, score: str = "softmax",
               qk_norm: bool = True, time_buckets: int = 0,
               impl: AttentionImpl = AttentionImpl(), dtype: Dtype = jnp.float32,
               param_dtype: Dtype = jnp.float32, fp8: bool = False):
    self._init_common(d_model, num_heads, score=score, qk_norm=qk_norm,
                      time_buckets=time_buckets, dtype=dtype, param_dtype=param_dtype,
                      fp8=fp8, rngs=rngs)
    self.impl = impl
    kw = dict(dtype=dtype, param_dtype=param_dtype, fp8=fp8, kernel_axes=("embed", "heads"),
              rngs=rngs)
    self.q_proj = Dense(d_model, d_model, **kw)
    self.kv_proj = Dense(d_model, 2 * d_model, **kw)

  def __call__(self, q: jax.Array, kv: jax.Array, kv_valid: jax.Array,
               kv_dt: jax.Array | None = None) -> jax.Array:
    return self.attend(q, *self.kv_heads(kv), kv_valid, kv_dt)

  def kv_heads(self, kv: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Keys (QK-normed) and values per token: kv (B, L, D) -> two (B, L, H, dh).

    Per token, so it may run on packed rows and be unpacked afterwards."""
    B, L, _ = kv.shape
    kvh = self.kv_proj(kv).reshape(B, L, 2, self.num_heads, self.head_dim)  # (B, L, 2, H, dh)
    kh, vh = (jnp.squeeze(t, 2) for t in jnp.split(kvh, 2, axis=2))  # (B, L, H, dh); as above
    return (kh if self.k_norm is None else self.k_norm(kh)), vh

  def attend(self, q: jax.Array, kh: jax.Array, vh: jax.Array, kv_valid: jax.Array,
             kv_dt: jax.Array | None = None) -> jax.Array:
    """q (B, Q, D) onto `kv_heads` output (B, L, H, dh) -> (B, Q, D)."""
    qh = self._split(self.q_proj(q))  # (B, Q, H, dh)
    if self.q_norm is not None:
      qh = self.q_norm(qh)
    if self.time_bias is not None and kv_dt is None:
      raise ValueError("time_buckets > 0 needs kv_dt (B, L)")
    o = multihead_attention(qh, kh, vh, kv_valid, score=self.score, mask="full",
                            time_table=self._table(), dt_k=kv_dt, impl=self.impl,
                            dtype=self.dtype)  # (B, Q, H, dh)
    return self._project_out(o, None)  # (B, Q, D)


class PMA(nnx.Module):
  """Pooling by multi-head attention onto k learned seeds (Set Transformer PMA).

  PMA(x) = S + CrossAttention(S, LN(x), valid),  S: (k, D) learned seeds.
  A sequence with no valid event gives S + W_o bias (finite). Output (B, k, D)
  in the compute dtype. FLOPs: `pma_flops` = 4 L D^2 + 4 k L D + 4 k D^2.

  Call: (x (B, L, D), valid bool (B, L)) -> (B, k, D).

  Args:
    d_model: width D.  num_seeds: k learned seeds (output tokens).
    num_heads: heads of the cross attention.  rngs: `nnx.Rngs`.
    score, qk_norm, impl: as in `CrossAttention` (defaults 'softmax', True, auto).
    dtype, param_dtype: compute / parameter dtypes (default float32).  fp8: default False.
  """

  def __init__(self, d_model: int, num_seeds: int, num_heads: int, *, rngs: nnx.Rngs,
               score: str = "softmax", qk_norm: bool = True,
               impl: AttentionImpl = AttentionImpl(), dtype: Dtype = jnp.float32,
               param_dtype: Dtype = jnp.float32, fp8: bool = False):
    self.num_seeds, self.dtype = num_seeds, dtype
    self.seeds = param(rngs, nnx.initializers.normal(0.02), (num_seeds, d_model), param_dtype,
                       (None, "embed"))
    self.norm = LayerNorm(d_model, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.attn = CrossAttention(d_model, num_heads, score=score, qk_norm=qk_norm, impl=impl,
                               dtype=dtype, param_dtype=param_dtype, fp8=fp8, rngs=rngs)

  def __call__(self, x: jax.Array, valid: jax.Array) -> jax.Array:
    return self.pool(*self.kv_heads(x), valid)

  def kv_heads(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per token (packed rows allowed): x (B, L, D) -> keys, values (B, L, H, dh)."""
    return self.attn.kv_heads(self.norm(x))

  def pool(self, kh: jax.Array, vh: jax.Array, valid: jax.Array) -> jax.Array:
    """S + attend(S, keys, values): (B, L, H, dh) x 2, valid (B, L) -> (B, k, D)."""
    B = kh.shape[0]
    s = jnp.broadcast_to(self.seeds[...].astype(self.dtype), (B,) + self.seeds.shape)  # (B, k, D)
    return s + self.attn.attend(s, kh, vh, valid)  # (B, k, D)
