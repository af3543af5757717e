"""InterFormer block: interleaved non-sequence / sequence learning (GEM.md §3.2-3.3, IF paper).

Shapes: X (B, n, D) non-sequence tokens; K event streams, stream i is
S_i (B, L_i, D) (newest first, `valid_i` (B, L_i), `dt_i` (B, L_i));
D = d_model. Each stream has its own parallel branch (`SequenceBranch`,
separate weights): streams never attend to each other, masks (causal,
block-local) and the recent tokens are per stream, and each stream keeps its
own length. What this module implements exactly:

Cross arch (summaries):
  X_sum = Gating(MLP(X))                                        (B, m, D)
    MLP(X) = gelu(Z W_1 + b_1) W_2 + b_2,  Z = W_t X  (W_t: (m, n) mixes tokens,
    W_1, W_2: (D, D) per token); m = num_x_summary.
  S_sum = [S_sum,1 ; ... ; S_sum,K]                             (B, K (c + p + r), D)
  S_sum,i = Gating_i(LN_i([S_CLS,i ; S_PMA,i ; S_recent,i]))    (B, c + p + r, D)
    S_CLS,i: the outputs at c learned CLS tokens prepended to stream i in
    its branch's attention; S_PMA,i = PMA_i(S'_i, p seeds); S_recent,i = the
    r newest tokens of S'_i (0 where invalid). Defaults c = 4, p = 2, r = 2.
  Gating(x) = sigmoid(x * MLP_g(x)) * x, MLP_g(x) = gelu(x W_a + b_a) W_b + b_b
    per token (W_a: (D, h), W_b: (h, D), h = D by default).
Sequence arch (per stream i, branch weights _i):
  U_i = PFFN_i(X_sum, S_i)
  [S_CLS,i ; S'_i] = [C_i ; U_i] + Attention_i(LN_i([C_i ; U_i]), [1 ; valid_i], [0 ; dt_i])
    (C_i: the learned CLS tokens, dt = 0 "now"; any score/mask/RoPE/time-bias
    variant of `Attention`). With seq_layer='hstu' the attention sublayer is an HSTU
    layer instead: [S_CLS,i ; S'_i] = HSTU_i([C_i ; U_i], [1 ; valid_i], [0 ; dt_i])
    (`gem_jax.layers.hstu`, its own residual and norms; score, RoPE and QK-norm then
    apply to the PMA only). For mask='causal' with newest-first order the
    CLS tokens see every event and no event sees them; for 'block_local' they
    sit in the first block.
  PFFN(X_sum, S) = S + gelu(LN(S) K^T / sqrt(D)) V,  K = X_sum W_k, V = X_sum W_v
    (W_k, W_v: (D, D)): a per-example feed-forward layer with m hidden units
    whose input and output weights are linear in the non-sequence summary,
    i.e. the "(X_sum W) S" modulation of GEM.md §3.3.
Interaction arch:
  X' = interaction([X ; S_sum])  (the injected module, e.g. a Wukong layer,
    maps (B, n + K (c + p + r), D) to (B, n, D) or to (B, n + K (c + p + r), D),
    of which the first n tokens are kept).
Schedule: S_sum is taken from this block's updated sequences S'_i (so the CLS
outputs need no extra state between blocks); X_sum from the block's input X.
Returns (X', [S'_1..S'_K], X_sum, S_sum) (single-stream form: (X', S', X_sum,
S_sum)); the model's output head uses MLP([X_sum ; S_sum]) of the last block
(assembled by the caller). Branches run as a Python loop (K is small, lengths
may differ).

Padded events never change any output; a stream's events never change another
stream's S'. Precision as in `Dense`; norms, sigmoid and gelu in fp32 / dtype
as in the other layers; outputs in `dtype`.
FLOPs: `interformer_flops` (the injected interaction module is not included).
"""
from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from gem_jax.layers import packed
from gem_jax.layers.attention import PMA, Attention, AttentionImpl, attention_flops, pma_flops
from gem_jax.layers.dense import Dense, lowp_einsum, param
from gem_jax.layers.hstu import HSTU, hstu_flops
from gem_jax.layers.norm import LayerNorm
from gem_jax.layers.sequence import remat_call

