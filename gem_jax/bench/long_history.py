"""Does the long history pay? A small target-aware ranker on `LongHistory` data.

HistoryRanker (the target-aware cross attention of GEM.md §3.2 on its own):
  e_t = E[item_t] (B, L, D), c = E[candidate] (B, D)      one shared item table E
  o = CrossAttention(c, e, valid, dt)                      candidate attends to its history
  logit = MLP([c ; o ; c * o])                             (B,)
The attention's q, k, v and output projections start as the identity (the candidate starts
by attending to its own item; everything is learned from there), so a few hundred Adam
steps suffice on 2 CPU cores. `compare` trains it on full histories and on histories
truncated to the newest `short` events, same data and seeds, and reports held-out AUCs
with the data's oracle AUCs. Keys above `dense_max` go through the chunked attention.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from gem_jax.data.long_history import LongHistory
from gem_jax.data.packing import truncate
from gem_jax.data.synthetic import rank_auc
from gem_jax.layers.attention import AttentionImpl, CrossAttention
from gem_jax.layers.dense import param
from gem_jax.layers.mlp import MLP


@dataclasses.dataclass(frozen=True)
class Run:
  steps: int = 150
  batch: int = 64
  eval_users: int = 2048
  d_model: int = 32
  num_heads: int = 2
  lr: float = 3e-3
  dense_max: int = 512


class HistoryRanker(nnx.Module):
  """Module docstring. Call: (items (B, L), dt (B, L), valid (B, L), cand (B,)) -> (B,)."""

  def __init__(self, vocab: int, r: Run, *, rngs: nnx.Rngs):
    d = r.d_model
    self.table = param(rngs, nnx.initializers.normal(1.0), (vocab, d), jnp.float32,
                       (None, "embed"))
    self.attn = CrossAttention(d, r.num_heads, time_buckets=24,
                               impl=AttentionImpl("auto", dense_max=r.dense_max), rngs=rngs)
    eye = jnp.eye(d)
    self.attn.q_proj.kernel[...] = eye
    self.attn.kv_proj.kernel[...] = jnp.concatenate([eye, eye], axis=1)
    self.attn.out.kernel[...] = eye
    self.head = MLP(3 * d, (64, 1), rngs=rngs)

  def __call__(self, items, dt, valid, cand):
    t = self.table[...]
    e = jnp.take(t, jnp.maximum(items, 0), axis=0)  # (B, L, D)
    e = jnp.where(valid[..., None], e, 0.0)
    c = jnp.take(t, cand, axis=0)[:, None, :]  # (B, 1, D)
    o = self.attn(c, e, valid, dt)  # (B, 1, D)
    return self.head(jnp.concatenate([c, o, c * o], axis=-1)[:, 0])[:, 0]  # (B,)


def _arrays(b, keep):
  lengths, _ = truncate(b["lengths"], keep)
  valid = np.arange(keep)[None, :] < lengths[:, None]
  return (jnp.asarray(b["items"][:, :keep]), jnp.asarray(b["dt"][:, :keep]),
          jnp.asarray(valid), jnp.asarray(b["candidate"])), jnp.asarray(b["label"])


def train_eval(data: LongHistory, keep: int, seed: int, r: Run = Run()) -> float:
  """Held-out AUC of a ranker trained on histories truncated to their newest `keep`."""
  model = HistoryRanker(data.vocab, r, rngs=nnx.Rngs(seed))
  opt = nnx.Optimizer(model, optax.adam(r.lr), wrt=nnx.Param)

  @nnx.jit
  def step(model, opt, x, y):
    def loss(m):
      return optax.sigmoid_binary_cross_entropy(m(*x), y).mean()

    l, g = nnx.value_and_grad(loss)(model)
    opt.update(model, g)
    return l

  rng = np.random.default_rng(seed)
  for _ in range(r.steps):
    step(model, opt, *_arrays(data.batch(r.batch, rng), keep))
  ev = data.batch(r.eval_users, np.random.default_rng(10_000))
  x, _ = _arrays(ev, keep)
  score = nnx.jit(lambda m, *a: m(*a))
  s = np.concatenate([np.asarray(score(model, *(a[i:i + 512] for a in x)))
                      for i in range(0, r.eval_users, 512)])
  return rank_auc(s, ev["label"])


def compare(data: LongHistory, short: int = 64, seeds=(0, 1), r: Run = Run()) -> dict:
  """AUCs per seed of the full-history and the truncated model, and the oracles."""
  ev = data.batch(r.eval_users, np.random.default_rng(10_000))
  return {"long": [train_eval(data, data.max_len, s, r) for s in seeds],
          "short": [train_eval(data, short, s, r) for s in seeds],
          "oracle_auc": rank_auc(ev["logit"], ev["label"]),
          "short_oracle_auc": rank_auc(data.short_logit(ev), ev["label"])}
