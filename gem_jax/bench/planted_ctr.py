"""Planted CTR data in the raw Criteo TSV format, with a known optimum (the quality benchmark).

A row is `label \\t I1..I13 \\t C1..C26` (gem_jax/data/criteo.py reads it). Each of the 26
categorical fields f has a cardinality V_f and values v_f ~ p_f(rank) ∝ (rank + 1)^-s
(s = 0.8, or 1.05 on the heavy-tailed fields), shown as a fixed random 8-hex-digit id;
the 13 integer fields are counts x_j = floor(exp(mu_j + sigma_j z_j)), z_j ~ N(0, 1), and
the reader's dense feature is log1p(x_j). The click logit is

  f = b + sum_f w_f[v_f]                                        first order
        + sum_j c_j z_j                                         dense, linear
        + sum_{(a,b) in P} <U_a^(a,b)[v_a], U_b^(a,b)[v_b]>     low-rank field pairs  ('pairs')
        + sum_{(a,b,c) in T} sum_r U_a[v_a,r] U_b[v_b,r] U_c[v_c,r]   3-way ('triples')
        + sum_{(a,j) in Q} g_a[v_a] z_j                         categorical x dense ('catdense')

and y ~ Bernoulli(sigmoid(f)). Every kind has the first-order and dense terms; b is set so
that the click rate is `ctr`. The kinds:

  pairs     26 fields of 5-200 values, 12 planted pairs of rank 2
  triples   the same fields, 8 planted triples of rank 2 (and no pairs)
  catdense  the same fields, 10 planted (field, dense) products
  heavy     'pairs' with 6 fields of 10^5-10^6 values (s = 1.05; hashed into the tables)
  mixed     pairs + triples + catdense together

The oracle knows f: `oracle` metrics are the AUC and log loss of sigmoid(f) on the eval rows,
the best any model can do. Everything is fixed by (kind, seed): two calls write the same bytes.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import numpy as np

N_INT, N_CAT = 13, 26
KINDS = ("pairs", "triples", "catdense", "heavy", "mixed")


@dataclasses.dataclass(frozen=True)
class Truth:
  """The hidden generative model of one (kind, seed)."""
  cards: np.ndarray              # (26,) values per field
  skew: np.ndarray               # (26,) Zipf exponent per field
  hex_ids: list                  # 26 x (V_f,) uint32 ids shown in the file
  first: list                    # 26 x (V_f,) first-order effects w_f
  dense_w: np.ndarray            # (13,) c_j
  mu: np.ndarray                 # (13,) log-count means
  sigma: np.ndarray              # (13,) log-count scales
  pairs: list                    # [(a, b, U_a (V_a, r), U_b (V_b, r))]
  triples: list                  # [(a, b, c, U_a, U_b, U_c)]
  catdense: list                 # [(a, j, g_a (V_a,))]
  bias: float


def _effects(rng, n: int, scale: float) -> np.ndarray:
  return (scale * rng.standard_normal(n)).astype(np.float64)


def make_truth(kind: str, seed: int, ctr: float = 0.25) -> Truth:
  """The generative model of `kind` (module docstring), fixed by `seed`."""
  if kind not in KINDS:
    raise ValueError(f"kind={kind!r}: expected one of {KINDS}")
  rng = np.random.default_rng([seed, KINDS.index(kind), 7031])
  cards = np.exp(rng.uniform(math.log(5), math.log(200), N_CAT)).astype(np.int64)
  skew = np.full(N_CAT, 0.8)
  if kind == "heavy":
    big = rng.choice(N_CAT, 6, replace=False)
    cards[big] = np.exp(rng.uniform(math.log(1e5), math.log(1e6), 6)).astype(np.int64)
    skew[big] = 1.05
  hex_ids = [rng.choice(1 << 32, size=int(v), replace=False).astype(np.uint32) for v in cards]
  first = [_effects(rng, int(v), 0.35) for v in cards]
  dense_w = 0.25 * rng.standard_normal(N_INT)
  mu, sigma = rng.uniform(0.5, 3.0, N_INT), rng.uniform(0.5, 1.5, N_INT)
  fields = np.arange(N_CAT)
  pairs, triples, catdense = [], [], []
  if kind in ("pairs", "heavy", "mixed"):
    n_pairs, rank = 12, 2
    chosen = set()
    while len(chosen) < n_pairs:
      a, b = sorted(rng.choice(fields, 2, replace=False).tolist())
      chosen.add((a, b))
    scale = 1.0 / math.sqrt(rank)  # each pair term has variance ~ 1 / rank * rank = 1 ... / rank
    for a, b in sorted(chosen):
      pairs.append((a, b, scale * rng.standard_normal((cards[a], rank)),
                    rng.standard_normal((cards[b], rank))))
  if kind in ("triples", "mixed"):
    chosen = set()
    while len(chosen) < 8:
      chosen.add(tuple(sorted(rng.choice(fields, 3, replace=False).tolist())))
    for a, b, c in sorted(chosen):
      us = [rng.standard_normal((cards[f], 2)) for f in (a, b, c)]
      triples.append((a, b, c, us[0] / math.sqrt(2), us[1], us[2]))
  if kind in ("catdense", "mixed"):
    chosen = set()
    while len(chosen) < 10:
      chosen.add((int(rng.choice(fields)), int(rng.integers(N_INT))))
    for a, j in sorted(chosen):
      catdense.append((a, j, 0.8 * rng.standard_normal(cards[a])))
  truth = Truth(cards, skew, hex_ids, first, dense_w, mu, sigma, pairs, triples, catdense, 0.0)
  # Interaction terms are scaled so their total has unit variance, then the bias sets the CTR.
  sample = _draw(truth, np.random.default_rng([seed, 99]), 50_000)
  inter = _interactions(truth, sample["values"], sample["z"])
  if np.std(inter) > 0:
    k = 1.5 / np.std(inter)
    truth = dataclasses.replace(
        truth, pairs=[(a, b, k * ua, ub) for a, b, ua, ub in truth.pairs],
        triples=[(a, b, c, k * ua, ub, uc) for a, b, c, ua, ub, uc in truth.triples],
        catdense=[(a, j, k * g) for a, j, g in truth.catdense])
  logit = _logit(truth, sample["values"], sample["z"])
  lo, hi = -20.0, 20.0
  for _ in range(60):  # bisection: mean sigmoid(f + b) = ctr
    mid = (lo + hi) / 2
    if np.mean(1 / (1 + np.exp(-(logit + mid)))) < ctr:
      lo = mid
    else:
      hi = mid
  return dataclasses.replace(truth, bias=(lo + hi) / 2)


def _draw(truth: Truth, rng, n: int) -> dict:
  values = np.empty((n, N_CAT), np.int64)
  for f, (v, s) in enumerate(zip(truth.cards, truth.skew)):
    p = (np.arange(1, v + 1, dtype=np.float64)) ** -s
    values[:, f] = rng.choice(v, size=n, p=p / p.sum())
  z = rng.standard_normal((n, N_INT))
  return {"values": values, "z": z}


def _interactions(truth: Truth, values: np.ndarray, z: np.ndarray) -> np.ndarray:
  out = np.zeros(len(values))
  for a, b, ua, ub in truth.pairs:
    out += np.sum(ua[values[:, a]] * ub[values[:, b]], axis=1)
  for a, b, c, ua, ub, uc in truth.triples:
    out += np.sum(ua[values[:, a]] * ub[values[:, b]] * uc[values[:, c]], axis=1)
  for a, j, g in truth.catdense:
    out += g[values[:, a]] * z[:, j]
  return out


def _logit(truth: Truth, values: np.ndarray, z: np.ndarray) -> np.ndarray:
  f = truth.bias + z @ truth.dense_w + _interactions(truth, values, z)
  for k, w in enumerate(truth.first):
    f += w[values[:, k]]
  return f


def _rows(truth: Truth, values: np.ndarray, z: np.ndarray, labels: np.ndarray) -> bytes:
  counts = np.floor(np.exp(truth.mu + truth.sigma * z)).astype(np.int64)  # (n, 13)
  cols = [labels.astype(np.int64).astype(str)]
  cols += [counts[:, j].astype(str) for j in range(N_INT)]
  for f in range(N_CAT):
    hexes = np.array([f"{h:08x}" for h in truth.hex_ids[f]]) if truth.cards[f] <= 4096 else None
    ids = truth.hex_ids[f][values[:, f]]
    cols.append(hexes[values[:, f]] if hexes is not None else
                np.char.zfill(np.char.mod("%x", ids.astype(np.int64)), 8))
  lines = ["\t".join(r) for r in zip(*[c.tolist() for c in cols])]
  return ("\n".join(lines) + "\n").encode()


def write(out_dir: str, kind: str, seed: int, train_rows: int, eval_rows: int,
          chunk: int = 200_000) -> dict[str, Any]:
  """Writes train.tsv / eval.tsv under out_dir (skipped when meta.json says they exist).

  Returns the metadata: paths, rows, click rates and the oracle's eval AUC and log loss.
  """
  meta_path = os.path.join(out_dir, "meta.json")
  want = {"kind": kind, "seed": seed, "train_rows": train_rows, "eval_rows": eval_rows}
  if os.path.exists(meta_path):
    with open(meta_path) as f:
      meta = json.load(f)
    if all(meta.get(k) == v for k, v in want.items()):
      return meta
  os.makedirs(out_dir, exist_ok=True)
  truth = make_truth(kind, seed)
  meta = dict(want)
  for split, n, key in (("train", train_rows, 1), ("eval", eval_rows, 2)):
    path = os.path.join(out_dir, f"{split}.tsv")
    rng = np.random.default_rng([seed, KINDS.index(kind), key])
    clicks, probs, ys = 0, [], []
    with open(path + ".tmp", "wb") as out:
      for start in range(0, n, chunk):
        d = _draw(truth, rng, min(chunk, n - start))
        p = 1 / (1 + np.exp(-_logit(truth, d["values"], d["z"])))
        y = (rng.random(len(p)) < p).astype(np.int64)
        clicks += int(y.sum())
        if split == "eval":
          probs.append(p)
          ys.append(y)
        out.write(_rows(truth, d["values"], d["z"], y))
    os.replace(path + ".tmp", path)
    meta[split] = path
    meta[f"{split}_ctr"] = clicks / n
    if split == "eval":
      p, y = np.concatenate(probs), np.concatenate(ys)
      meta["oracle_auc"] = auc(y, p)
      meta["oracle_logloss"] = logloss(y, p)
      meta["base_logloss"] = logloss(y, np.full_like(p, meta["train_ctr"]))
  with open(meta_path, "w") as f:
    json.dump(meta, f, indent=1)
  return meta


def auc(y: np.ndarray, p: np.ndarray) -> float:
  """Exact ROC AUC (ties count 1/2) by ranks."""
  order = np.argsort(p, kind="stable")
  ranks = np.empty(len(p))
  sp = p[order]
  # average ranks over ties
  _, start, counts = np.unique(sp, return_index=True, return_counts=True)
  avg = start + (counts - 1) / 2.0 + 1
  ranks[order] = np.repeat(avg, counts)
  pos = y.astype(bool)
  n1, n0 = pos.sum(), (~pos).sum()
  return float((ranks[pos].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def logloss(y: np.ndarray, p: np.ndarray) -> float:
  p = np.clip(p, 1e-7, 1 - 1e-7)
  return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))
