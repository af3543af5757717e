"""data.kind 'long_history': the long-history generator (gem_jax/data/long_history.py) as a
trainer source.

Batch (the contract of gem_jax/data/spec.py), per user:
  ids/candidate      (B, 1) int64   the candidate item, in [0, vocab)
  ids/history_item   (B, L) int64   the history's items, newest first, -1 padded; shares
                                    candidate's vocabulary (`shared_vocab`: one table)
  seq/history        len (B,) int32; action (B, L) int32 (1 = an event, 0 = padding);
                     surface (B, L) int32 (0); dt (B, L) float32 seconds (0 padded)
  dense              (B, 1) float32 log1p(len) / 10 (the history length, which the model
                     also reads from len)
  domain (B,) 0; labels / label_mask (B, 1): one task 'click', every label observed

Knobs (config.data; a field missing from the block takes the generator's default):
  max_len (4096; configs/base.py's default is movielens' 50: set it), median (300),
  sigma (1), p_empty (0.02), vocab (100000), recent (64), p_deep (0.35), p_recent (0.15),
  beta (3), bias (-1.5), mean_gap_s (3600): LongHistory's fields, same meaning;
  seed (0): the data seed; train_examples (None/0: endless), eval_examples (0: 10000).

Rows come in blocks of BLOCK users, block k of a split drawn by
`LongHistory.batch(BLOCK, rng(seed, split, stream seed, k))`: a global batch is the
same whatever the process count (process p gets its rows of it), `state()` resumes
exactly (`SyntheticIterator`), and 'eval' and 'oracle' are other streams than 'train'.
`oracle_auc(n)` gives the AUC of the true logit (`auc`) and of the best logit of the
newest `recent` events (`short_auc`). `leaf_chunks` feeds scripts/preprocess.py
(gem_jax/data/convert.py), which stores the history columns jagged (len[i] values a row).
"""
from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, Iterator, Mapping

import numpy as np

from gem_jax.data.long_history import LongHistory
from gem_jax.data.spec import DataSpec, SequenceStreamSpec, SparseFeatureSpec
from gem_jax.data.synthetic import SyntheticIterator, rank_auc

BLOCK = 64
DEFAULT_EVAL = 10_000
_SPLITS = {"train": 1, "eval": 2, "oracle": 3}
KNOBS = tuple(f.name for f in dataclasses.fields(LongHistory))
_INTS = ("max_len", "vocab", "recent")


def check(gen: LongHistory) -> None:
  """One-line ValueError naming the first bad field of `gen` (as config.data.FIELD)."""
  g = gen
  rules = [
      ("max_len", g.max_len >= 1, ">= 1"), ("median", g.median > 0, "> 0"),
      ("sigma", g.sigma >= 0, ">= 0"), ("p_empty", 0 <= g.p_empty <= 1, "in [0, 1]"),
      ("vocab", g.vocab >= 1, ">= 1"), ("recent", 0 <= g.recent <= g.max_len,
                                        f"in [0, max_len={g.max_len}]"),
      ("p_deep", 0 <= g.p_deep <= 1, "in [0, 1]"),
      ("p_recent", 0 <= g.p_recent <= 1 - g.p_deep, f"in [0, 1 - p_deep={g.p_deep}]"),
      ("beta", math.isfinite(g.beta), "finite"), ("bias", math.isfinite(g.bias), "finite"),
      ("mean_gap_s", g.mean_gap_s > 0, "> 0")]
  for name, ok, want in rules:
    if not ok:
      raise ValueError(f"config.data.{name}={getattr(g, name)!r} must be {want} "
                       "(data.kind 'long_history')")


