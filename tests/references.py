"""Float64 NumPy references of every gem_jax block GEM is made of, and of GEM's forward.

Each reference takes `p`, a nested dict of float64 arrays (`params(module_or_state)`: the
module's nnx.Param leaves, keyed as in `nnx.to_pure_dict(state)`), and the block's
switches as plain arguments. They are written from the formulas of docs/model.md and
the layers' docstrings and call no gem_jax layer code, so the layer tests and
tests/test_gem_reference.py check the same independent arithmetic.

  p = params(model)                          # {'blocks': {0: {'x_mix': (n, m), ..}, ..}, ..}
  logits, aux = gem(p, cfg, spec, feature_dims, inputs)
"""
from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

import jax
import numpy as np
from flax import nnx

LN_EPS_MLP = 1e-5  # gem_jax.layers.mlp.LayerNorm (Wukong, SequenceEmbedder)
LN_EPS_SEQ = 1e-6  # gem_jax.layers.norm.LayerNorm (attention, PMA, InterFormer)


def params(tree) -> dict:
  """nnx.Module / nnx.State / pure dict -> nested dict of float64 numpy arrays."""
  if isinstance(tree, nnx.Module):
    tree = nnx.state(tree, nnx.Param)
  if isinstance(tree, nnx.State):
    tree = nnx.to_pure_dict(tree)
  return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


# ----------------------------------------------------------------------------- elementwise
def gelu(x):
  """jax.nn.gelu's default tanh approximation."""
  return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def relu(x):
  return np.maximum(x, 0.0)


ACT = {"relu": relu, "gelu": gelu, "silu": lambda x: x * sigmoid(x), "sigmoid": sigmoid,
       "none": lambda x: x}


def layernorm(x, scale, bias, eps=LN_EPS_SEQ):
  """(x - mean) / sqrt(var + eps) * scale + bias over the last axis."""
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + eps) * scale + bias


def ln(p, x, eps=LN_EPS_SEQ):
  """layernorm with p = {'scale', 'bias'}."""
  return layernorm(x, p["scale"], p["bias"], eps)


def rms(x, scale, eps=1e-6):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * scale


def dense(p, x):
  """x W (+ b)."""
  y = x @ p["kernel"]
  return y + p["bias"] if "bias" in p else y


def mlp(p, x, final="none", act="relu"):
  """h_{j+1} = act(h_j W_j + b_j), the last layer `final`; p = {'layers': {j: dense}}."""
  n = len(p["layers"])
  for j in range(n):
    x = dense(p["layers"][j], x)
    x = ACT[final](x) if j == n - 1 else ACT[act](x)
  return x


