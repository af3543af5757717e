"""Synthetic ads data with a planted, learnable signal and a known best AUC.

Every example is drawn from a hidden generative model (fixed by the data seed
and the preset); labels are Bernoulli(sigmoid(f)) with a ground-truth logit f
that depends only on what the batch shows, so `true_logits(batch)` recomputes
it and `oracle_auc(n)` is the AUC of the true probability: the best any model
can reach on this data.

Features (ranks r ~ Zipf(s) over a feature's vocab V; the id shown is a fixed
random permutation of the rank, so frequent ids are not the small ones):
  pooled features  one id each (bag 1) or a multi-hot bag of 1..bag ids (-1 padded)
  sequences        per stream, len ~ U{0..L} events, most recent first; the item
                   ids share the vocabulary of one candidate feature (e.g. the
                   clicked categories and the candidate ad's category); a
                   user's history repeats a favourite value, and with
                   probability `p_match` the candidate value is taken from the
                   history
  dense            n_dense standard normals
  domain           d ~ Categorical(domain_probs)

Ground-truth logit of the first task (click):

  f = b_d + sum_j e_j[r_j]                          per-value effects, on the top-K
                                                    ranks of each feature (0 for the
                                                    rare tail, so they can be learnt)
        + sum_{(j,k) in pairs} <u_j[r_j], u_k[r_k]>  rank-2 pairwise interactions of
                                                    the top-M values
        + mean_{v in bag} e_bag[v]                  multi-hot feature
        + w . x + c x_0 x_1 + a_d x_0               dense, their product, per domain
        + sum_streams (beta_recent 1[cand in first R events]
                       + beta_any 1[cand in the len events])

The second task (conversion) has f_2 = rho (f - b_d) + sum_j e2_j[r_j] + b2_d
and is observed only where click = 1 (label_mask), like post-click conversions.

Learnability: vocabularies are hundreds to a few thousand values, and the
effects sit on the frequent values (in 'small': the top 16-24 ranks of each
feature, about 2/3 of the rows; interactions among the top 8 values of each
pair), so a model given the true structure (a logistic regression on
`structure_features`) closes >= 90% of the AUC gap to the oracle per task
from the 512k rows the CPU demo reads, in one pass (99% click, 98% conversion;
tests/test_synthetic.py measures it).

Rows are generated in blocks of `ROW_BLOCK` examples keyed by
(data seed, split, stream seed, block index), so a global batch is the same
whatever the number of processes, and resuming from `state()` is exact.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import numpy as np

from gem_jax.data.spec import DataSpec, SequenceStreamSpec, SparseFeatureSpec

ROW_BLOCK = 256
_SPLITS = {"train": 1, "eval": 2, "oracle": 3}


@dataclasses.dataclass(frozen=True)
class Feature:
  """A pooled categorical feature of the generator.

  Args:
    name, vocab, bag: as in `SparseFeatureSpec` (bag > 1: multi-hot, 1..bag ids).
    zipf: Zipf exponent of the value ranks.
    effect: std of the per-value effect on the click logit.
    top: ranks [0, top) carry an effect (the rest have 0).
    conv_effect: std of the extra per-value effect on the conversion logit.
  """
  name: str
  vocab: int
  bag: int = 1
  zipf: float = 1.1
  effect: float = 0.5
  top: int = 64
  conv_effect: float = 0.0


@dataclasses.dataclass(frozen=True)
class Stream:
  """An event stream whose items share the vocabulary of candidate feature `candidate`.

  Args:
    name: stream name; `item_feature` holds its (B, max_len) item ids.
    candidate: the pooled feature the items are compared with.
    p_favourite: probability that an event is the user's favourite value.
    p_match: probability that the candidate value is drawn from the history.
    recent: R, the events counted as recent.
    beta_recent, beta_any: logit effects of a match in the recent / all events.
  """
  name: str
  item_feature: str
  candidate: str
  max_len: int
  p_favourite: float = 0.3
  p_match: float = 0.35
  recent: int = 8
  beta_recent: float = 0.6
  beta_any: float = 0.5


@dataclasses.dataclass(frozen=True)
class Preset:
  """Everything that defines a synthetic dataset besides the seed."""
  features: tuple[Feature, ...]
  streams: tuple[Stream, ...]
  pairs: tuple[tuple[str, str], ...]
  n_dense: int = 2
  domain_probs: tuple[float, ...] = (0.6, 0.4)
  tasks: tuple[str, ...] = ("click", "conversion")
  pair_top: int = 16
  pair_scale: float = 0.6
  dense_scale: float = 0.4
  dense_product: float = 0.4
  domain_bias: float = 0.3
  domain_dense: float = 0.3
  click_bias: float = -1.3
  conv_bias: float = -1.2
  conv_rho: float = 0.5


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        features=(Feature("user", 200, effect=0.6, top=32),
                  Feature("ad", 300, effect=0.6, top=32, conv_effect=0.4),
                  Feature("category", 50, effect=0.4, top=50)),
        streams=(Stream("clicks", "click_category", "category", max_len=16),),
        pairs=(("user", "category"),),
    ),
    # Learnable from the CPU demo's 512k rows: effects on the frequent values
    # (top 16-24 ranks, Zipf 1.2-1.3), interactions between the top-8 values of
    # each pair, strong sequence matches, a conversion logit that follows the click's.
    "small": Preset(
        features=(Feature("user_segment", 2000, zipf=1.3, effect=1.0, top=16),
                  Feature("ad_id", 3000, zipf=1.3, effect=1.0, top=16, conv_effect=0.8),
                  Feature("advertiser", 500, zipf=1.2, effect=0.9, top=16),
                  Feature("ad_category", 200, zipf=1.2, effect=0.9, top=24, conv_effect=0.8),
                  Feature("site", 300, zipf=1.2, effect=0.9, top=24),
                  Feature("device", 16, effect=0.5, top=16),
                  Feature("hour", 24, zipf=0.3, effect=0.5, top=24),
                  Feature("user_interests", 200, bag=4, zipf=1.2, effect=1.0, top=24)),
        streams=(Stream("clicks", "click_category", "ad_category", max_len=32,
                        beta_recent=1.0, beta_any=0.8),
                 Stream("views", "view_advertiser", "advertiser", max_len=64,
                        beta_recent=0.8, beta_any=0.6)),
        pairs=(("user_segment", "ad_category"), ("site", "advertiser"), ("device", "hour")),
        n_dense=4,
        domain_probs=(0.5, 0.3, 0.2),
        pair_top=8,
        pair_scale=1.0,
        dense_scale=0.5,
        dense_product=0.5,
        click_bias=-2.0,
        conv_bias=-1.5,
        conv_rho=0.8,
    ),
}


def _zipf_cdf(vocab: int, s: float) -> np.ndarray:
  p = np.arange(1, vocab + 1, dtype=np.float64) ** -s
  return np.cumsum(p / p.sum())


def _sample(rng: np.random.Generator, cdf: np.ndarray, size) -> np.ndarray:
  return np.minimum(np.searchsorted(cdf, rng.random(size), side="right"), len(cdf) - 1)


class _Hidden:
  """The hidden parameters of the generator (effects, permutations), from the data seed."""

  def __init__(self, preset: Preset, seed: int):
    rng = np.random.default_rng([seed, 0x5EED])
    p = preset
    self.cdf = {f.name: _zipf_cdf(f.vocab, f.zipf) for f in p.features}
    self.perm = {f.name: rng.permutation(f.vocab) for f in p.features}
    self.rank = {k: np.argsort(v) for k, v in self.perm.items()}  # id -> rank
    self.effect, self.conv_effect = {}, {}
    for f in p.features:
      e = np.zeros(f.vocab)
      e[:f.top] = rng.normal(0, f.effect, min(f.top, f.vocab))
      self.effect[f.name] = e
      e2 = np.zeros(f.vocab)
      e2[:f.top] = rng.normal(0, f.conv_effect, min(f.top, f.vocab)) if f.conv_effect else 0
      self.conv_effect[f.name] = e2
    self.pair_vec = {}
    for a, b in p.pairs:
      for name in (a, b):
        if name not in self.pair_vec:
          v = np.zeros((p_vocab(p, name), 2))
          k = min(p.pair_top, len(v))
          v[:k] = rng.normal(0, math.sqrt(p.pair_scale), (k, 2))
          self.pair_vec[name] = v
    nd = len(p.domain_probs)
    self.dense_w = rng.normal(0, p.dense_scale, p.n_dense)
    self.domain_bias = rng.normal(0, p.domain_bias, nd)
    self.domain_dense = rng.normal(0, p.domain_dense, nd)
    self.conv_domain_bias = rng.normal(0, p.domain_bias, nd)
    self.domain_cdf = np.cumsum(np.asarray(p.domain_probs) / np.sum(p.domain_probs))


def p_vocab(preset: Preset, name: str) -> int:
  for f in preset.features:
    if f.name == name:
      return f.vocab
  raise KeyError(f"unknown feature {name!r}")


def make_spec(preset: Preset) -> DataSpec:
  """The DataSpec of a preset: pooled features, then one item feature per stream."""
  sparse = [SparseFeatureSpec(f.name, f.vocab, f.bag) for f in preset.features]
  sparse += [SparseFeatureSpec(s.item_feature, p_vocab(preset, s.candidate))
             for s in preset.streams]
  seqs = tuple(SequenceStreamSpec(s.name, s.max_len, (s.item_feature,))
               for s in preset.streams)
  return DataSpec(n_dense=preset.n_dense, sparse=tuple(sparse), sequences=seqs,
                  num_domains=len(preset.domain_probs), tasks=preset.tasks)


class SyntheticSource:
  """A seeded source of synthetic batches (see the module docstring).

  Args:
    preset: a name in `PRESETS` or a `Preset`.
    seed: the data seed (hidden parameters and examples).
    split: 'train', 'eval' or 'oracle' (disjoint example streams, same hidden model).
    num_examples: examples per pass (None: endless; required for `repeat=False`).
  """

  def __init__(self, preset: str | Preset = "tiny", *, seed: int = 0, split: str = "train",
               num_examples: int | None = None):
    if isinstance(preset, str):
      if preset not in PRESETS:
        raise ValueError(f"unknown synthetic preset {preset!r}; known: {sorted(PRESETS)}")
      preset = PRESETS[preset]
    if split not in _SPLITS:
      raise ValueError(f"split must be one of {sorted(_SPLITS)}, got {split!r}")
    self.preset, self.seed, self.split = preset, int(seed), split
    self.num_examples = None if num_examples is None else int(num_examples)
    self.spec = make_spec(preset)
    self._h = _Hidden(preset, self.seed)

  @classmethod
  def from_config(cls, data_cfg: Any, split: str | None = None):
    """Sources from `data` config fields: preset ('tiny'), seed (0), eval_examples, train_examples.

    With `split=None` returns (train_source, eval_source), otherwise the one split.
    """
    get = data_cfg.get if hasattr(data_cfg, "get") else lambda k, d=None: getattr(data_cfg, k, d)
    preset, seed = get("preset", "tiny"), int(get("seed", 0))
    train = cls(preset, seed=seed, split="train", num_examples=get("train_examples", None))
    ev = cls(preset, seed=seed, split="eval", num_examples=get("eval_examples", 100_000))
    if split is None:
      return train, ev
    return {"train": train, "eval": ev}[split]

  @property
  def shared_vocab(self) -> dict[str, str]:
    """Sequence item feature -> the pooled feature whose ids it shares (share their table)."""
    return {s.item_feature: s.candidate for s in self.preset.streams}

  def describe(self) -> str:
    return f"synthetic({self.split}, seed={self.seed})"

  # -- generation ------------------------------------------------------------------
  def _block(self, stream_seed: int, k: int) -> dict:
    """Example block k (ROW_BLOCK rows) of this split; labels included."""
    p, h, n = self.preset, self._h, ROW_BLOCK
    rng = np.random.default_rng([self.seed, _SPLITS[self.split], stream_seed, k])
    ranks: dict[str, np.ndarray] = {}
    ids: dict[str, np.ndarray] = {}
    for f in p.features:
      if f.bag == 1:
        ranks[f.name] = _sample(rng, h.cdf[f.name], n)             # (n,)
      else:
        r = _sample(rng, h.cdf[f.name], (n, f.bag))                # (n, bag)
        size = rng.integers(1, f.bag + 1, n)
        ranks[f.name] = np.where(np.arange(f.bag)[None] < size[:, None], r, -1)
    seq: dict[str, dict] = {}
    for s in p.streams:
      L, cdf = s.max_len, h.cdf[s.candidate]
      length = rng.integers(0, L + 1, n).astype(np.int32)         # (n,)
      fav = _sample(rng, cdf, n)
      items = np.where(rng.random((n, L)) < s.p_favourite, fav[:, None],
                       _sample(rng, cdf, (n, L)))                  # (n, L) ranks
      valid = np.arange(L)[None] < length[:, None]                 # (n, L)
      pick = items[np.arange(n), (rng.random(n) * np.maximum(length, 1)).astype(int)]
      take = (rng.random(n) < s.p_match) & (length > 0)
      ranks[s.candidate] = np.where(take, pick, ranks[s.candidate])
      ranks[s.item_feature] = np.where(valid, items, -1)
      gaps = rng.exponential(3600.0, (n, L))
      seq[s.name] = {
          "len": length,
          "action": np.where(valid, rng.integers(1, 4, (n, L)), 0).astype(np.int32),
          "surface": np.where(valid, rng.integers(0, 4, (n, L)), 0).astype(np.int32),
          "dt": np.where(valid, np.cumsum(gaps, 1), 0).astype(np.float32),
      }
    perm_of = dict(self.shared_vocab)
    for name, r in ranks.items():
      perm = h.perm[perm_of.get(name, name)]
      ids[name] = np.where(r >= 0, perm[np.maximum(r, 0)], -1).astype(np.int64)
      if ids[name].ndim == 1:
        ids[name] = ids[name][:, None]
    batch = {
        "dense": rng.normal(size=(n, p.n_dense)).astype(np.float32),
        "ids": ids,
        "seq": seq,
        "domain": np.minimum(np.searchsorted(h.domain_cdf, rng.random(n), side="right"),
                             len(h.domain_cdf) - 1).astype(np.int32),
    }
    z = self.true_logits(batch)                                    # (n, T)
    u = rng.random(z.shape)
    labels = (u < 1 / (1 + np.exp(-z))).astype(np.float32)
    mask = np.ones_like(labels)
    if len(p.tasks) > 1:
      mask[:, 1:] = labels[:, :1]                                  # observed after a click
      labels[:, 1:] *= mask[:, 1:]
    batch["labels"], batch["label_mask"] = labels, mask
    return batch

  def examples(self, start: int, stop: int, stream_seed: int = 0) -> dict:
    """Examples [start, stop) of this split's stream (global example indices)."""
    if stop <= start:
      raise ValueError(f"empty range [{start}, {stop})")
    k0, k1 = start // ROW_BLOCK, (stop - 1) // ROW_BLOCK + 1
    blocks = [self._block(stream_seed, k) for k in range(k0, k1)]
    lo = start - k0 * ROW_BLOCK
    return _tree_concat(blocks, lo, lo + stop - start)

  # -- ground truth ----------------------------------------------------------------
  def _ranks(self, batch: Mapping) -> dict[str, np.ndarray]:
    perm_of = dict(self.shared_vocab)
    out = {}
    for name, x in batch["ids"].items():
      rank = self._h.rank[perm_of.get(name, name)]
      x = np.asarray(x)
      out[name] = np.where(x >= 0, rank[np.maximum(x, 0)], -1)
    return out

  def _match(self, s: Stream, r: Mapping) -> tuple[np.ndarray, np.ndarray]:
    cand = r[s.candidate][:, 0][:, None]                           # (B, 1)
    hit = (r[s.item_feature] == cand) & (r[s.item_feature] >= 0)   # (B, L)
    return hit[:, :s.recent].any(1), hit.any(1)

  def true_logits(self, batch: Mapping) -> np.ndarray:
    """The ground-truth logits (B, T) of a batch (float64)."""
    p, h = self.preset, self._h
    r = self._ranks(batch)
    x = np.asarray(batch["dense"], np.float64)
    dom = np.asarray(batch["domain"])
    f = np.zeros(len(dom))
    f2 = np.zeros(len(dom))
    for ft in p.features:
      rk = r[ft.name]
      valid = rk >= 0
      cnt = np.maximum(valid.sum(1), 1)
      f += np.where(valid, h.effect[ft.name][np.maximum(rk, 0)], 0).sum(1) / cnt
      f2 += np.where(valid, h.conv_effect[ft.name][np.maximum(rk, 0)], 0).sum(1) / cnt
    for a, b in p.pairs:
      f += np.sum(h.pair_vec[a][r[a][:, 0]] * h.pair_vec[b][r[b][:, 0]], 1)
    f += x @ h.dense_w + p.dense_product * x[:, 0] * x[:, 1 % p.n_dense]
    f += h.domain_dense[dom] * x[:, 0]
    for s in p.streams:
      recent, anyw = self._match(s, r)
      f += s.beta_recent * recent + s.beta_any * anyw
    click = p.click_bias + h.domain_bias[dom] + f
    if len(p.tasks) == 1:
      return click[:, None]
    conv = p.conv_bias + h.conv_domain_bias[dom] + p.conv_rho * f + f2
    return np.stack([click, conv], 1)

  def oracle_auc(self, n: int = 200_000) -> dict[str, float]:
    """AUC of the true probability on n fresh examples ('oracle' split): the best achievable.

    Returns `auc/TASK` (over observed labels) and `auc`, their mean.
    """
    src = SyntheticSource(self.preset, seed=self.seed, split="oracle")
    b = src.examples(0, n)
    z = src.true_logits(b)
    out = {}
    for t, name in enumerate(self.preset.tasks):
      keep = b["label_mask"][:, t] > 0
      out[f"auc/{name}"] = rank_auc(z[keep, t], b["labels"][keep, t])
    out["auc"] = float(np.mean([out[f"auc/{t}"] for t in self.preset.tasks]))
    return out

  def structure_features(self, batch: Mapping) -> tuple[np.ndarray, np.ndarray, int]:
    """The true structure as model inputs: (cat_index (B, C), cat_weight (B, C), n_cat).

    Columns: every pooled feature value (multi-hot: weight 1/size), every
    (top-M x top-M) cell of each interacting pair, domain, the stream match
    indicators; then dense x, x_0 x_1 and x_0 per domain as index columns of
    weight x. A logistic regression `sum_c w[cat_index] * cat_weight` over them
    can represent the ground-truth logit of every task exactly.
    """
    p, h = self.preset, self._h
    r = self._ranks(batch)
    x = np.asarray(batch["dense"], np.float64)
    dom = np.asarray(batch["domain"])
    b = len(dom)
    idx, wts, off = [], [], 0
    for ft in p.features:
      rk = r[ft.name]
      valid = rk >= 0
      idx.append(np.where(valid, off + rk, off))
      wts.append(valid / np.maximum(valid.sum(1, keepdims=True), 1))
      off += ft.vocab
    for a, c in p.pairs:
      m = p.pair_top
      ra, rc = r[a][:, 0], r[c][:, 0]
      inside = (ra < m) & (rc < m)
      idx.append((off + np.where(inside, ra * m + rc, 0))[:, None])
      wts.append(inside[:, None].astype(np.float64))
      off += m * m
    nd = len(p.domain_probs)
    idx.append((off + dom)[:, None])
    wts.append(np.ones((b, 1)))
    off += nd
    for s in p.streams:
      recent, anyw = self._match(s, r)
      idx.append(np.stack([np.full(b, off), np.full(b, off + 1)], 1))
      wts.append(np.stack([recent, anyw], 1).astype(np.float64))
      off += 2
    dense_cols = [x, (x[:, 0] * x[:, 1 % p.n_dense])[:, None]]
    for d in range(nd):
      dense_cols.append((x[:, 0] * (dom == d))[:, None])
    dense = np.concatenate(dense_cols, 1)                          # (B, n_dense + 1 + nd)
    idx.append(off + np.broadcast_to(np.arange(dense.shape[1]), dense.shape))
    wts.append(dense)
    off += dense.shape[1]
    return np.concatenate(idx, 1).astype(np.int32), np.concatenate(wts, 1), off

  # -- iteration -------------------------------------------------------------------
  def batches(self, batch_size: int, *, process_index: int = 0, process_count: int = 1,
              seed: int = 0, repeat: bool = True, state: dict | None = None):
    """Iterator over this process's `batch_size // process_count` rows of each global batch.

    `seed` selects the example stream. With `num_examples` set the stream
    is a fixed set of that many examples (repeated each epoch when `repeat`);
    with `repeat=False` one pass, the last batch padded with label_mask = 0.
    """
    return SyntheticIterator(self, batch_size, process_index=process_index,
                             process_count=process_count, seed=seed, repeat=repeat,
                             state=state)


