"""Chunked (flash-style) attention: memory linear in the sequence length.

The same function as the dense core of `gem_jax.layers.attention` for the 'full'
and 'causal' masks (block-local attention is block-diagonal and already linear),
computed one key chunk of c tokens at a time so that no (Lq, Lk) tensor exists,
in the forward or the backward pass. Per key chunk C (all queries at once):

  s_C = scale * q k_C^T + bias_C                     (B, H, Lq, c)   fp32
  softmax (online): m' = max(m, rowmax s_C), l' = e^{m - m'} l + rowsum e^{s_C - m'},
    acc' = e^{m - m'} acc + e^{s_C - m'} v_C;   out = acc / l,  lse = m + log l
  silu:   acc' = acc + (silu(s_C) / N) v_C;      out = acc

with disallowed entries (invalid key, causal, other segment) replaced by -inf
(softmax) or weight 0 (silu), exactly as the dense path does. A row with no
allowed key gives 0.

Gradients (a custom VJP that recomputes s_C per chunk; residuals q, k, v, out,
lse: linear in L). With dO the output cotangent:
  softmax: P_C = e^{s_C - lse},  dV_C = P_C^T dO,  dP_C = dO V_C^T,
           dS_C = P_C * (dP_C - rowsum(dO * out))
  silu:    A_C = silu(s_C) / N,  dV_C = A_C^T dO,  dS_C = (dO V_C^T) * silu'(s_C) / N
  dQ = scale sum_C dS_C K_C,  dK_C = scale dS_C^T Q,  d table[b] = sum of dS_C over
  the entries whose bias bucket is b.
Memory per step: O(B H Lq c); total O(B H L (dh + c)).

Biases (both optional, fp32, per head):
  * time:     time_table[bucket(dt_q_i - dt_k_j)] (dt_q None: bucket(dt_k_j)),
    bucket = `time_bucket` (log2 seconds);
  * position: pos_table[min(|pos_q_i - pos_k_j|, P - 1)], P = pos_table rows
    (positions default to 0..L-1; packed sequences pass positions in the segment).
Segments: with seg_q (B, Lq) and seg_k (B, Lk), key j is allowed for query i only
when seg_q_i == seg_k_j (several sequences packed in one row).

Precision: scores, softmax statistics and accumulators in fp32; the operands of the
four matmuls in the compute dtype (q's dtype) with fp32 accumulation, as
`lowp_einsum` does in the dense path.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


def time_bucket(delta: jax.Array, num_buckets: int) -> jax.Array:
  """min(num_buckets - 1, floor(log2(1 + |delta|))) as int32, delta in seconds."""
  b = jnp.floor(jnp.log2(1.0 + jnp.abs(delta.astype(jnp.float32))))
  return jnp.clip(b, 0, num_buckets - 1).astype(jnp.int32)


def pos_bucket(pos_q: jax.Array, pos_k: jax.Array, num_buckets: int) -> jax.Array:
  """min(|pos_q_i - pos_k_j|, P - 1): (..., Lq) x (..., Lk) -> (..., Lq, Lk) int32."""
  d = jnp.abs(pos_q[..., :, None].astype(jnp.int32) - pos_k[..., None, :].astype(jnp.int32))
  return jnp.minimum(d, num_buckets - 1)


class Bias(NamedTuple):
  """Inputs of the relative biases and the segment mask (any field may be None)."""
  time_table: jax.Array | None = None  # (NB, H)
  dt_q: jax.Array | None = None  # (B, Lq) seconds
  dt_k: jax.Array | None = None  # (B, Lk)
  pos_table: jax.Array | None = None  # (P, H)
  pos_q: jax.Array | None = None  # (B, Lq) int
  pos_k: jax.Array | None = None  # (B, Lk) int
  seg_q: jax.Array | None = None  # (B, Lq) int
  seg_k: jax.Array | None = None  # (B, Lk) int


def bias_buckets(b: Bias):
  """Bucket ids of the two biases: ((..., Lq|1, Lk) or None, (..., Lq, Lk) or None)."""
  tb = pb = None
  if b.time_table is not None:
    dk = b.dt_k.astype(jnp.float32)[..., None, :]  # (..., 1, Lk)
    delta = dk if b.dt_q is None else b.dt_q.astype(jnp.float32)[..., :, None] - dk
    tb = time_bucket(delta, b.time_table.shape[0])  # (..., Lq|1, Lk)
  if b.pos_table is not None:
    pb = pos_bucket(b.pos_q, b.pos_k, b.pos_table.shape[0])  # (..., Lq, Lk)
  return tb, pb


def bias_values(b: Bias, tb, pb):
  """Sum of the bias terms, (..., H, Lq|1, Lk) fp32, or None."""
  out = None
  for table, idx in ((b.time_table, tb), (b.pos_table, pb)):
    if table is not None:
      t = jnp.moveaxis(table.astype(jnp.float32)[idx], -1, -3)  # (..., H, Lq|1, Lk)
      out = t if out is None else out + t
  return out


def segment_allowed(b: Bias):
  """seg_q_i == seg_k_j as (..., 1, Lq, Lk), or None."""
  if b.seg_q is None:
    return None
  return (b.seg_q[..., :, None] == b.seg_k[..., None, :])[..., None, :, :]


class _Cfg(NamedTuple):
  score: str
  scale: float
  norm: float
  causal: bool
  recent_first: bool
  chunk: int


def _pad_keys(x, pad, fill=0):
  return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)


def _chunks(x, n, c):
  """(B, n c, ...) -> (n, B, c, ...): the scan's xs."""
  return jnp.moveaxis(x.reshape((x.shape[0], n, c) + x.shape[2:]), 1, 0)