# ----------------------------------------------------------------------------- attention
def rope(x, base=10000.0):
  """x (B, L, H, dh): pair (x_i, x_{i+dh/2}) rotated by p * base^(-2i/dh)."""
  _, n, _, dh = x.shape
  out = np.empty_like(x)
  for p in range(n):
    for i in range(dh // 2):
      a = p * base ** (-2.0 * i / dh)
      x1, x2 = x[:, p, :, i], x[:, p, :, i + dh // 2]
      out[:, p, :, i] = x1 * math.cos(a) - x2 * math.sin(a)
      out[:, p, :, i + dh // 2] = x2 * math.cos(a) + x1 * math.sin(a)
  return out


def bucket(delta, nb):
  """min(nb - 1, floor(log2(1 + |delta|)))."""
  return np.clip(np.floor(np.log2(1.0 + np.abs(delta))), 0, nb - 1).astype(int)


def core(q, k, v, allowed, bias, score, norm):
  """q (B, Lq, H, dh), k/v (B, Lk, H, dh), allowed (B, Lq, Lk), bias (B, H, Lq, Lk)."""
  s = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1]) + bias
  a = allowed[:, None]
  if score == "softmax":
    a = np.broadcast_to(a, s.shape)
    m = np.max(np.where(a, s, -np.inf), axis=-1, keepdims=True)
    e = np.where(a, np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
    tot = e.sum(-1, keepdims=True)
    w = e / np.where(tot > 0, tot, 1.0)
  else:
    w = np.where(a, s / (1.0 + np.exp(-s)), 0.0) / norm
  return np.einsum("bhqk,bkhd->bqhd", w, v)


def allowed_mask(valid, mask, block, recent_first=True):
  n = valid.shape[1]
  i, j = np.arange(n)[:, None], np.arange(n)[None, :]
  rule = {"full": np.ones((n, n), bool),
          "causal": (j >= i) if recent_first else (j <= i),
          "block_local": (i // block) == (j // block)}[mask]
  return valid[:, None, :] & rule[None]


def _qk_norm(p, q, k):
  if p.get("q_norm") is not None:
    q, k = rms(q, p["q_norm"]["scale"]), rms(k, p["k_norm"]["scale"])
  return q, k


def attention(p, x, valid, dt=None, *, heads, score="softmax", mask="full", block=64,
              rope_on=False, recent_first=True):
  """Self-attention W_o concat_h(attend(q_h, k_h, v_h)), [q, k, v] = x W_qkv.   (B, L, D)."""
  x, valid = np.asarray(x, np.float64), np.asarray(valid)
  b, n, d = x.shape
  q, k, v = [t.reshape(b, n, heads, d // heads) for t in np.split(dense(p["qkv"], x), 3, -1)]
  q, k = _qk_norm(p, q, k)
  if rope_on:
    q, k = rope(q), rope(k)
  bias = np.zeros((b, heads, n, n))
  if p.get("time_bias") is not None:
    dt = np.asarray(dt, np.float64)
    table = p["time_bias"]
    bias = np.moveaxis(table[bucket(dt[:, :, None] - dt[:, None, :], table.shape[0])], -1, 1)
  norm = block if mask == "block_local" else n
  o = core(q, k, v, allowed_mask(valid, mask, block, recent_first), bias, score, norm)
  o = np.where(valid[:, :, None, None], o, 0.0).reshape(b, n, d)
  return dense(p["out"], o)


def cross_attention(p, q_in, kv, kv_valid, kv_dt=None, *, heads, score="softmax"):
  """Target-aware cross attention, q = x_q W_q, [k, v] = kv W_kv, full mask.   (B, Q, D)."""
  q_in, kv = np.asarray(q_in, np.float64), np.asarray(kv, np.float64)
  (b, nq, d), n = q_in.shape, kv.shape[1]
  q = dense(p["q_proj"], q_in).reshape(b, nq, heads, d // heads)
  k, v = [t.reshape(b, n, heads, d // heads) for t in np.split(dense(p["kv_proj"], kv), 2, -1)]
  q, k = _qk_norm(p, q, k)
  bias = np.zeros((b, heads, nq, n))
  if p.get("time_bias") is not None:
    table = p["time_bias"]
    bias = bias + np.moveaxis(table[bucket(np.asarray(kv_dt, np.float64), table.shape[0])],
                              -1, 1)[:, :, None, :]
  allowed = np.broadcast_to(np.asarray(kv_valid)[:, None, :], (b, nq, n))
  return dense(p["out"], core(q, k, v, allowed, bias, score, n).reshape(b, nq, d))


def pma(p, x, valid, *, heads, score="softmax"):
  """PMA(x) = S + CrossAttention(S, LN(x), valid), S the learned seeds.   (B, k, D)."""
  seeds = np.broadcast_to(p["seeds"], (x.shape[0],) + p["seeds"].shape)
  return seeds + cross_attention(p["attn"], seeds, ln(p["norm"], np.asarray(x, np.float64)),
                                 valid, heads=heads, score=score)


# ----------------------------------------------------------------------------- sequence stack
def sequence_block(p, x, valid, dt, **attn_kw):
  """x + Attn(LN(x)), then + W_2 gelu(W_1 LN(x))."""
  x = np.asarray(x, np.float64)
  x = x + attention(p["attn"], ln(p["norm1"], x), valid, dt, **attn_kw)
  return x + dense(p["ffn"]["down"], gelu(dense(p["ffn"]["up"], ln(p["norm2"], x))))


def pyramid_branch(p, x, valid, dt, *, stage_lengths, reduce, num_summary, heads,
                   score="softmax", **attn_kw):
  """One PyramidBranch: crop, stages of SequenceBlocks linked by 'recent' / 'pma' reductions."""
  lengths, k = stage_lengths, num_summary
  x, valid, dt = np.asarray(x, np.float64), np.asarray(valid), np.asarray(dt, np.float64)
  x, valid, dt = x[:, :lengths[0]], valid[:, :lengths[0]], dt[:, :lengths[0]]

  def red(i, x, valid, dt, n, last):
    if reduce == "pma":
      return pma(p["pmas"][i], x, valid, heads=heads, score=score), \
          np.ones((x.shape[0], n), bool), np.zeros((x.shape[0], n))
    if last and x.shape[1] < n:
      q = n - x.shape[1]
      x = np.concatenate([x, np.zeros((x.shape[0], q, x.shape[2]))], 1)
      valid = np.concatenate([valid, np.zeros((x.shape[0], q), bool)], 1)
      dt = np.concatenate([dt, np.zeros((x.shape[0], q))], 1)
    return x[:, :n], valid[:, :n], dt[:, :n]

  for s in range(len(lengths)):
    if s:
      x, valid, dt = red(s - 1, x, valid, dt, lengths[s], False)
    for j in range(len(p["stages"][s])):
      x = sequence_block(p["stages"][s][j], x, valid, dt, heads=heads, score=score, **attn_kw)
  x, valid, _ = red(len(lengths) - 1, x, valid, dt, k, True)
  return np.where(valid[:, :, None], ln(p["final_norm"], x), 0.0)


# ----------------------------------------------------------------------------- front end
def dense_tokenizer(p, x, n_tokens):
  """reshape(MLP(dense), (n_dt, d)).   (B, n_dense) -> (B, n_dt, d)."""
  y = mlp(p["mlp"], np.asarray(x, np.float64))
  return y.reshape(y.shape[0], n_tokens, -1)


def sparse_projector(p, sparse, feature_dims, d):
  """e_f W_f if D_f != d else e_f, in feature order; W_f = proj[str(D_f)][index in its group]."""
  groups: dict[int, list[str]] = {}
  for name, dim in feature_dims.items():
    groups.setdefault(int(dim), []).append(name)
  out = {}
  for dim, names in groups.items():
    for i, name in enumerate(names):
      e = np.asarray(sparse[name], np.float64)
      out[name] = e if dim == d else e @ p["proj"][str(dim)][i]
  return np.stack([out[n] for n in feature_dims], 1)  # (B, n_sp, d)


def log_bucket(dt, nb):
  """min(nb - 1, floor(log2(1 + max(dt, 0))))."""
  return np.clip(np.floor(np.log2(1.0 + np.maximum(dt, 0.0))), 0, nb - 1).astype(int)


def sequence_embedder(p, items, action, surface, dt, mask):
  """LN([e_f]_f W) + E_act[a] + E_surf[s] + E_time[bucket(dt)], 0 where padded.

  items: (B, L, sum D_f) (the item embeddings concatenated). Returns (x, mask, dt).
  """
  e = ln(p["item_norm"], np.asarray(items, np.float64) @ p["item_proj"]["kernel"], LN_EPS_MLP)
  e = e + p["action_emb"][np.clip(action, 0, len(p["action_emb"]) - 1)]
  e = e + p["surface_emb"][np.clip(surface, 0, len(p["surface_emb"]) - 1)]
  dt, mask = np.asarray(dt, np.float64), np.asarray(mask, bool)
  if p.get("time_emb") is not None:
    e = e + p["time_emb"][log_bucket(dt, len(p["time_emb"]))]
  return np.where(mask[..., None], e, 0.0), mask, np.where(mask, dt, 0.0)


# ----------------------------------------------------------------------------- Wukong
def fm(y, x):
  """F = (X X^T) Y.   (B, n, d) -> (B, n, k)."""
  return np.einsum("bnm,mk->bnk", x @ x.transpose(0, 2, 1), y)


def fm_pairs(x):
  """<x_i, x_j> for i < j, row-major over (i, j).   (B, n, d) -> (B, n (n - 1) / 2)."""
  n = x.shape[1]
  return np.stack([np.sum(x[:, i] * x[:, j], -1) for i in range(n) for j in range(i + 1, n)], 1)


def wukong_layer(p, x):
  """LN(concat(FMB X, LCB X) + R X), R = I or p['res'].   (B, n, d) -> (B, n_F + n_L, d)."""
  x = np.asarray(x, np.float64)
  b, _, d = x.shape
  projected = "y" in p["fmb"].get("fm", {})
  f = fm(p["fmb"]["fm"]["y"], x) if projected else fm_pairs(x)
  h = ln(p["fmb"]["norm"], f.reshape(b, -1), LN_EPS_MLP)
  fmb = mlp(p["fmb"]["mlp"], h).reshape(b, -1, d)  # (B, n_F, d)
  lcb = np.einsum("ln,bnd->bld", p["lcb"]["w"], x)
  res = x if p.get("res") is None else np.einsum("on,bnd->bod", p["res"], x)
  return ln(p["norm"], np.concatenate([fmb, lcb], 1) + res, LN_EPS_MLP)


def cross_layer(p, sources, l):
  """sum_j a_j X_j, a = softmax_j(q_l . mean_n X_j / sqrt(d) + c_{l,j})."""
  s = np.stack(sources, 1)  # (B, J, n, d)
  sc = s.mean(2) @ p["query"][l - 1] / np.sqrt(s.shape[-1]) + p["bias"][l - 1, :len(sources)]
  a = np.exp(sc - sc.max(-1, keepdims=True))
  a /= a.sum(-1, keepdims=True)
  return np.einsum("bj,bjnd->bnd", a, s)


def wukong_stack(p, x):
  """Layers linked by cross-layer attention over X_0 (projected if n differs), X_1, ..."""
  x = np.asarray(x, np.float64)
  if p.get("cross") is None:
    for j in range(len(p["layers"])):
      x = wukong_layer(p["layers"][j], x)
    return x
  x0 = x if p.get("x0_proj") is None else np.einsum("on,bnd->bod", p["x0_proj"], x)
  sources, h = [x0], x
  for l in range(len(p["layers"])):
    if l > 0:
      h = cross_layer(p["cross"], sources, l)
    h = wukong_layer(p["layers"][l], h)
    sources.append(h)
  return h


# ----------------------------------------------------------------------------- InterFormer
def gating(p, x):
  """sigmoid(x * MLP(x)) * x, MLP(x) = gelu(x W_a + b_a) W_b + b_b."""
  return x * sigmoid(x * dense(p["fc2"], gelu(dense(p["fc1"], x))))


def pffn(p, x_sum, s):
  """S + gelu(LN(S) K^T / sqrt(D)) V,  K = X_sum W_k, V = X_sum W_v."""
  k, v = x_sum @ p["w_k"]["kernel"], x_sum @ p["w_v"]["kernel"]
  h = gelu(np.einsum("bld,bmd->blm", ln(p["norm"], s), k) / np.sqrt(s.shape[-1]))
  return s + h @ v


def x_summary(p, x):
  """X_sum = Gating(MLP(W_t X)).   (B, n, D) -> (B, m, D)."""
  z = np.einsum("bnd,nm->bmd", x, p["x_mix"])
  return gating(p["x_gate"], dense(p["x_fc2"], gelu(dense(p["x_fc1"], z))))


def sequence_branch(p, x_sum, s, valid, dt, *, heads, num_recent, score="softmax",
                    mask="full", block=64, rope_on=False, recent_first=True):
  """One stream's branch: (S' (B, L, D), S_sum,i = Gating(LN([S_CLS; PMA(S'); recent(S')])))."""
  s, valid = np.asarray(s, np.float64), np.asarray(valid)
  dt = None if dt is None else np.asarray(dt, np.float64)
  b, L, d = s.shape
  u = pffn(p["pffn"], x_sum, s)
  c = 0 if p.get("cls") is None else p["cls"].shape[0]
  if c:
    u = np.concatenate([np.broadcast_to(p["cls"], (b, c, d)), u], 1)
    valid_ext = np.concatenate([np.ones((b, c), bool), valid], 1)
    dt_ext = None if dt is None else np.concatenate([np.zeros((b, c)), dt], 1)
  else:
    valid_ext, dt_ext = valid, dt
  u = u + attention(p["attn"], ln(p["attn_norm"], u), valid_ext, dt_ext, heads=heads,
                    score=score, mask=mask, block=block, rope_on=rope_on,
                    recent_first=recent_first)
  s_cls, s_new = u[:, :c], u[:, c:]
  parts = [s_cls]
  if p.get("pma") is not None:
    parts.append(pma(p["pma"], s_new, valid, heads=heads, score=score))
  r = num_recent
  if r:
    ok = np.pad(valid[:, :r], [(0, 0), (0, max(0, r - L))])
    rec = np.pad(s_new[:, :r], [(0, 0), (0, max(0, r - L)), (0, 0)])
    parts.append(np.where(ok[:, :, None], rec, 0.0))
  summ = ln(p["s_norm"], np.concatenate(parts, 1))
  if r:
    summ[:, -r:] = np.where(ok[:, :, None], summ[:, -r:], 0.0)
  return s_new, gating(p["s_gate"], summ)


def interformer_block(p, x, streams, interaction: Callable, *, n_tokens, **branch_kw):
  """X_sum once, one branch per stream, X' = interaction([X; S_sum])[:n].

  streams: [(s_i, valid_i, dt_i)]. Returns (X', [S'_i], X_sum, S_sum).
  """
  x = np.asarray(x, np.float64)
  x_sum = x_summary(p, x)
  outs = [sequence_branch(p["branches"][i], x_sum, *st, **branch_kw)
          for i, st in enumerate(streams)]
  s_sum = np.concatenate([o[1] for o in outs], 1)
  x_new = interaction(np.concatenate([x, s_sum], 1))[:, :n_tokens]
  return x_new, [o[0] for o in outs], x_sum, s_sum


# ----------------------------------------------------------------------------- heads
def grouped_mlp(p, x, g, final="none"):
  """Group g of a GroupedMLP: h_{j+1} = act(h_j W_j[g] + b_j[g]), last layer `final`."""
  n = len(p["kernels"])
  for j in range(n):
    x = x @ p["kernels"][j][g] + p["biases"][j][g]
    x = ACT[final](x) if j == n - 1 else relu(x)
  return x


def heads(p, h, domain):
  """'towers': Tower_dom(h); 'mmoe': Tower_t(sum_e softmax(h G_{dom,t})_e Expert_e(h)). (B, T)."""
  h, domain = np.asarray(h, np.float64), np.asarray(domain)
  if p.get("towers") is not None:
    nd = p["towers"]["kernels"][0].shape[0]
    dom = np.clip(domain, 0, nd - 1)
    return np.stack([grouped_mlp(p["towers"], h[b], dom[b]) for b in range(len(h))])
  nd, num_e = p["gates"].shape[0], p["experts"]["kernels"][0].shape[0]
  num_t = p["task_towers"]["kernels"][0].shape[0]
  dom = np.clip(domain, 0, nd - 1)
  experts = np.stack([grouped_mlp(p["experts"], h, e, final="relu") for e in range(num_e)], 1)
  g = np.einsum("bk,bkm->bm", h, p["gates"][dom]).reshape(len(h), num_t, num_e)
  g = np.exp(g - g.max(-1, keepdims=True))
  g /= g.sum(-1, keepdims=True)  # (B, T, E)
  z = np.einsum("bte,beh->bth", g, experts)  # (B, T, H_e)
  return np.stack([grouped_mlp(p["task_towers"], z[:, t], t)[:, 0] for t in range(num_t)], 1)


# ----------------------------------------------------------------------------- GEM
def pyramid(fracs: Sequence[float], num_blocks: int, max_len: int) -> list[int]:
  """L^l = ceil(pyramid[l] L), the last fraction repeated, non-increasing, at least 1."""
  fr = list(fracs) + [fracs[-1]] * max(0, num_blocks - len(fracs))
  out, prev = [], max_len
  for f in fr[:num_blocks]:
    prev = max(1, min(prev, math.ceil(f * max_len)))
    out.append(prev)
  return out


def gem(p, cfg, spec, feature_dims: Mapping[str, int], inputs):
  """GEM's forward (docs/model.md 'GEM data flow') -> (logits (B, T), aux)."""
  d, nb = cfg.d_model, cfg.num_blocks
  b = len(inputs["dense"])
  dom = np.clip(np.asarray(inputs["domain"]), 0, p["domain_emb"].shape[0] - 1)
  # Front end: X0 = W_in [dense; sparse; domain]   (B, n, d)
  parts = [dense_tokenizer(p["dense_tok"], inputs["dense"], cfg.n_dense_tokens)]
  pooled = [f.name for f in spec.pooled_features]
  if pooled:
    parts.append(sparse_projector(p["sparse_proj"], inputs["sparse"],
                                  {f: feature_dims[f] for f in pooled}, d))
  parts.append(p["domain_emb"][dom][:, None])
  x0 = np.concatenate(parts, 1)  # (B, n0, d)
  x = x0 if p.get("token_mix") is None else np.einsum("on,bnd->bod", p["token_mix"], x0)
  # Streams: S_i = SequenceEmbedder_i + E_stream[i] (0 where padded), own pyramid schedule.
  streams = []
  for i, s in enumerate(spec.sequences):
    si = inputs["seq"][s.name]
    items = np.concatenate([np.asarray(si["items"][f], np.float64) for f in s.item_features], -1)
    e, valid, dt = sequence_embedder(p["seq_emb"][i], items, si["action"], si["surface"],
                                     si["dt"], si["mask"])
    e = np.where(valid[..., None], e + p["stream_emb"][i], 0.0)
    streams.append((e, valid, dt, pyramid(cfg.pyramid, nb, s.max_len)))
  if not streams:  # one dummy stream of one invalid event
    streams = [(np.zeros((b, 1, d)), np.zeros((b, 1), bool), np.zeros((b, 1)), [1] * nb)]
  kw = dict(heads=cfg.num_heads, num_recent=cfg.num_recent, score=cfg.attn_score,
            mask=cfg.attn_mask, block=cfg.block_size, rope_on=cfg.rope)
  n = cfg.wukong_nf + cfg.wukong_nl
  history = [x if p.get("history_proj") is None else
             np.einsum("on,bnd->bod", p["history_proj"], x0)]
  for l in range(nb):
    cur = [(s[:, :ls[l]], v[:, :ls[l]], t[:, :ls[l]]) for s, v, t, ls in streams]
    x_in = x if (l == 0 or p.get("cross_layer") is None) else \
        cross_layer(p["cross_layer"], history, l)
    blk = p["blocks"][l]
    x, seqs, x_sum, s_sum = interformer_block(
        blk, x_in, cur, lambda z: wukong_layer(blk["interaction"], z), n_tokens=n, **kw)
    history.append(x)
    streams = [(s_new, v, t, st[3]) for s_new, (_, v, t), st in zip(seqs, cur, streams)]
  # Target-aware cross attention, trunk, heads.
  q = np.einsum("qn,bnd->bqd", p["query_mix"], x)  # (B, Q, d)
  targets = [cross_attention(p["target_attn"][i], q, s, v, heads=cfg.num_heads,
                             score=cfg.attn_score) for i, (s, v, _, _) in enumerate(streams)]
  seq_summary = np.concatenate([s_sum] + targets, 1)  # (B, K (c+p+r+Q), d)
  feats = np.concatenate([x, x_sum, seq_summary], 1).reshape(b, -1)
  if p.get("trunk_gate") is not None:  # the deep features, scaled by a learned scalar
    feats = feats * p["trunk_gate"]
  if cfg.trunk_pairs:
    feats = np.concatenate([feats, fm_pairs(x0)], 1)  # + <x0_i, x0_j>, i < j
  trunk = mlp(p["trunk"], feats, final="relu")  # (B, H)
  logits = heads(p["heads"], trunk, dom)
  return logits, {"trunk": trunk, "seq_summary": seq_summary.reshape(b, -1), "x": x}
