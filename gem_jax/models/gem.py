"""GEM: front end -> interleaved InterFormer blocks (Wukong interaction, pyramid-parallel
stream branches) -> target-aware cross attention -> trunk -> multi-domain multi-task heads.

Data flow (B batch, d = cfg.d_model, n = n_F + n_L, K event streams (K = 1 with one
invalid event when the spec has none), c/p/r = CLS/PMA/recent summary tokens per
stream, m = X-summary tokens, Q = candidate queries; docs/model.md has the diagram):

  dense (B, n_dense)        -> DenseTokenizer                    -> (B, n_dt, d)
  sparse {f: (B, D_f)}      -> SparseProjector                   -> (B, n_sp, d)
  domain (B,)               -> E_dom[domain]                     -> (B, 1, d)
  E  = [dense; sparse; domain tokens]                             (B, n0, d)
  X0 = W_in E  (token mix n0 -> n; token_mix=False: X0 = E)      -> (B, n, d)
  stream i: items/action/surface/dt/mask -> SequenceEmbedder_i + E_stream[i] -> S_i (B, L_i, d)
  for block l = 0..N-1:
    S_i, valid_i, dt_i <- keep the L_i^l = ceil(pyramid[l] L_i) newest events  (pyramid)
    X_in = X (l = 0) or CrossLayerAttention(X_0..X_l)                      (optional)
    X, [S_i], X_sum, S_sum = InterFormerBlock_l(X_in, streams=[(S_i, valid_i, dt_i)])
      one parallel branch per stream (own weights): S_i only attends within stream i
      S_sum = [S_sum,1; ..; S_sum,K]                            (B, K (c + p + r), d)
      interaction = WukongLayer(n + K (c + p + r) -> n)
  T_i = CrossAttention_i(W_q X (B, Q, d) -> S_i)                 target-aware  (B, Q, d)
  seq_summary = flatten([S_sum; T_1; ..; T_K])                   (B, K (c + p + r + Q) d)
  P = [<E_i, E_j>]_{i<j}  (trunk_pairs, the default)             (B, n0 (n0 - 1) / 2)
  trunk = MLP([flatten([X; X_sum; S_sum; T_1..T_K]); P])         (B, H)
  logits = MultiTaskHeads(trunk, domain)                         (B, n_tasks) fp32

Packed histories (cfg.seq_pack_tokens > 0): each batch shard packs its users' histories,
each behind its c CLS slots, into cfg.seq_pack_rows rows of seq_pack_tokens tokens
(`gem_jax.layers.packed`), and the branches run on those rows with attention masked to
each history; S_CLS, the PMA's and the target attention's keys/values and the recent
tokens are unpacked per user. Same function as the padded path (tests/test_gem_packed.py);
the pyramid masks the older events instead of cropping them. If a shard's histories do not
fit, the logits are NaN; the trainer checks every batch on the host first and steps a
misfit with the padded model (gem_jax/train/packing.py: an in-program lax.cond fallback
was sized for its padded branch, 3x the packed memory).

Streams are the parallel branches of the pyramid-parallel stack (GEM.md §3.2): every
stream keeps its own length schedule and its own sequence weights in every block; the
streams meet only in S_sum (the Wukong interaction and the trunk) and in the trunk via T_i.

P, every pairwise dot product of the front-end tokens, reaches the trunk directly: the
Wukong layers' compressed FM, X (X^T Y) of mixed tokens, learns planted field-pair
interactions far slower than DLRM's explicit pairs (docs/RESULTS.md, "Interaction
benchmark"), and P gives GEM those pairs at 2 n0^2 d FLOPs.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from gem_jax.data.spec import DataSpec
from gem_jax.layers import packed
from gem_jax.layers.attention import AttentionImpl, CrossAttention
from gem_jax.layers.dense import lowp_einsum, param
from gem_jax.layers.features import DenseTokenizer, SequenceEmbedder, SparseProjector
from gem_jax.layers.heads import MultiTaskHeads
from gem_jax.layers.interformer import InterFormerBlock
from gem_jax.layers.mlp import MLP
from gem_jax.layers.wukong import FM, CrossLayerAttention, WukongLayer
from gem_jax.models.config import GEMConfig
from gem_jax.parallel.sharding import batch_groups, constrain_batch


def pyramid_lengths(cfg: GEMConfig, max_len: int) -> tuple[int, ...]:
  """Events kept per block for a stream of max_len: ceil(pyramid[l] * max_len), non-increasing.

  cfg.pyramid is extended with its last entry when it is shorter than num_blocks.
  """
  fr = tuple(cfg.pyramid) + (cfg.pyramid[-1],) * max(0, cfg.num_blocks - len(cfg.pyramid))
  out, prev = [], max_len
  for f in fr[:cfg.num_blocks]:
    prev = max(1, min(prev, math.ceil(f * max_len)))
    out.append(prev)
  return tuple(out)


def check_packing(cfg: GEMConfig, spec: DataSpec) -> None:
  """One-line ValueErrors for packed-history settings the model cannot run."""
  if cfg.seq_pack_rows < 1:
    raise ValueError(f"seq_pack_tokens={cfg.seq_pack_tokens} needs seq_pack_rows >= 1 "
                     f"(rows per batch shard), got {cfg.seq_pack_rows}")
  if cfg.attn_mask == "block_local":
    raise ValueError("seq_pack_tokens > 0 needs attn_mask 'full' or 'causal': block_local "
                     "blocks would cross the packed histories")
  for s in spec.sequences:
    if cfg.num_cls + s.max_len > cfg.seq_pack_tokens:
      raise ValueError(f"seq_pack_tokens={cfg.seq_pack_tokens} cannot hold stream {s.name!r}: "
                       f"num_cls {cfg.num_cls} + max_len {s.max_len} tokens")


def front_tokens(cfg: GEMConfig, spec: DataSpec) -> int:
  """n0: dense tokens + pooled sparse features + 1 domain token."""
  return cfg.n_dense_tokens + len(spec.pooled_features) + 1


class GEM(nnx.Module):
  """The GEM model (module docstring). Built from (cfg, spec, feature_dims) only.

  Call: (inputs, return_aux=False) -> logits (B, n_tasks) fp32, or (logits, aux) with
  aux = {'trunk' (B, H), 'seq_summary' (B, K (c+p+r+Q) d), 'x' (B, n, d)}.
  """

  def __init__(self, cfg: GEMConfig, spec: DataSpec, feature_dims: Mapping[str, int], *,
               rngs: nnx.Rngs):
    d, prec = cfg.d_model, cfg.precision()
    self.cfg, self.dtype = cfg, cfg.compute_dtype
    self.pooled = tuple(f.name for f in spec.pooled_features)
    self.streams = tuple(s.name for s in spec.sequences)
    self.lengths = tuple(pyramid_lengths(cfg, s.max_len) for s in spec.sequences)
    n0, n = front_tokens(cfg, spec), cfg.n_interaction
    self.n_tokens = n
    self.num_branches = k = max(len(self.streams), 1)  # no streams: one dummy branch
    self.n_summary = cfg.num_cls + cfg.num_pma + cfg.num_recent  # per stream
    self.packing = bool(cfg.seq_pack_tokens) and bool(self.streams)
    if self.packing:
      check_packing(cfg, spec)
    emb = nnx.initializers.normal(1.0 / math.sqrt(d))
    # Front end.
    self.dense_tok = DenseTokenizer(spec.n_dense, cfg.n_dense_tokens, d, cfg.dense_hidden,
                                    rngs=rngs, fp8=cfg.fp8, **prec)
    self.sparse_proj = SparseProjector({f: feature_dims[f] for f in self.pooled}, d,
                                       rngs=rngs, **prec)
    self.domain_emb = param(rngs, emb, (max(spec.num_domains, 1), d), cfg.params_dtype,
                            ("lookup", "lookup"))
    self.token_mix = (param(rngs, nnx.initializers.normal(1.0 / math.sqrt(n0)), (n, n0),
                            cfg.params_dtype, (None, "tokens")) if cfg.token_mix else None)
    # Without the mix, X_0 enters the cross-layer history through its own projection.
    self.history_proj = (param(rngs, nnx.initializers.normal(1.0 / math.sqrt(n0)), (n, n0),
                               cfg.params_dtype, (None, "tokens"))
                         if not cfg.token_mix and cfg.cross_layer and cfg.num_blocks > 1
                         else None)
    self.seq_emb = nnx.List([
        SequenceEmbedder({f: feature_dims[f] for f in s.item_features}, d,
                         num_actions=s.num_actions, num_surfaces=s.num_surfaces,
                         time_buckets=cfg.time_buckets, rngs=rngs, **prec)
        for s in spec.sequences])
    self.stream_emb = param(rngs, emb, (max(len(self.streams), 1), d), cfg.params_dtype,
                            (None, "embed"))
    # Interleaved blocks.
    impl = AttentionImpl(cfg.attn_impl, cfg.attn_chunk, cfg.attn_dense_max)
    blocks = []
    for l in range(cfg.num_blocks):
      n_in = n0 if (l == 0 and not cfg.token_mix) else n
      wukong = WukongLayer(n_in + k * self.n_summary, d, n_f=cfg.wukong_nf, n_l=cfg.wukong_nl,
                           k=cfg.wukong_k, mlp_hidden=cfg.wukong_mlp, fm=cfg.wukong_fm,
                           rngs=rngs, fp8=cfg.fp8, remat=cfg.remat, **prec)
      blocks.append(InterFormerBlock(
          d, n_in, cfg.num_heads, interaction=wukong, rngs=rngs, n_out_tokens=n,
          num_streams=k, num_cls=cfg.num_cls,
          num_pma=cfg.num_pma, num_recent=cfg.num_recent, num_x_summary=cfg.num_x_summary,
          score=cfg.attn_score, mask=cfg.attn_mask, block_size=cfg.block_size, rope=cfg.rope,
          time_buckets=cfg.time_buckets, seq_layer=cfg.seq_layer, impl=impl,
          fp8=cfg.fp8, remat=cfg.remat, **prec))
    self.blocks = nnx.List(blocks)
    self.cross_layer = (CrossLayerAttention(cfg.num_blocks - 1, d, rngs=rngs, **prec)
                        if cfg.cross_layer and cfg.num_blocks > 1 else None)
    # Target-aware cross attention, trunk and heads.
    self.query_mix = param(rngs, nnx.initializers.normal(1.0 / math.sqrt(n)),
                           (cfg.num_queries, n), cfg.params_dtype, (None, "tokens"))
    self.target_attn = nnx.List([
        CrossAttention(d, cfg.num_heads, score=cfg.attn_score, impl=impl, rngs=rngs,
                       fp8=cfg.fp8, **prec)
        for _ in range(k)])
    self.front_pairs = (FM(n0, 1, mode="pairs", rngs=rngs, **prec) if cfg.trunk_pairs
                        else None)
    self.trunk_gate = (param(rngs, nnx.initializers.zeros_init(), (1,), jnp.float32, (None,))
                       if cfg.trunk_pairs and cfg.trunk_gate else None)
    trunk_in = (n + cfg.num_x_summary + k * (self.n_summary + cfg.num_queries)) * d
    trunk_in += self.front_pairs.width if cfg.trunk_pairs else 0
    self.trunk = MLP(trunk_in, cfg.trunk_hidden, rngs=rngs, final_activation="relu",
                     fp8=cfg.fp8, in_axis="mlp", out_axis="mlp", **prec)
    self.heads = MultiTaskHeads(cfg.trunk_hidden[-1], len(spec.tasks), max(spec.num_domains, 1),
                                kind=cfg.head_kind, hidden=cfg.head_hidden,
                                num_experts=cfg.num_experts, expert_hidden=cfg.expert_hidden,
                                rngs=rngs, **prec)

  def tokens(self, inputs: Mapping[str, Any]) -> jax.Array:
    """X0 = [dense tokens; sparse tokens; domain token]  -> (B, n0, d)."""
    dense = self.dense_tok(inputs["dense"])  # (B, n_dt, d)
    parts = [dense]
    if self.pooled:
      parts.append(self.sparse_proj(inputs["sparse"]))  # (B, n_sp, d)
    dom = jnp.clip(inputs["domain"].astype(jnp.int32), 0, self.domain_emb[...].shape[0] - 1)
    parts.append(jnp.take(self.domain_emb[...], dom, axis=0)[:, None, :].astype(self.dtype))
    return jnp.concatenate([p.astype(self.dtype) for p in parts], axis=1)  # (B, n0, d)

  def _mix(self, w, x0: jax.Array) -> jax.Array:
    return lowp_einsum("on,bnd->bod", w[...], x0, self.dtype).astype(self.dtype)  # (B, n, d)

  def sequences(self, inputs: Mapping[str, Any], batch: int):
    """Per stream (x (B, L_i, d), valid (B, L_i), dt (B, L_i)), stream embedding added.

    No streams in the spec: one stream of a single invalid event (the dummy branch).
    """
    out = []
    for i, (name, embed) in enumerate(zip(self.streams, self.seq_emb)):
      s = inputs["seq"][name]
      x, valid, dt = embed(s["items"], s["action"], s["surface"], s["dt"], s["mask"])
      x = x + self.stream_emb[...][i].astype(self.dtype)
      x = jnp.where(valid[..., None], x, jnp.zeros((), x.dtype))  # (B, L_i, d)
      out.append((x, valid, dt))
    if not out:  # no event streams: one invalid event
      d = self.cfg.d_model
      out.append((jnp.zeros((batch, 1, d), self.dtype), jnp.zeros((batch, 1), bool),
                  jnp.zeros((batch, 1), jnp.float32)))
    return out

  def _crop(self, streams, l: int):
    """Each stream keeps its newest pyramid-length events for block l."""
    out = []
    for i, (x, valid, dt) in enumerate(streams):
      keep = self.lengths[i][l] if self.lengths else 1
      out.append((x[:, :keep], valid[:, :keep], dt[:, :keep]))  # (B, L_i^l, d), ...
    return out

  def plans(self, inputs: Mapping[str, Any]) -> list[packed.Packing]:
    """Per stream, the packing of each batch shard's histories (`gem_jax.layers.packed`).

    Lengths are the mask's counts: the model contract's masks are prefixes (events
    [0, len) valid), as every gem_jax batch builds them."""
    cfg = self.cfg
    return [packed.plan(jnp.sum(inputs["seq"][name]["mask"], axis=1), groups=batch_groups(),
                        num_cls=cfg.num_cls, width=inputs["seq"][name]["mask"].shape[1],
                        rows=cfg.seq_pack_rows, capacity=cfg.seq_pack_tokens)
            for name in self.streams]

  def packed_sequences(self, inputs: Mapping[str, Any], plans: list[packed.Packing]):
    """Per stream (x (R, T, d), dt (R, T)) on packed rows; CLS slots and padding 0."""
    out, c = [], self.cfg.num_cls
    for i, (name, embed, pk) in enumerate(zip(self.streams, self.seq_emb, plans)):
      s = inputs["seq"][name]

      def pack(t):
        return packed.pack_events(pk, t, c)

      rows, t = pk.rows, pk.user.shape[2]
      events = (pk.valid & (pk.slot >= c)).reshape(rows, t)  # (R, T)
      x, valid, dt = embed({f: pack(v) for f, v in s["items"].items()}, pack(s["action"]),
                           pack(s["surface"]), pack(s["dt"]), events)
      x = x + self.stream_emb[...][i].astype(self.dtype)
      out.append((jnp.where(valid[..., None], x, jnp.zeros((), x.dtype)), dt))  # (R, T, d)
    return out

  def _targets(self, x: jax.Array) -> jax.Array:
    """The target queries W_q X  -> (B, Q, d)."""
    return lowp_einsum("qn,bnd->bqd", self.query_mix[...], x,
                       self.dtype).astype(self.dtype)  # (B, Q, d)

  def _interleave(self, inputs, x, x0):
    """The blocks on padded streams -> (X_N (B, n, d), X_sum, seq_summary)."""
    streams = self.sequences(inputs, x.shape[0])  # K x (S_i (B, L_i, d), valid_i, dt_i)
    history = [x if self.history_proj is None else self._mix(self.history_proj, x0)]
    x_sum = s_sum = None
    for l, block in enumerate(self.blocks):
      streams = self._crop(streams, l)
      x_in = x if (l == 0 or self.cross_layer is None) else self.cross_layer(history, l)
      x, seqs, x_sum, s_sum = block(x_in, streams=streams)  # (B, n, d), K x (B, L_i^l, d), ..
      x = constrain_batch(x)
      history.append(x)
      streams = [(constrain_batch(s_i), v_i, dt_i) for s_i, (_, v_i, dt_i) in zip(seqs, streams)]
    q = self._targets(x)  # (B, Q, d)
    targets = [attn(q, s_i, v_i).astype(self.dtype)  # (B, Q, d) per stream
               for attn, (s_i, v_i, _) in zip(self.target_attn, streams)]
    return x, x_sum, jnp.concatenate([s_sum] + targets, axis=1)  # (B, K (c+p+r+Q), d)

  def _interleave_packed(self, inputs, x, x0, plans):
    """`_interleave` on packed rows: the same values, FLOPs on the rows' tokens."""
    streams = self.packed_sequences(inputs, plans)  # K x (S_i (R_i, T_i, d), dt_i)
    history = [x if self.history_proj is None else self._mix(self.history_proj, x0)]
    x_sum = s_sum = None
    for l, block in enumerate(self.blocks):
      keep = [lengths[l] for lengths in self.lengths]
      x_in = x if (l == 0 or self.cross_layer is None) else self.cross_layer(history, l)
      x, seqs, x_sum, s_sum = block.packed(
          x_in, [(s_i, dt_i, pk, k) for (s_i, dt_i), pk, k in zip(streams, plans, keep)])
      x = constrain_batch(x)
      history.append(x)
      streams = [(constrain_batch(s_i), dt_i) for s_i, (_, dt_i) in zip(seqs, streams)]
    q, c = self._targets(x), self.cfg.num_cls
    targets = []
    for attn, (s_i, _), pk, k in zip(self.target_attn, streams, plans, keep):
      kh, vh = attn.kv_heads(s_i)  # (R, T, H, dh), per token
      ev = jnp.arange(k)[None, :] < jnp.minimum(pk.lengths.reshape(-1), k)[:, None]  # (B, k)
      targets.append(attn.attend(q, packed.unpack(pk, kh, c, c + k),
                                 packed.unpack(pk, vh, c, c + k), ev).astype(self.dtype))
    return x, x_sum, jnp.concatenate([s_sum] + targets, axis=1)  # (B, K (c+p+r+Q), d)

  def __call__(self, inputs: Mapping[str, Any], return_aux: bool = False):
    b = inputs["dense"].shape[0]
    x0 = constrain_batch(self.tokens(inputs))  # (B, n0, d)
    x = self._mix(self.token_mix, x0) if self.token_mix is not None else x0  # (B, n or n0, d)
    fits = None
    if self.packing:  # packed rows; NaN logits where a shard's histories do not fit
      plans = self.plans(inputs)
      fits = jnp.all(jnp.stack([pk.fits for pk in plans]))
      x, x_sum, seq_summary = self._interleave_packed(inputs, x, x0, plans)
    else:
      x, x_sum, seq_summary = self._interleave(inputs, x, x0)
    feats = constrain_batch(jnp.concatenate([x, x_sum, seq_summary], axis=1))  # (B, n+m+K(c+p+r+Q), d)
    feats = feats.reshape(b, -1)
    if self.trunk_gate is not None:  # the deep features start closed (ReZero)
      feats = (feats.astype(jnp.float32) * self.trunk_gate[...]).astype(feats.dtype)
    if self.front_pairs is not None:  # + <x0_i, x0_j>, i < j: (B, n0 (n0 - 1) / 2)
      feats = jnp.concatenate([feats, self.front_pairs(x0).astype(feats.dtype)], axis=1)
    trunk = self.trunk(feats)  # (B, H)
    logits = self.heads(trunk, inputs["domain"])  # (B, n_tasks) fp32
    if fits is not None:  # never a silently wrong logit (the trainer steps misfits padded)
      logits = jnp.where(fits, logits, jnp.nan)
    if return_aux:
      return logits, {"trunk": trunk, "seq_summary": seq_summary.reshape(b, -1), "x": x}
    return logits
