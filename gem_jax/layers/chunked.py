"""Chunked (flash-style) attention: memory linear in the sequence length.

The same function as the dense core of `gem_jax.layers.attention` for the 'full'
and 'causal' masks (block-local attention is block-diagonal and already linear),
computed on tiles of cq queries x ck keys (cq = min(chunk, Lq), ck = min(chunk, Lk)) so
that no (Lq, Lk) tensor exists, in the forward or the backward pass. For a query tile
Q and its key tiles C in order:

  s_C = scale * Q k_C^T + bias_C                     (B, H, cq, ck)   fp32
  softmax (online): m' = max(m, rowmax s_C), l' = e^{m - m'} l + rowsum e^{s_C - m'},
    acc' = e^{m - m'} acc + e^{s_C - m'} v_C;   out = acc / l,  lse = m + log l
  silu:   acc' = acc + (silu(s_C) / N) v_C;      out = acc

with disallowed entries (invalid key, causal, other segment) replaced by -inf
(softmax) or weight 0 (silu), exactly as the dense path does. A row with no
allowed key gives 0. A tile pair with no allowed entry in any row (a key tile without
valid keys, the empty half of a causal mask, tiles of disjoint segment ranges in packed
rows) is skipped (`lax.cond`), so causal attention costs about half the dense FLOPs and a
packed row about the sum of its segments' squares (segment ids increasing along a row).

Gradients (a custom VJP that recomputes s_C per tile pair; residuals q, k, v, out,
lse: linear in L). With dO the output cotangent:
  softmax: P_C = e^{s_C - lse},  dV_C = P_C^T dO,  dP_C = dO V_C^T,
           dS_C = P_C * (dP_C - rowsum(dO * out))
  silu:    A_C = silu(s_C) / N,  dV_C = A_C^T dO,  dS_C = (dO V_C^T) * silu'(s_C) / N
  dQ = scale sum_C dS_C K_C,  dK_C = scale dS_C^T Q,  d table[b] = sum of dS_C over
  the entries whose bias bucket is b (outer loop over key tiles, inner over query tiles).
Memory per step: O(B H cq ck); total O(B H L (dh + chunk)).

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


def _split(x, n, c, fill=0, edge=False):
  """(B, L, ...) -> (n, B, c, ...), L padded to n c (with `fill`, or the last value)."""
  pad = [(0, 0), (0, n * c - x.shape[1])] + [(0, 0)] * (x.ndim - 2)
  x = jnp.pad(x, pad, mode="edge") if edge else jnp.pad(x, pad, constant_values=fill)
  return jnp.moveaxis(x.reshape((x.shape[0], n, c) + x.shape[2:]), 1, 0)


def _tiles(cfg, q, k, v, k_valid, bias: Bias):
  """Query tiles (nq, B, cq, ...), key tiles (nk, B, ck, ...), need (nq, nk) bool.

  need[a, b] is False only where no (query, key) pair of tile a x tile b is allowed in any
  row: no valid key, causal order, or disjoint segment ranges (a conservative test).
  """
  Lq, Lk = q.shape[1], k.shape[1]
  cq, ck = min(cfg.chunk, Lq), min(cfg.chunk, Lk)
  nq, nk = -(-Lq // cq), -(-Lk // ck)
  qs = dict(q=_split(q, nq, cq), i=jnp.arange(nq * cq).reshape(nq, cq))
  ks = dict(k=_split(k, nk, ck), v=_split(v, nk, ck), valid=_split(k_valid, nk, ck, False),
            j=jnp.arange(nk * ck).reshape(nk, ck))
  for name in ("dt_q", "pos_q", "seg_q"):
    if getattr(bias, name) is not None:
      qs[name] = _split(getattr(bias, name), nq, cq, edge=True)
  for name in ("dt_k", "pos_k", "seg_k"):
    if getattr(bias, name) is not None:
      ks[name] = _split(getattr(bias, name), nk, ck)
  need = jnp.broadcast_to(ks["valid"].any(axis=2)[None], (nq, nk, q.shape[0]))  # (nq, nk, B)
  if cfg.causal:
    i0 = jnp.arange(nq)[:, None] * cq
    j0 = jnp.arange(nk)[None, :] * ck
    order = (j0 + ck - 1 >= i0) if cfg.recent_first else (j0 <= i0 + cq - 1)  # (nq, nk)
    need = need & order[:, :, None]
  if bias.seg_q is not None:
    big = jnp.iinfo(jnp.int32).max
    sk = ks["seg_k"].astype(jnp.int32)
    k_lo = jnp.where(ks["valid"], sk, big).min(axis=2)  # (nk, B)
    k_hi = jnp.where(ks["valid"], sk, -big).max(axis=2)
    q_lo, q_hi = qs["seg_q"].min(axis=2), qs["seg_q"].max(axis=2)  # (nq, B)
    need = need & (q_lo[:, None] <= k_hi[None]) & (k_lo[None] <= q_hi[:, None])
  return qs, ks, need.any(axis=-1), (nq, cq, nk, ck)


def _block_scores(cfg, qx, bias: Bias, kx):
  """One tile pair: scores (B, H, cq, ck) fp32, allowed mask, bucket ids."""
  qh = jnp.moveaxis(qx["q"], 1, 2)  # (B, H, cq, dh)
  kh = jnp.moveaxis(kx["k"], 1, 2)  # (B, H, ck, dh)
  s = jnp.einsum("bhqd,bhkd->bhqk", qh, kh.astype(qh.dtype),
                 preferred_element_type=jnp.float32) * cfg.scale  # (B, H, cq, ck)
  bc = bias._replace(dt_q=qx.get("dt_q"), pos_q=qx.get("pos_q"), seg_q=qx.get("seg_q"),
                     dt_k=kx.get("dt_k"), pos_k=kx.get("pos_k"), seg_k=kx.get("seg_k"))
  tb, pb = bias_buckets(bc)
  bv = bias_values(bc, tb, pb)
  if bv is not None:
    s = s + bv
  allowed = kx["valid"][:, None, None, :]  # (B, 1, 1, ck)
  if cfg.causal:
    i, j = qx["i"][:, None], kx["j"][None, :]
    allowed = allowed & ((j >= i) if cfg.recent_first else (j <= i))  # (B, 1, cq, ck)
  seg = segment_allowed(bc)
  if seg is not None:
    allowed = allowed & seg  # (B, 1, cq, ck)
  return s, allowed, tb, pb


def _untile(t, n_len):
  """(n, B, H, c, ...) -> (B, H, n c, ...)[:, :, :n_len]."""
  t = jnp.moveaxis(t, 0, 2)  # (B, H, n, c, ...)
  return t.reshape(t.shape[:2] + (-1,) + t.shape[4:])[:, :, :n_len]


def _forward(cfg, q, k, v, k_valid, bias):
  """Returns out (B, H, Lq, dh) fp32 and lse (B, H, Lq) fp32 (softmax; zeros for silu)."""
  B, Lq, H, dh = q.shape
  qs, ks, need, (_, cq, _, _) = _tiles(cfg, q, k, v, k_valid, bias)
  cdt = q.dtype

  def q_tile(args):
    qx, need_row = args

    def block(carry, kx):
      m, l, acc = carry  # (B, H, cq), (B, H, cq), (B, H, cq, dh)
      s, allowed, _, _ = _block_scores(cfg, qx, bias, kx)
      vh = jnp.moveaxis(kx["v"], 1, 2).astype(cdt)  # (B, H, ck, dh)
      if cfg.score == "softmax":
        s = jnp.where(allowed, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))  # (B, H, cq)
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        alpha = jnp.exp(m - m_safe)  # exp(-inf) = 0 before the first allowed key
        p = jnp.exp(s - m_safe[..., None])  # (B, H, cq, ck)
        l = alpha * l + jnp.sum(p, axis=-1)
        acc = alpha[..., None] * acc + jnp.einsum("bhqk,bhkd->bhqd", p.astype(cdt), vh,
                                                  preferred_element_type=jnp.float32)
        return m_new, l, acc
      a = jnp.where(allowed, jax.nn.silu(s), 0.0) / cfg.norm  # (B, H, cq, ck)
      return m, l, acc + jnp.einsum("bhqk,bhkd->bhqd", a.astype(cdt), vh,
                                    preferred_element_type=jnp.float32)

    def step(carry, x):
      kx, nd = x
      return jax.lax.cond(nd, lambda c: block(c, kx), lambda c: c, carry), None

    init = (jnp.full((B, H, cq), -jnp.inf, jnp.float32), jnp.zeros((B, H, cq), jnp.float32),
            jnp.zeros((B, H, cq, dh), jnp.float32))
    (m, l, acc), _ = jax.lax.scan(step, init, (ks, need_row))
    if cfg.score == "softmax":
      ok = l > 0
      out = acc / jnp.where(ok, l, 1.0)[..., None]  # (B, H, cq, dh)
      lse = jnp.where(ok, jnp.where(jnp.isfinite(m), m, 0.0) + jnp.log(jnp.where(ok, l, 1.0)),
                      jnp.inf)  # (B, H, cq); +inf: every weight of an empty row is 0
      return out, lse
    return acc, jnp.zeros((B, H, cq), jnp.float32)

  out, lse = jax.lax.map(q_tile, (qs, need))  # (nq, B, H, cq, dh), (nq, B, H, cq)
  return _untile(out, Lq), _untile(lse, Lq)


def _table_grad(table, idx, ds):
  """d table (NB, H) = scatter-add of ds (B, H, cq, ck) at idx (B, cq|1, ck)."""
  if idx.shape[-2] == 1 and ds.shape[-2] != 1:
    ds = jnp.sum(ds, axis=-2, keepdims=True)  # (B, H, 1, ck)
  upd = jnp.moveaxis(ds, 1, -1)  # (B, cq|1, ck, H)
  return jnp.zeros(table.shape, jnp.float32).at[idx].add(upd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg, q, k, v, k_valid, bias):
  out, _ = _forward(cfg, q, k, v, k_valid, bias)
  return out


def _flash_fwd(cfg, q, k, v, k_valid, bias):
  out, lse = _forward(cfg, q, k, v, k_valid, bias)
  return out, (q, k, v, k_valid, bias, out, lse)


def _flash_bwd(cfg, res, g):
  """Outer loop over key tiles (dK, dV of the tile), inner over query tiles (dQ added)."""
  q, k, v, k_valid, bias, out, lse = res
  B, Lq, H, dh = q.shape
  Lk = k.shape[1]
  cdt = q.dtype
  qs, ks, need, (nq, cq, nk, ck) = _tiles(cfg, q, k, v, k_valid, bias)
  do = g.astype(jnp.float32)  # (B, H, Lq, dh)
  delta = jnp.sum(do * out, axis=-1)  # (B, H, Lq)

  def qtiles(t, fill=0.0):  # (B, H, Lq, ...) -> (nq, B, H, cq, ...)
    t = jnp.moveaxis(t, 2, 1)  # (B, Lq, H, ...)
    return jnp.moveaxis(_split(t, nq, cq, fill), 2, 3)

  # Padded query rows: do = 0 and lse = +inf, so they add exactly 0 everywhere.
  qs = dict(qs, do=qtiles(do.astype(cdt)), lse=qtiles(lse, jnp.inf), delta=qtiles(delta),
            n=jnp.arange(nq))

  def block(carry, qx, kx):
    dk, dv, dtt, dpt, dq = carry
    s, allowed, tb, pb = _block_scores(cfg, qx, bias, kx)
    qh = jnp.moveaxis(qx["q"], 1, 2).astype(cdt)  # (B, H, cq, dh)
    kh = jnp.moveaxis(kx["k"], 1, 2).astype(cdt)  # (B, H, ck, dh)
    vh = jnp.moveaxis(kx["v"], 1, 2).astype(cdt)
    doc = qx["do"]  # (B, H, cq, dh)
    dp = jnp.einsum("bhqd,bhkd->bhqk", doc, vh,
                    preferred_element_type=jnp.float32)  # (B, H, cq, ck)
    if cfg.score == "softmax":
      p = jnp.where(allowed, jnp.exp(s - qx["lse"][..., None]), 0.0)  # (B, H, cq, ck)
      ds = p * (dp - qx["delta"][..., None])
    else:
      sig = jax.nn.sigmoid(s)
      p = jnp.where(allowed, s * sig, 0.0) / cfg.norm
      ds = jnp.where(allowed, dp * sig * (1.0 + s * (1.0 - sig)), 0.0) / cfg.norm
    dv = dv + jnp.einsum("bhqk,bhqd->bhkd", p.astype(cdt), doc,
                         preferred_element_type=jnp.float32)  # (B, H, ck, dh)
    dk = dk + jnp.einsum("bhqk,bhqd->bhkd", ds.astype(cdt), qh,
                         preferred_element_type=jnp.float32) * cfg.scale
    dq_blk = jnp.einsum("bhqk,bhkd->bhqd", ds.astype(cdt), kh,
                        preferred_element_type=jnp.float32) * cfg.scale  # (B, H, cq, dh)
    dq = dq.at[qx["n"]].add(dq_blk)
    if tb is not None:
      dtt = dtt + _table_grad(bias.time_table, tb, ds)
    if pb is not None:
      dpt = dpt + _table_grad(bias.pos_table, pb, ds)
    return dk, dv, dtt, dpt, dq

  def k_tile(carry, x):
    kx, need_col = x
    dtt, dpt, dq = carry

    def step(c, y):
      qx, nd = y
      return jax.lax.cond(nd, lambda c: block(c, qx, kx), lambda c: c, c), None

    z = jnp.zeros((B, H, ck, dh), jnp.float32)
    (dk, dv, dtt, dpt, dq), _ = jax.lax.scan(step, (z, z, dtt, dpt, dq), (qs, need_col))
    return (dtt, dpt, dq), (dk, dv)

  zt = lambda t: jnp.zeros(t.shape, jnp.float32) if t is not None else jnp.zeros(())
  init = (zt(bias.time_table), zt(bias.pos_table), jnp.zeros((nq, B, H, cq, dh), jnp.float32))
  (dtt, dpt, dq), (dk, dv) = jax.lax.scan(k_tile, init, (ks, need.T))  # (nk, B, H, ck, dh)
  dbias = _zero_cotangents(bias)._replace(
      time_table=None if bias.time_table is None else dtt.astype(bias.time_table.dtype),
      pos_table=None if bias.pos_table is None else dpt.astype(bias.pos_table.dtype))
  back = lambda t, n, dtype: jnp.moveaxis(_untile(t, n), 1, 2).astype(dtype)  # (B, L, H, dh)
  return (back(dq, Lq, q.dtype), back(dk, Lk, k.dtype), back(dv, Lk, v.dtype),
          _zeros_like(k_valid), dbias)


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
    chunk: tile size (query and key tokens per step).
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