Dtype = Any
SEQ_LAYERS = ("attention", "hstu")


class Gating(nnx.Module):
  """Self-gating: y = sigmoid(x * MLP(x)) * x,  MLP(x) = gelu(x W_a + b_a) W_b + b_b.

  Per token: x (B, n, D) -> (B, n, D). FLOPs 4 n D h (h = hidden, default D).
  The sigmoid gate is computed in fp32; output in `dtype`.

  Args:
    d_model: width D.  rngs: `nnx.Rngs`.
    hidden: MLP hidden width h (default None: D).
    dtype, param_dtype: compute / parameter dtypes (default float32).  fp8: default False.
  """

  def __init__(self, d_model: int, *, rngs: nnx.Rngs, hidden: int | None = None,
               dtype: Dtype = jnp.float32, param_dtype: Dtype = jnp.float32, fp8: bool = False):
    h = hidden or d_model
    kw = dict(dtype=dtype, param_dtype=param_dtype, fp8=fp8, rngs=rngs)
    self.dtype = dtype
    self.fc1 = Dense(d_model, h, kernel_axes=("embed", "mlp"), **kw)
    self.fc2 = Dense(h, d_model, kernel_axes=("mlp", "embed"), **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    m = self.fc2(jax.nn.gelu(self.fc1(x)))  # (B, n, D)
    x32 = x.astype(jnp.float32)
    g = jax.nn.sigmoid(x32 * m.astype(jnp.float32))  # (B, n, D)
    return (g * x32).astype(self.dtype)


class PFFN(nnx.Module):
  """Personalized FFN: S + gelu(LN(S) K^T / sqrt(D)) V,  K = X_sum W_k, V = X_sum W_v.

  x_sum (B, m, D), s (B, L, D) -> (B, L, D). The m summary tokens act as the
  hidden units of a per-example FFN on every event. FLOPs 4 m D^2 + 4 L m D.

  Args:
    d_model: D.  n_summary: m (the number of X_sum tokens, checked at call time).
  """

  def __init__(self, d_model: int, n_summary: int, *, rngs: nnx.Rngs,
               dtype: Dtype = jnp.float32, param_dtype: Dtype = jnp.float32, fp8: bool = False):
    kw = dict(dtype=dtype, param_dtype=param_dtype, fp8=fp8, rngs=rngs)
    self.d_model, self.n_summary, self.dtype = d_model, n_summary, dtype
    self.norm = LayerNorm(d_model, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.w_k = Dense(d_model, d_model, use_bias=False, kernel_axes=("embed", "mlp"), **kw)
    self.w_v = Dense(d_model, d_model, use_bias=False, kernel_axes=("embed", "mlp"), **kw)

  def __call__(self, x_sum: jax.Array, s: jax.Array) -> jax.Array:
    if x_sum.shape[1] != self.n_summary:
      raise ValueError(f"x_sum has {x_sum.shape[1]} tokens, expected {self.n_summary}")
    k = self.w_k(x_sum)  # (B, m, D)
    v = self.w_v(x_sum)  # (B, m, D)
    h = lowp_einsum("bld,bmd->blm", self.norm(s), k,
                    self.dtype) / math.sqrt(self.d_model)  # (B, L, m)
    h = jax.nn.gelu(h).astype(self.dtype)
    y = lowp_einsum("blm,bmd->bld", h, v, self.dtype)  # (B, L, D)
    return s.astype(self.dtype) + y.astype(self.dtype)

  def packed(self, x_sum: jax.Array, s: jax.Array, to_tokens) -> jax.Array:
    """The same on packed rows: s (R, T, D), to_tokens maps per-user (B, ...) to each
    token's user (R, T, ...) -> (R, T, D)."""
    k = to_tokens(self.w_k(x_sum))  # (R, T, m, D)
    v = to_tokens(self.w_v(x_sum))  # (R, T, m, D)
    h = lowp_einsum("rtd,rtmd->rtm", self.norm(s), k,
                    self.dtype) / math.sqrt(self.d_model)  # (R, T, m)
    h = jax.nn.gelu(h).astype(self.dtype)
    y = lowp_einsum("rtm,rtmd->rtd", h, v, self.dtype)  # (R, T, D)
    return s.astype(self.dtype) + y.astype(self.dtype)


def sequence_branch_flops(L: int, d_model: int, *, num_x_summary: int = 4, num_cls: int = 4,
                          num_pma: int = 2, num_recent: int = 2, mask: str = "full",
                          block_size: int = 64, gating_hidden: int | None = None,
                          seq_layer: str = "attention") -> int:
  """Forward FLOPs of one SequenceBranch on a stream of L events.

  PFFN: 4 m D^2 + 4 L m D; attention (or HSTU) over c + L tokens; PMA over L tokens;
  S_sum gating: 4 (c + p + r) D h.
  """
  D, m = d_model, num_x_summary
  h = gating_hidden or D
  n_s = num_cls + num_pma + num_recent
  seq = hstu_flops if seq_layer == "hstu" else attention_flops
  return (4 * m * D * D + 4 * L * m * D
          + seq(num_cls + L, D, mask=mask, block_size=block_size)
          + (pma_flops(L, num_pma, D) if num_pma else 0)
          + 4 * n_s * D * h)


def interformer_flops(n: int, L: int | Sequence[int], d_model: int, *, num_x_summary: int = 4,
                      num_cls: int = 4, num_pma: int = 2, num_recent: int = 2,
                      mask: str = "full", block_size: int = 64,
                      gating_hidden: int | None = None, seq_layer: str = "attention") -> int:
  """Forward FLOPs of one InterFormerBlock, excluding the injected interaction module.

  L: the stream length, or one length per stream (one branch each).
  X_sum: 2 m n D (token mix) + 4 m D^2 (MLP) + 4 m D h (gating), once;
  plus sum_i sequence_branch_flops(L_i).
  """
  D, m = d_model, num_x_summary
  h = gating_hidden or D
  lengths = [L] if isinstance(L, int) else list(L)
  return (2 * m * n * D + 4 * m * D * D + 4 * m * D * h
          + sum(sequence_branch_flops(l, D, num_x_summary=m, num_cls=num_cls, num_pma=num_pma,
                                      num_recent=num_recent, mask=mask, block_size=block_size,
                                      gating_hidden=gating_hidden, seq_layer=seq_layer)
                for l in lengths))


class SequenceBranch(nnx.Module):
  """One stream's sequence arch and its summary S_sum,i (module docstring, per stream i).

  Args: as `InterFormerBlock` (the sequence-side ones).

  Call: (x_sum (B, m, D), s (B, L, D), valid bool (B, L), dt (B, L) or None)
  -> (s' (B, L, D), s_sum (B, c + p + r, D)).
  """

  def __init__(self, d_model: int, num_heads: int, num_x_summary: int, *, rngs: nnx.Rngs,
               num_cls: int = 4, num_pma: int = 2, num_recent: int = 2,
               score: str = "softmax", mask: str = "full", block_size: int = 64,
               rope: bool = False, time_buckets: int = 0, qk_norm: bool = True,
               recent_first: bool = True, gating_hidden: int | None = None,
               seq_layer: str = "attention", impl: AttentionImpl = AttentionImpl(),
               dtype: Dtype = jnp.float32, param_dtype: Dtype = jnp.float32, fp8: bool = False,
               remat: str | None = None):
    if seq_layer not in SEQ_LAYERS:
      raise ValueError(f"seq_layer={seq_layer!r}: expected one of {SEQ_LAYERS}")
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.num_cls, self.num_recent = num_cls, num_recent
    self.n_s_summary = num_cls + num_pma + num_recent
    self.dtype, self.remat = dtype, remat
    # Sequence arch.
    self.pffn = PFFN(d_model, num_x_summary, fp8=fp8, **kw)
    self.cls = (param(rngs, nnx.initializers.normal(0.02), (num_cls, d_model), param_dtype,
                      ("lookup", "lookup")) if num_cls else None)
    if seq_layer == "hstu":
      self.attn_norm = self.attn = None
      self.hstu = HSTU(d_model, num_heads, mask=mask, block_size=block_size,
                       recent_first=recent_first, time_buckets=time_buckets, impl=impl,
                       fp8=fp8, **kw)
    else:
      self.hstu = None
      self.attn_norm = LayerNorm(d_model, **kw)
      self.attn = Attention(d_model, num_heads, score=score, qk_norm=qk_norm, rope=rope,
                            time_buckets=time_buckets, mask=mask, block_size=block_size,
                            recent_first=recent_first, impl=impl, fp8=fp8, **kw)
    # Cross arch, this stream's summary.
    self.pma = PMA(d_model, num_pma, num_heads, score=score, qk_norm=qk_norm, impl=impl,
                   fp8=fp8, **kw) if num_pma else None
    self.s_norm = LayerNorm(d_model, **kw)
    self.s_gate = Gating(d_model, hidden=gating_hidden, fp8=fp8, **kw)

  def sequence(self, x_sum, s, valid, dt):
    """[S_CLS ; S'] = [C ; U] + Attention(LN([C ; U])), U = PFFN(X_sum, S).

    Returns (S_CLS (B, c, D), S' (B, L, D)).
    """
    B, L, D = s.shape
    u = self.pffn(x_sum, s.astype(self.dtype))  # (B, L, D)
    c = self.num_cls
    if c:
      cls = jnp.broadcast_to(self.cls[...].astype(self.dtype), (B, c, D))
      u = jnp.concatenate([cls, u], axis=1)  # (B, c + L, D)
      valid = jnp.concatenate([jnp.ones((B, c), bool), valid], axis=1)  # (B, c + L)
      if dt is not None:
        dt = jnp.concatenate([jnp.zeros((B, c), jnp.float32), dt.astype(jnp.float32)], axis=1)
    if self.hstu is not None:
      u = self.hstu(u, valid, dt if self.hstu.time_bias is not None else None)  # (B, c + L, D)
    else:
      u = u + self.attn(self.attn_norm(u), valid, dt)  # (B, c + L, D)
    s_cls, s_out = jnp.split(u, [c], axis=1)  # a split: its backward is one concatenate
    return s_cls, s_out

  def summary(self, s_cls: jax.Array, s: jax.Array, valid: jax.Array) -> jax.Array:
    """S_sum,i = Gating(LN([S_CLS ; PMA(S) ; S_recent])) -> (B, c + p + r, D)."""
    pooled = self.pma(s, valid) if self.pma is not None else None  # (B, p, D)
    r = self.num_recent
    return self._summarize(s_cls, pooled, s[:, :r], valid[:, :r])

  def _summarize(self, s_cls, pooled, rec, ok) -> jax.Array:
    """Gating(LN([S_CLS ; pooled ; rec])); rec (B, <= r, D) the newest events, ok valid."""
    B = s_cls.shape[0]
    parts = [s_cls]  # (B, c, D)
    if pooled is not None:
      parts.append(pooled)  # (B, p, D)
    r = self.num_recent
    if r:
      if rec.shape[1] < r:
        rec = jnp.pad(rec, [(0, 0), (0, r - rec.shape[1]), (0, 0)])
        ok = jnp.pad(ok, [(0, 0), (0, r - ok.shape[1])])
      parts.append(jnp.where(ok[:, :, None], rec, jnp.zeros((), rec.dtype)))  # (B, r, D)
    summary = self.s_norm(jnp.concatenate(parts, axis=1))  # (B, c + p + r, D)
    if r:  # keep the missing recent tokens at exactly 0 after the norm
      ok_all = jnp.concatenate([jnp.ones((B, self.n_s_summary - r), bool), ok], axis=1)
      summary = jnp.where(ok_all[:, :, None], summary, jnp.zeros((), summary.dtype))
    return self.s_gate(summary)  # (B, c + p + r, D)

  def __call__(self, x_sum: jax.Array, s: jax.Array, valid: jax.Array,
               dt: jax.Array | None = None):
    s_cls, s_new = remat_call(type(self).sequence, self.remat, self, x_sum, s, valid,
                              dt)  # (B, c, D), (B, L, D)
    return s_new, self.summary(s_cls, s_new, valid)  # (B, L, D), (B, c + p + r, D)

  def packed_sequence(self, x_sum, s, dt, pk: packed.Packing, *, keep: int):
    """`sequence` on packed rows: s, dt (R, T, ...) with CLS slots, events kept: the newest
    `keep` of each user. Returns S' (R, T, D) (CLS outputs in their slots)."""
    c = self.num_cls
    G, R, T = pk.user.shape
    slot = pk.slot.reshape(G * R, T)
    valid = (pk.valid & (pk.slot < c + keep)).reshape(G * R, T)  # (R, T)
    seg = pk.seg.reshape(G * R, T)
    u = self.pffn.packed(x_sum, s.astype(self.dtype), lambda t: packed.per_token(pk, t))
    if c:
      is_cls = slot < c  # (R, T)
      cls = jnp.take(self.cls[...].astype(self.dtype), jnp.minimum(slot, c - 1), axis=0)
      u = jnp.where(is_cls[..., None], cls, u)  # (R, T, D)
      if dt is not None:
        dt = jnp.where(is_cls, 0.0, dt.astype(jnp.float32))
    norm = float(c + keep)  # the padded path's key length
    if self.hstu is not None:
      u = self.hstu(u, valid, dt if self.hstu.time_bias is not None else None, seg=seg,
                    pos=slot, norm=norm)  # (R, T, D)
    else:
      u = u + self.attn(self.attn_norm(u), valid, dt, seg=seg, pos=slot, norm=norm)
    return u

  def packed(self, x_sum, s, dt, pk: packed.Packing, keep: int):
    """`__call__` on packed rows -> (S' (R, T, D), s_sum (B, c + p + r, D)).

    S_CLS, the PMA's keys and values (computed per token, packed) and the recent events
    are unpacked per user; only those tensors of (B, keep) tokens are padded."""
    c, r = self.num_cls, self.num_recent
    u = remat_call(functools.partial(type(self).packed_sequence, keep=keep), self.remat, self,
                   x_sum, s, dt, pk)  # (R, T, D)
    lengths = jnp.minimum(pk.lengths.reshape(-1), keep)  # (B,)
    s_cls = packed.unpack(pk, u, 0, c)  # (B, c, D)
    pooled = None
    if self.pma is not None:
      kh, vh = self.pma.kv_heads(u)  # (R, T, H, dh)
      ev = jnp.arange(keep)[None, :] < lengths[:, None]  # (B, keep)
      pooled = self.pma.pool(packed.unpack(pk, kh, c, c + keep),
                             packed.unpack(pk, vh, c, c + keep), ev)  # (B, p, D)
    k = min(r, keep)
    rec = packed.unpack(pk, u, c, c + k)  # (B, k, D)
    ok = jnp.arange(k)[None, :] < lengths[:, None]  # (B, k)
    return u, self._summarize(s_cls, pooled, rec, ok)


class InterFormerBlock(nnx.Module):
  """One InterFormer block over K parallel stream branches (module docstring).

  Args:
    d_model: D.  n_tokens: n, the number of non-sequence tokens X.
    num_heads: heads of the sequence attention and the PMA.
    interaction: an nnx.Module mapping (B, n + K (c + p + r), D) to (B, n', D) or
      (B, n' + K (c + p + r), D) (e.g. a Wukong layer); owned by this block.
    n_out_tokens: n', the tokens X' keeps (default n; a first block on the raw feature
      tokens may compress them).
    num_streams: K, one `SequenceBranch` (separate weights) per event stream.
    num_cls, num_pma, num_recent: c, p, r of each S_sum,i.  num_x_summary: m of X_sum.
    score, mask, block_size, rope, time_buckets, qk_norm, recent_first: the
      sequence attention (`Attention`), the same for every branch.
    gating_hidden: hidden width of the Gating MLPs (default D).
    seq_layer: 'attention' (default) or 'hstu' (the sequence arch's sublayer).
    impl: how the attention cores are computed (`AttentionImpl`: dense / chunked / cuDNN).
    dtype, param_dtype, fp8: precision policy.  remat: checkpointing of each
      branch's sequence arch (None, 'full', 'dots').

  Call, multi-stream: (x (B, n, D), *, streams=[(s_i (B, L_i, D), valid_i bool
  (B, L_i), dt_i (B, L_i) or None)] * K)
  -> (x' (B, n, D), [s'_i (B, L_i, D)] * K, x_sum (B, m, D), s_sum (B, K (c + p + r), D)).
  Call, single-stream (K = 1): (x, s (B, L, D), valid (B, L), dt (B, L) or None)
  -> (x', s' (B, L, D), x_sum, s_sum (B, c + p + r, D)).
  """

  def __init__(self, d_model: int, n_tokens: int, num_heads: int, *, interaction: nnx.Module,
               rngs: nnx.Rngs, num_streams: int = 1, num_cls: int = 4, num_pma: int = 2,
               num_recent: int = 2, num_x_summary: int = 4, score: str = "softmax",
               mask: str = "full", block_size: int = 64, rope: bool = False,
               time_buckets: int = 0, qk_norm: bool = True, recent_first: bool = True,
               gating_hidden: int | None = None, n_out_tokens: int | None = None,
               seq_layer: str = "attention", impl: AttentionImpl = AttentionImpl(),
               dtype: Dtype = jnp.float32, param_dtype: Dtype = jnp.float32, fp8: bool = False,
               remat: str | None = None):
    if num_streams < 1:
      raise ValueError(f"num_streams={num_streams}: need at least one stream")
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.n_tokens, self.num_streams = n_tokens, num_streams
    self.n_out_tokens = n_out_tokens or n_tokens
    self.time_buckets, self.dtype = time_buckets, dtype
    self.n_s_summary = num_streams * (num_cls + num_pma + num_recent)
    # Cross arch, non-sequence summary.
    self.x_mix = param(rngs, nnx.initializers.lecun_normal(), (n_tokens, num_x_summary),
                       param_dtype, (None, None))
    self.x_fc1 = Dense(d_model, d_model, fp8=fp8, kernel_axes=("embed", "mlp"), **kw)
    self.x_fc2 = Dense(d_model, d_model, fp8=fp8, kernel_axes=("mlp", "embed"), **kw)
    self.x_gate = Gating(d_model, hidden=gating_hidden, fp8=fp8, **kw)
    # Sequence arch and sequence summaries: one parallel branch per stream.
    self.branches = nnx.List([
        SequenceBranch(d_model, num_heads, num_x_summary, num_cls=num_cls, num_pma=num_pma,
                       num_recent=num_recent, score=score, mask=mask, block_size=block_size,
                       rope=rope, time_buckets=time_buckets, qk_norm=qk_norm,
                       recent_first=recent_first, gating_hidden=gating_hidden,
                       seq_layer=seq_layer, impl=impl, fp8=fp8, remat=remat, **kw)
        for _ in range(num_streams)])
    # Interaction arch.
    self.interaction = interaction

  def x_summary(self, x: jax.Array) -> jax.Array:
    """X_sum = Gating(MLP(X)): (B, n, D) -> (B, m, D)."""
    # 'bnd,nm->bdm' then a transpose: XLA:CPU has no bf16 x bf16 -> f32 kernel for the
    # non-canonical 'bnd,nm->bmd' layout.
    z = lowp_einsum("bnd,nm->bdm", x, self.x_mix[...], self.dtype).astype(self.dtype)  # (B, D, m)
    z = jnp.swapaxes(z, 1, 2)  # (B, m, D)
    z = self.x_fc2(jax.nn.gelu(self.x_fc1(z)))  # (B, m, D)
    return self.x_gate(z)  # (B, m, D)

  def __call__(self, x: jax.Array, s: jax.Array | None = None, valid: jax.Array | None = None,
               dt: jax.Array | None = None, *, streams: Sequence[tuple] | None = None):
    single = streams is None
    if single:
      if s is None or valid is None:
        raise ValueError("pass (s, valid[, dt]) or streams=[(s, valid, dt), ...]")
      streams = [(s, valid, dt)]
    elif s is not None:
      raise ValueError("pass either (s, valid, dt) or streams, not both")
    if len(streams) != self.num_streams:
      raise ValueError(f"got {len(streams)} streams, the block has {self.num_streams} branches")
    if x.shape[1] != self.n_tokens:
      raise ValueError(f"x has {x.shape[1]} tokens, expected {self.n_tokens}")
    if self.time_buckets and any(st[2] is None for st in streams):
      raise ValueError("time_buckets > 0 needs dt (B, L) for every stream")
    x_sum = self.x_summary(x)  # (B, m, D)
    outs = [branch(x_sum, s_i, v_i, dt_i)
            for branch, (s_i, v_i, dt_i) in zip(self.branches, streams)]
    s_new = [o[0] for o in outs]  # K x (B, L_i, D)
    s_sum = jnp.concatenate([o[1] for o in outs], axis=1)  # (B, K (c + p + r), D)
    x_new = self._interact(x, s_sum)
    return x_new, (s_new[0] if single else s_new), x_sum, s_sum

  def packed(self, x: jax.Array, streams: Sequence[tuple]):
    """The block on packed streams [(s_i (R_i, T_i, D), dt_i or None, Packing_i, keep_i)]
    -> (x', [s'_i (R_i, T_i, D)], x_sum, s_sum): the same values as `__call__`."""
    if len(streams) != self.num_streams:
      raise ValueError(f"got {len(streams)} streams, the block has {self.num_streams} branches")
    x_sum = self.x_summary(x)  # (B, m, D)
    outs = [branch.packed(x_sum, s_i, dt_i, pk_i, keep_i)
            for branch, (s_i, dt_i, pk_i, keep_i) in zip(self.branches, streams)]
    s_sum = jnp.concatenate([o[1] for o in outs], axis=1)  # (B, K (c + p + r), D)
    return self._interact(x, s_sum), [o[0] for o in outs], x_sum, s_sum

  def _interact(self, x: jax.Array, s_sum: jax.Array) -> jax.Array:
    """X' = the first n' tokens of interaction([X ; S_sum])  -> (B, n', D)."""
    z = self.interaction(jnp.concatenate([x.astype(self.dtype), s_sum], axis=1))
    n_out = self.n_out_tokens
    if z.shape[1] not in (n_out, n_out + self.n_s_summary):
      raise ValueError(f"interaction returned {z.shape[1]} tokens; expected {n_out} "
                       f"or {n_out + self.n_s_summary}")
    return z[:, :n_out].astype(self.dtype)  # (B, n', D)
