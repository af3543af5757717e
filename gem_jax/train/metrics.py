"""Streaming evaluation metrics: AUC, log loss, NE and calibration per task and domain.

The accumulators are a plain dict pytree of fp32 `jnp` arrays, so they can live
inside the train state (sharded/replicated like any other leaf, donated to the
jitted step and saved by the checkpoint). `update` is pure and jit-able;
`compute` runs on the host at log/eval cadence.

Accumulators (T tasks, D domains, NB bins):

  hist:   (T, D, 2, NB)  label-weighted counts of predictions per score bin;
                         [..., 0, :] negatives, [..., 1, :] positives
  loss:   (T, D)         sum_i m_i * logloss_i
  pred:   (T, D)         sum_i m_i * sigmoid(z_i)
  label:  (T, D)         sum_i m_i * y_i
  weight: (T, D)         sum_i m_i

Streaming AUC. Bins are uniform in the logit z on [-LOGIT_RANGE, LOGIT_RANGE]
(logits outside fall in the edge bins), i.e. a histogram of the predicted
probability with edges sigmoid(z_k); binning in logit space keeps resolution
where predictions of a well-calibrated model with a low base rate crowd near 0.
With P_b, N_b the positive/negative mass in bin b:

  AUC = sum_b N_b * (P_{>b} + P_b / 2) / (P * N),   P_{>b} = sum_{c > b} P_c

which is the exact rank AUC (ties counted 1/2) of the scores rounded to bins.
Only pairs that share a bin can be ordered differently than by the exact
scores, so

  |AUC_hist - AUC_exact| <= (1/2) * sum_b P_b N_b / (P * N)      (`auc_tie_bound`)

For scores with bounded densities f+, f- of the positive/negative logits this
is about (w / 2) * integral f+ f- dz with bin width w = 2 * LOGIT_RANGE / NB:
w = 2e-3 for the default NB = 2^14, so the bound is < 1e-3 for any logit
density below ~1 per unit of logit (std >~ 0.4), and the actual error is much
smaller because within-bin orderings average out. Counts are fp32 and exact up
to 2^24 per bin.

NE (normalised entropy) = mean log loss / H(p),
H(p) = -p log p - (1 - p) log(1 - p), with p the observed base rate.
H(p) is the log loss of predicting p for every row (`base_rate_logloss`): a
model with NE > 1 is worse than that constant.
Calibration = mean prediction / mean label (1 is perfectly calibrated).

`metric_mode(name)` says whether a larger or a smaller value of a metric is better
(AUC: 'max'; log loss, NE, losses: 'min'): the one place the best checkpoint and
early stopping read that from.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

LOGIT_RANGE = 16.0
DEFAULT_NUM_BINS = 2 ** 14


def init_accumulators(n_tasks: int, n_domains: int = 1,
                      num_bins: int = DEFAULT_NUM_BINS) -> dict[str, jax.Array]:
  """Zeroed accumulators for `n_tasks` tasks and `n_domains` domains (see module doc)."""
  if n_tasks < 1 or n_domains < 1 or num_bins < 2:
    raise ValueError(f"need n_tasks >= 1, n_domains >= 1, num_bins >= 2; got "
                     f"{n_tasks}, {n_domains}, {num_bins}")
  td = (n_tasks, n_domains)
  return {
      "hist": jnp.zeros(td + (2, num_bins), jnp.float32),
      "loss": jnp.zeros(td, jnp.float32),
      "pred": jnp.zeros(td, jnp.float32),
      "label": jnp.zeros(td, jnp.float32),
      "weight": jnp.zeros(td, jnp.float32),
  }


def reset(acc: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
  """Accumulators of the same shapes, zeroed (pure, jit-able)."""
  return {k: jnp.zeros_like(v) for k, v in acc.items()}


def score_bins(logits: jax.Array, num_bins: int) -> jax.Array:
  """Bin index of each logit: floor((z + R) / (2R) * NB), clipped to [0, NB - 1]."""
  z = jnp.asarray(logits, jnp.float32)
  b = jnp.floor((z + LOGIT_RANGE) * (num_bins / (2 * LOGIT_RANGE)))
  return jnp.clip(b, 0, num_bins - 1).astype(jnp.int32)


def update(acc: Mapping[str, jax.Array], logits: jax.Array, labels: jax.Array,
           label_mask: jax.Array, domain: jax.Array) -> dict[str, jax.Array]:
  """Adds one batch to the accumulators (pure, jit-able).

  Every example-task pair is weighted by its `label_mask` value m (0 drops it,
  e.g. padding rows or unobserved conversions). Labels may be soft (in [0, 1]):
  the pair then adds m * y to the positive and m * (1 - y) to the negative bin.
  Domains outside [0, D) are dropped.

  Args:
    acc: accumulators from `init_accumulators`.
    logits: (B, T) predicted logits (any float dtype; computed in fp32).
    labels: (B, T) labels in [0, 1].
    label_mask: (B, T) weights, 1 where the label is observed.
    domain: (B,) int domain of each example.

  Returns:
    The updated accumulators.
  """
  t, d, _, nb = acc["hist"].shape
  z = jnp.asarray(logits, jnp.float32)                      # (B, T)
  y = jnp.asarray(labels, jnp.float32)                      # (B, T)
  m = jnp.asarray(label_mask, jnp.float32)                  # (B, T)
  dom = jnp.asarray(domain, jnp.int32)                      # (B,)
  m = m * ((dom >= 0) & (dom < d))[:, None].astype(jnp.float32)
  dom = jnp.clip(dom, 0, d - 1)
  b = z.shape[0]

  # Log loss of a logit: softplus(z) - y * z, computed stably.
  ll = jnp.maximum(z, 0) - z * y + jnp.log1p(jnp.exp(-jnp.abs(z)))  # (B, T)
  p = jax.nn.sigmoid(z)                                     # (B, T)

  task = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :], (b, t))
  cell = task * d + dom[:, None]                            # (B, T) in [0, T*D)

  def cell_sum(v):                                          # (B, T) -> (T, D)
    return jax.ops.segment_sum((m * v).ravel(), cell.ravel(),
                               num_segments=t * d).reshape(t, d)

  bins = score_bins(z, nb)                                  # (B, T)
  flat = (cell * 2)[..., None] * nb + jnp.stack([bins, bins + nb], -1)  # (B, T, 2)
  mass = jnp.stack([m * (1 - y), m * y], -1)                # (B, T, 2)
  hist = jax.ops.segment_sum(mass.ravel(), flat.ravel(), num_segments=t * d * 2 * nb)
  return {
      "hist": acc["hist"] + hist.reshape(t, d, 2, nb),
      "loss": acc["loss"] + cell_sum(ll),
      "pred": acc["pred"] + cell_sum(p),
      "label": acc["label"] + cell_sum(y),
      "weight": acc["weight"] + cell_sum(jnp.ones_like(z)),
  }


def auc_from_hist(neg: np.ndarray, pos: np.ndarray) -> float:
  """AUC of binned scores, ties within a bin counted 1/2 (see module doc); nan if P or N is 0."""
  neg = np.asarray(neg, np.float64)
  pos = np.asarray(pos, np.float64)
  p_tot, n_tot = pos.sum(), neg.sum()
  if p_tot <= 0 or n_tot <= 0:
    return float("nan")
  pos_above = p_tot - np.cumsum(pos)                        # P_{>b}
  return float(np.sum(neg * (pos_above + 0.5 * pos)) / (p_tot * n_tot))


def auc_tie_bound(neg: np.ndarray, pos: np.ndarray) -> float:
  """Upper bound on |AUC_hist - AUC_exact|: (1/2) sum_b P_b N_b / (P N)."""
  neg = np.asarray(neg, np.float64)
  pos = np.asarray(pos, np.float64)
  p_tot, n_tot = pos.sum(), neg.sum()
  if p_tot <= 0 or n_tot <= 0:
    return float("nan")
  return float(0.5 * np.sum(pos * neg) / (p_tot * n_tot))


def _entropy(p: float) -> float:
  if not 0 < p < 1:
    return float("nan")
  return float(-p * np.log(p) - (1 - p) * np.log1p(-p))


def _cell_metrics(hist, loss, pred, label, weight) -> dict[str, float]:
  """Metrics of one (task, domain-set) cell from summed accumulators (float64)."""
  nan = float("nan")
  auc = auc_from_hist(hist[0], hist[1])
  if weight <= 0:
    return {"auc": auc, "logloss": nan, "ne": nan, "calibration": nan}
  logloss = loss / weight
  base = label / weight
  h = _entropy(base)
  return {
      "auc": auc,
      "logloss": float(logloss),
      "ne": float(logloss / h) if h == h else nan,
      "calibration": float(pred / label) if label > 0 else nan,
  }


def _nanmean(values: Sequence[float]) -> float:
  finite = [v for v in values if np.isfinite(v)]
  return float(np.mean(finite)) if finite else float("nan")


def compute(acc: Mapping[str, jax.Array], task_names: Sequence[str],
            num_domains: int | None = None) -> dict[str, float]:
  """Host-side metrics from the accumulators.

  Keys: `auc/TASK`, `logloss/TASK`, `ne/TASK`, `calibration/TASK` over all
  domains; `METRIC/TASK/domain_K` per domain when there is more than one; and
  `auc`, `logloss`, `ne` averaged over the tasks that have a finite value.
  Undefined values (no positives, no observed labels...) are nan.

  Args:
    acc: accumulators (device or numpy arrays).
    task_names: names of the T tasks, in order.
    num_domains: domains to report separately (default: all D accumulated).
  """
  a = {k: np.asarray(jax.device_get(v), np.float64) for k, v in acc.items()}
  t, d = a["weight"].shape
  if len(task_names) != t:
    raise ValueError(f"{len(task_names)} task names for {t} accumulated tasks")
  nd = d if num_domains is None else min(int(num_domains), d)
  out: dict[str, float] = {}
  for i, name in enumerate(task_names):
    total = _cell_metrics(a["hist"][i].sum(0), *(a[k][i].sum() for k in
                                                   ("loss", "pred", "label", "weight")))
    for k, v in total.items():
      out[f"{k}/{name}"] = v
    if nd > 1:
      for j in range(nd):
        cell = _cell_metrics(a["hist"][i, j], *(a[k][i, j] for k in
                                                  ("loss", "pred", "label", "weight")))
        for k, v in cell.items():
          out[f"{k}/{name}/domain_{j}"] = v
  for k in ("auc", "logloss", "ne"):
    out[k] = _nanmean([out[f"{k}/{n}"] for n in task_names])
  return out


def base_rate_logloss(acc: Mapping[str, jax.Array], task_names: Sequence[str]) -> dict[str, float]:
  """Per task, the log loss of predicting its observed rate p (label sum / weight over all
  domains of the accumulators) for every row: H(p), nan when p is 0, 1 or undefined."""
  label = np.asarray(jax.device_get(acc["label"]), np.float64).sum(-1)    # (T,)
  weight = np.asarray(jax.device_get(acc["weight"]), np.float64).sum(-1)  # (T,)
  return {name: _entropy(label[i] / weight[i]) if weight[i] > 0 else float("nan")
          for i, name in enumerate(task_names)}


def metric_mode(name: str) -> str:
  """'max' if a larger value of metric `name` is better, 'min' if a smaller one.

  The kind is the name's first '/' part without an 'eval_'/'train_' prefix
  ('eval_auc/click/domain_0' is an AUC): auc -> 'max'; logloss, ne, *loss -> 'min'.
  Anything else (calibration, throughput, ...) has no best: ValueError.
  """
  kind = str(name).split("/")[0]
  for prefix in ("eval_", "train_"):
    kind = kind[len(prefix):] if kind.startswith(prefix) else kind
  if kind == "auc":
    return "max"
  if kind in ("ne", "loss") or kind.endswith("loss"):
    return "min"
  raise ValueError(f"metric {name!r}: no known better direction (auc: max; logloss, ne, "
                   "*loss: min)")