def _key_chunks(cfg, k, v, k_valid, bias: Bias):
  """Pads Lk to a multiple of c with invalid keys and splits every key-side input."""
  Lk, c = k.shape[1], cfg.chunk
  n = -(-Lk // c)
  pad = n * c - Lk
  xs = dict(k=_chunks(_pad_keys(k, pad), n, c), v=_chunks(_pad_keys(v, pad), n, c),
            valid=_chunks(_pad_keys(k_valid, pad, False), n, c),
            j=jnp.arange(n * c).reshape(n, c))
  for name in ("dt_k", "pos_k", "seg_k"):
    a = getattr(bias, name)
    if a is not None:
      xs[name] = _chunks(_pad_keys(a, pad), n, c)
  return xs, n, pad


def _chunk_scores(cfg, qh, bias: Bias, x):
  """One key chunk: scores (B, H, Lq, c) fp32, allowed mask, bucket ids."""
  Lq = qh.shape[2]
  kh = jnp.moveaxis(x["k"], 1, 2)  # (B, H, c, dh)
  s = jnp.einsum("bhqd,bhkd->bhqk", qh, kh.astype(qh.dtype),
                 preferred_element_type=jnp.float32) * cfg.scale  # (B, H, Lq, c)
  bc = bias._replace(dt_k=x.get("dt_k"), pos_k=x.get("pos_k"), seg_k=x.get("seg_k"))
  tb, pb = bias_buckets(bc)
  bv = bias_values(bc, tb, pb)
  if bv is not None:
    s = s + bv
  allowed = x["valid"][:, None, None, :]  # (B, 1, 1, c)
  if cfg.causal:
    i = jnp.arange(Lq)[:, None]
    j = x["j"][None, :]
    allowed = allowed & ((j >= i) if cfg.recent_first else (j <= i))  # (B, 1, Lq, c)
  seg = segment_allowed(bc)
  if seg is not None:
    allowed = allowed & seg  # (B, 1, Lq, c)
  return s, allowed, tb, pb


def _forward(cfg, q, k, v, k_valid, bias):
  """Returns out (B, H, Lq, dh) fp32 and lse (B, H, Lq) fp32 (softmax; zeros for silu)."""
  qh = jnp.moveaxis(q, 1, 2)  # (B, H, Lq, dh)
  B, H, Lq, dh = qh.shape
  xs, _, _ = _key_chunks(cfg, k, v, k_valid, bias)
  cdt = q.dtype

  def step(carry, x):
    m, l, acc = carry  # (B, H, Lq), (B, H, Lq), (B, H, Lq, dh)
    s, allowed, _, _ = _chunk_scores(cfg, qh, bias, x)
    vh = jnp.moveaxis(x["v"], 1, 2).astype(cdt)  # (B, H, c, dh)
    if cfg.score == "softmax":
      s = jnp.where(allowed, s, -jnp.inf)
      m_new = jnp.maximum(m, jnp.max(s, axis=-1))  # (B, H, Lq)
      m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
      alpha = jnp.exp(m - m_safe)  # exp(-inf) = 0 before the first allowed key
      p = jnp.exp(s - m_safe[..., None])  # (B, H, Lq, c)
      l = alpha * l + jnp.sum(p, axis=-1)
      acc = alpha[..., None] * acc + jnp.einsum("bhqk,bhkd->bhqd", p.astype(cdt), vh,
                                                preferred_element_type=jnp.float32)
      return (m_new, l, acc), None
    a = jnp.where(allowed, jax.nn.silu(s), 0.0) / cfg.norm  # (B, H, Lq, c)
    acc = acc + jnp.einsum("bhqk,bhkd->bhqd", a.astype(cdt), vh,
                           preferred_element_type=jnp.float32)
    return (m, l, acc), None

  init = (jnp.full((B, H, Lq), -jnp.inf, jnp.float32), jnp.zeros((B, H, Lq), jnp.float32),
          jnp.zeros((B, H, Lq, dh), jnp.float32))
  (m, l, acc), _ = jax.lax.scan(step, init, xs)
  if cfg.score == "softmax":
    ok = l > 0
    out = acc / jnp.where(ok, l, 1.0)[..., None]  # (B, H, Lq, dh)
    lse = jnp.where(ok, jnp.where(jnp.isfinite(m), m, 0.0) + jnp.log(jnp.where(ok, l, 1.0)),
                    jnp.inf)  # (B, H, Lq); +inf: every weight of an empty row is 0
    return out, lse
  return acc, jnp.zeros((B, H, Lq), jnp.float32)


def _table_grad(table, idx, ds):
  """d table (NB, H) = scatter-add of ds (B, H, Lq, c) at idx (B, Lq|1, c)."""
  if idx.shape[-2] == 1 and ds.shape[-2] != 1:
    ds = jnp.sum(ds, axis=-2, keepdims=True)  # (B, H, 1, c)
  upd = jnp.moveaxis(ds, 1, -1)  # (B, Lq|1, c, H)
  return jnp.zeros(table.shape, jnp.float32).at[idx].add(upd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg, q, k, v, k_valid, bias):
  out, _ = _forward(cfg, q, k, v, k_valid, bias)
  return out


def _flash_fwd(cfg, q, k, v, k_valid, bias):
  out, lse = _forward(cfg, q, k, v, k_valid, bias)
  return out, (q, k, v, k_valid, bias, out, lse)


def _flash_bwd(cfg, res, g):
  q, k, v, k_valid, bias, out, lse = res
  qh = jnp.moveaxis(q, 1, 2)  # (B, H, Lq, dh)
  cdt = q.dtype
  Lk = k.shape[1]
  xs, n, pad = _key_chunks(cfg, k, v, k_valid, bias)
  do = g.astype(jnp.float32)  # (B, H, Lq, dh)
  delta = jnp.sum(do * out, axis=-1)  # (B, H, Lq)
  doc = do.astype(cdt)

  def step(carry, x):
    dq, dtt, dpt = carry
    s, allowed, tb, pb = _chunk_scores(cfg, qh, bias, x)
    vh = jnp.moveaxis(x["v"], 1, 2).astype(cdt)  # (B, H, c, dh)
    kh = jnp.moveaxis(x["k"], 1, 2).astype(cdt)  # (B, H, c, dh)
    dp = jnp.einsum("bhqd,bhkd->bhqk", doc, vh,
                    preferred_element_type=jnp.float32)  # (B, H, Lq, c)
    if cfg.score == "softmax":
      p = jnp.where(allowed, jnp.exp(s - lse[..., None]), 0.0)  # (B, H, Lq, c)
      ds = p * (dp - delta[..., None])
    else:
      sig = jax.nn.sigmoid(s)
      p = jnp.where(allowed, s * sig, 0.0) / cfg.norm
      ds = jnp.where(allowed, dp * sig * (1.0 + s * (1.0 - sig)), 0.0) / cfg.norm
    dv = jnp.einsum("bhqk,bhqd->bhkd", p.astype(cdt), doc,
                    preferred_element_type=jnp.float32)  # (B, H, c, dh)
    dk = jnp.einsum("bhqk,bhqd->bhkd", ds.astype(cdt), qh,
                    preferred_element_type=jnp.float32) * cfg.scale  # (B, H, c, dh)
    dq = dq + jnp.einsum("bhqk,bhkd->bhqd", ds.astype(cdt), kh,
                         preferred_element_type=jnp.float32) * cfg.scale
    if tb is not None:
      dtt = dtt + _table_grad(bias.time_table, tb, ds)
    if pb is not None:
      dpt = dpt + _table_grad(bias.pos_table, pb, ds)
    return (dq, dtt, dpt), (jnp.moveaxis(dk, 1, 2), jnp.moveaxis(dv, 1, 2))  # (B, c, H, dh)

  zt = lambda t: jnp.zeros(t.shape, jnp.float32) if t is not None else jnp.zeros(())
  init = (jnp.zeros(qh.shape, jnp.float32), zt(bias.time_table), zt(bias.pos_table))
  (dq, dtt, dpt), (dk, dv) = jax.lax.scan(step, init, xs)  # dk, dv: (n, B, c, H, dh)

  def unchunk(t):  # (n, B, c, H, dh) -> (B, Lk, H, dh)
    t = jnp.moveaxis(t, 0, 1)
    return t.reshape((t.shape[0], n * t.shape[2]) + t.shape[3:])[:, :Lk]

  dbias = _zero_cotangents(bias)._replace(
      time_table=None if bias.time_table is None else dtt.astype(bias.time_table.dtype),
      pos_table=None if bias.pos_table is None else dpt.astype(bias.pos_table.dtype))
  return (jnp.moveaxis(dq, 1, 2).astype(q.dtype), unchunk(dk).astype(k.dtype),
          unchunk(dv).astype(v.dtype), _zeros_like(k_valid), dbias)


def _zeros_like(x):
  """The zero cotangent of a non-differentiable input (float0 for bool / int)."""
  if x is None:
    return None
  if jnp.issubdtype(x.dtype, jnp.floating):
    return jnp.zeros(x.shape, x.dtype)
  return np.zeros(x.shape, jax.dtypes.float0)


def _zero_cotangents(bias: Bias) -> Bias:
  return Bias(*(_zeros_like(a) for a in bias))


_flash.defvjp(_flash_fwd, _flash_bwd)


def chunked_attention(q: jax.Array, k: jax.Array, v: jax.Array, k_valid: jax.Array,
                      bias: Bias = Bias(), *, score: str = "softmax", scale: float = 1.0,
                      norm: float = 1.0, causal: bool = False, recent_first: bool = True,
                      chunk: int = 256, dtype=None) -> jax.Array:
  """Memory-linear attention core (module docstring).

  Args:
    q: (B, Lq, H, dh); k, v: (B, Lk, H, dh); k_valid: bool (B, Lk).
    bias: the `Bias` inputs (tables, dt, positions, segments).
    score: 'softmax' | 'silu'; scale: logit scale; norm: N of the silu score.
    causal, recent_first: the causal mask (key j >= query i when recent_first).
    chunk: key tokens per step c.
    dtype: output dtype (default q.dtype).
  Returns:
    (B, Lq, H, dh) in dtype.
  """
  cfg = _Cfg(score, float(scale), float(norm), bool(causal), bool(recent_first), int(chunk))
  if bias.time_table is not None and bias.dt_k is None:
    raise ValueError("a time bias needs dt_k")
  if bias.pos_table is not None:
    B, Lq, Lk = q.shape[0], q.shape[1], k.shape[1]
    pq = bias.pos_q if bias.pos_q is not None else jnp.broadcast_to(jnp.arange(Lq), (B, Lq))
    pk = bias.pos_k if bias.pos_k is not None else jnp.broadcast_to(jnp.arange(Lk), (B, Lk))
    bias = bias._replace(pos_q=pq, pos_k=pk)
  if (bias.seg_q is None) != (bias.seg_k is None):
    raise ValueError("pass both seg_q and seg_k, or neither")
  out = _flash(cfg, q, k, v, k_valid, bias)  # (B, H, Lq, dh) fp32
  return jnp.moveaxis(out, 1, 2).astype(dtype or q.dtype)  # (B, Lq, H, dh)