class SyntheticIterator:
  """Batches of a `SyntheticSource`; `state()` = {'batch': batches handed out, ...}."""

  def __init__(self, source: SyntheticSource, batch_size: int, *, process_index: int = 0,
               process_count: int = 1, seed: int = 0, repeat: bool = True,
               state: dict | None = None):
    if batch_size <= 0 or batch_size % process_count:
      raise ValueError(f"global batch_size {batch_size} must be a positive multiple of "
                       f"process_count {process_count}")
    if not 0 <= process_index < process_count:
      raise ValueError(f"process_index {process_index} not in [0, {process_count})")
    if not repeat and source.num_examples is None:
      raise ValueError("repeat=False needs a source with num_examples (one pass)")
    self.source, self.batch_size = source, int(batch_size)
    self.local = batch_size // process_count
    self.process_index, self.seed, self.repeat = process_index, int(seed), repeat
    self._batch = 0
    if state is not None:
      for k in ("seed", "batch_size"):
        if state[k] != getattr(self, k):
          raise ValueError(f"cannot resume: iterator state has {k}={state[k]}, "
                           f"this iterator {k}={getattr(self, k)}")
      self._batch = int(state["batch"])

  def state(self) -> dict:
    """JSON-serialisable position after the last batch returned."""
    return {"batch": self._batch, "seed": self.seed, "batch_size": self.batch_size}

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    n_total = self.source.num_examples
    start = self._batch * self.batch_size + self.process_index * self.local
    if not self.repeat and self._batch * self.batch_size >= n_total:
      raise StopIteration
    if n_total is None or not self.repeat:
      out = self.source.examples(start, start + self.local, self.seed)
      if n_total is not None:
        pad = np.arange(start, start + self.local) >= n_total      # (b,)
        out["label_mask"][pad] = 0
    else:  # a fixed set of n_total examples, epoch after epoch
      rows = np.arange(start, start + self.local) % n_total
      splits = np.flatnonzero(np.diff(rows) != 1) + 1
      parts = [self.source.examples(int(c[0]), int(c[-1]) + 1, self.seed)
               for c in np.split(rows, splits)]
      out = _tree_concat(parts, 0, self.local)
    self._batch += 1
    return out

  def close(self) -> None:
    pass


def _tree_concat(trees: Sequence[dict], lo: int, hi: int) -> dict:
  """Concatenates dicts of arrays along axis 0 and keeps rows [lo, hi)."""
  first = trees[0]
  if isinstance(first, dict):
    return {k: _tree_concat([t[k] for t in trees], lo, hi) for k in first}
  return np.concatenate(trees, 0)[lo:hi]


def rank_auc(scores: np.ndarray, labels: np.ndarray) -> float:
  """Exact AUC (Mann-Whitney, ties counted 1/2) of scores for 0/1 labels."""
  scores = np.asarray(scores, np.float64)
  labels = np.asarray(labels) > 0.5
  _, inv, counts = np.unique(scores, return_inverse=True, return_counts=True)
  ends = np.cumsum(counts)
  mid = ends - (counts - 1) / 2.0                                  # mid-rank of each value
  ranks = mid[inv]
  n_pos, n_neg = labels.sum(), (~labels).sum()
  if n_pos == 0 or n_neg == 0:
    return float("nan")
  return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))