def generator(data_cfg: Any) -> LongHistory:
  """The LongHistory of the `KNOBS` of a config's data block (missing: its default)."""
  get = data_cfg.get if hasattr(data_cfg, "get") else lambda k, d=None: getattr(data_cfg, k, d)
  kw = {}
  for f in dataclasses.fields(LongHistory):
    v = get(f.name, f.default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (
        f.name in _INTS and float(v) != int(v)):
      raise ValueError(f"config.data.{f.name}={v!r} must be "
                       f"{'an integer' if f.name in _INTS else 'a number'}")
    kw[f.name] = int(v) if f.name in _INTS else float(v)
  gen = LongHistory(**kw)
  check(gen)
  return gen


def make_spec(gen: LongHistory) -> DataSpec:
  return DataSpec(
      n_dense=1,
      sparse=(SparseFeatureSpec("candidate", gen.vocab),
              SparseFeatureSpec("history_item", gen.vocab)),
      sequences=(SequenceStreamSpec("history", gen.max_len, ("history_item",),
                                    num_actions=2, num_surfaces=1),),
      num_domains=1, tasks=("click",))


def expected_tokens(max_len: int, median: float, sigma: float, num_cls: int = 4) -> float:
  """num_cls + E[min(n, max_len)] of n ~ LogNormal(log median, sigma): one history's tokens
  (empty histories and the rounding of n ignored: slightly more than the data has)."""
  if sigma == 0:
    return num_cls + min(median, max_len)
  mu, m = math.log(median), math.log(max_len)
  phi = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
  below = math.exp(mu + sigma ** 2 / 2) * phi((m - mu - sigma ** 2) / sigma)
  return num_cls + below + max_len * (1 - phi((m - mu) / sigma))


def pack_rows(rows: int, max_len: int, median: float, sigma: float, num_cls: int = 4,
              margin: float = 1.6) -> int:
  """seq_pack_rows for a batch shard of `rows` histories in rows of max_len + num_cls tokens:
  max(2, ceil(margin * rows * expected_tokens / (max_len + num_cls)))."""
  tokens = rows * expected_tokens(max_len, median, sigma, num_cls)
  return max(2, math.ceil(margin * tokens / (max_len + num_cls)))


class LongHistorySource:
  """One split of the long-history data (module docstring).

  Args:
    gen: the generator (`generator(data_cfg)` reads it from a config).
    seed: the data seed.
    split: 'train', 'eval' or 'oracle' (disjoint streams).
    num_examples: rows per pass (None: endless).
  """

  shared_vocab = {"history_item": "candidate"}
  shuffle_buffer = 0        # for gem_jax.data.convert: generated rows have no bad rows
  bad_row_limit = 0.0
  bad_row_min_rows = 0

  def __init__(self, gen: LongHistory | None = None, *, seed: int = 0, split: str = "train",
               num_examples: int | None = None):
    gen = LongHistory() if gen is None else gen
    check(gen)
    if split not in _SPLITS:
      raise ValueError(f"split must be one of {sorted(_SPLITS)}, got {split!r}")
    if num_examples is not None and num_examples < 0:
      raise ValueError(f"num_examples={num_examples} must be >= 0")
    self.gen, self.seed, self.split = gen, int(seed), split
    self.num_examples = None if num_examples is None else int(num_examples)
    self.spec = make_spec(gen)
    self._cache: collections.OrderedDict = collections.OrderedDict()

  @classmethod
  def from_config(cls, data_cfg: Any, split: str) -> "LongHistorySource":
    """The `split` ('train' | 'eval') source of a config's data block."""
    get = data_cfg.get if hasattr(data_cfg, "get") else lambda k, d=None: getattr(data_cfg, k, d)
    gen = generator(data_cfg)
    if split not in ("train", "eval"):
      raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    field = "train_examples" if split == "train" else "eval_examples"
    n = get(field, None)
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
      raise ValueError(f"config.data.{field}={n!r} must be an integer >= 0")
    if split == "eval":
      n = n or DEFAULT_EVAL
    return cls(gen, seed=int(get("seed", 0)), split=split, num_examples=n or None)

  def describe(self) -> str:
    return (f"long_history({self.split}, seed={self.seed}, max_len={self.gen.max_len}, "
            f"n={self.num_examples})")

  # -- rows ------------------------------------------------------------------------
  def raw_block(self, stream_seed: int, k: int) -> dict[str, np.ndarray]:
    """The generator's output for block k (BLOCK users) of this split's stream."""
    rng = np.random.default_rng([self.seed, _SPLITS[self.split], int(stream_seed), int(k)])
    return self.gen.batch(BLOCK, rng)

  def _block(self, stream_seed: int, k: int) -> dict:
    key = (stream_seed, k)
    if key in self._cache:
      self._cache.move_to_end(key)
      return self._cache[key]
    r = self.raw_block(stream_seed, k)
    n, L = BLOCK, self.gen.max_len
    length = r["lengths"].astype(np.int32)
    valid = np.arange(L)[None, :] < length[:, None]                  # (n, L)
    out = {
        "dense": (np.log1p(length) / 10.0).astype(np.float32)[:, None],
        "ids": {"candidate": r["candidate"].astype(np.int64)[:, None],
                "history_item": r["items"].astype(np.int64)},
        "seq": {"history": {"len": length, "action": valid.astype(np.int32),
                            "surface": np.zeros((n, L), np.int32), "dt": r["dt"]}},
        "domain": np.zeros(n, np.int32),
        "labels": r["label"].astype(np.float32)[:, None],
        "label_mask": np.ones((n, 1), np.float32),
    }
    self._cache[key] = out
    while len(self._cache) > 4:
      self._cache.popitem(last=False)
    return out

  def examples(self, start: int, stop: int, stream_seed: int = 0) -> dict:
    """Rows [start, stop) of this split's stream (global row indices); fresh arrays."""
    if stop <= start:
      raise ValueError(f"empty range [{start}, {stop})")
    k0, k1 = start // BLOCK, (stop - 1) // BLOCK + 1
    lo = start - k0 * BLOCK
    return _concat([self._block(stream_seed, k) for k in range(k0, k1)], lo, lo + stop - start)

  def batches(self, batch_size: int, *, process_index: int = 0, process_count: int = 1,
              seed: int = 0, repeat: bool = True, state: dict | None = None):
    """This process's `batch_size // process_count` rows of each global batch
    (`SyntheticIterator`: exact resume from `state()`; repeat=False pads with label_mask 0)."""
    return SyntheticIterator(self, batch_size, process_index=process_index,
                             process_count=process_count, seed=seed, repeat=repeat,
                             state=state)

  def leaf_chunks(self, chunk_rows: int) -> Iterator[dict[str, np.ndarray]]:
    """One pass (stream seed 0) as flat leaves ('ids/candidate', ...) of <= chunk_rows rows:
    what gem_jax.data.convert writes."""
    from gem_jax.data import columnar  # pylint: disable=import-outside-toplevel
    if not self.num_examples:
      field = "train_examples" if self.split == "train" else "eval_examples"
      raise ValueError(f"{self.describe()}: the stream is endless; set config.data.{field} "
                       "to the rows to convert")
    step = max(1, min(int(chunk_rows), 4096))
    for a in range(0, self.num_examples, step):
      yield columnar.flatten(self.examples(a, min(a + step, self.num_examples)))

  # -- ground truth ----------------------------------------------------------------
  def true_logits(self, batch: Mapping) -> np.ndarray:
    """The logits (B, 1) the labels are drawn from: bias + beta * 1[candidate in history]."""
    items = np.asarray(batch["ids"]["history_item"])
    cand = np.asarray(batch["ids"]["candidate"])[:, :1]
    valid = np.arange(items.shape[1])[None, :] < np.asarray(batch["seq"]["history"]["len"])[:, None]
    hit = ((items == cand) & valid).any(1)
    return (self.gen.bias + self.gen.beta * hit)[:, None].astype(np.float64)

  def oracle_auc(self, n: int = 20_000) -> dict[str, float]:
    """On n fresh users (the 'oracle' stream): `auc` (= `auc/click`) of the true logit, the
    best achievable, and `short_auc` of the best logit of the newest `recent` events."""
    n = int(n) if n and n > 0 else 20_000
    src = LongHistorySource(self.gen, seed=self.seed, split="oracle")
    raws = [src.raw_block(0, k) for k in range(-(-n // BLOCK))]
    raw = {k: np.concatenate([r[k] for r in raws])[:n] for k in raws[0]}
    auc = rank_auc(raw["logit"], raw["label"])
    return {"auc/click": auc, "auc": auc,
            "short_auc": rank_auc(self.gen.short_logit(raw), raw["label"])}


def _concat(trees, lo: int, hi: int):
  if isinstance(trees[0], dict):
    return {k: _concat([t[k] for t in trees], lo, hi) for k in trees[0]}
  return np.concatenate(trees, 0)[lo:hi]   # a copy: callers may write into it
