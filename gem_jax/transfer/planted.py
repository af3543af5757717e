"""Planted data for the transfer benchmark: a stale multi-domain teacher, a fresh one-domain student.

Built on the synthetic generator (`gem_jax.data.synthetic`, preset PLANTED):
features, sequences and the ground-truth logit f(x) are the generator's. Two
roles read disjoint example streams of the same hidden model:

  teacher  all domains (probabilities 0.5 / 0.35 / 0.15), dense x ~ N(0, I),
           labels of the *old* period:     z_old = f(x)
  student  only domain STUDENT_DOMAIN (2, the rarest for the teacher), dense
           x ~ N(DENSE_SHIFT, I) (a shifted distribution), labels of the
           *fresh* period (the teacher's supervision is older, a label delay
           during which the world drifted):
             z_fresh = z_old + DRIFT_BIAS + DRIFT_W . x        (per task)

The drift is what a Student Adapter can learn from a few fresh labels
(a per-domain affine correction plus an MLP of [z_T ; x_small] with x_small
the dense features); the id effects, pairwise interactions and sequence
matches are what the teacher knows from far more data than the student has.
Labels are Bernoulli(sigmoid(z)) drawn per block of rows from
rng(seed, split, role, stream seed, block), so rows are reproducible and
resumable like the generator's (`SyntheticIterator` iterates them).
"""
from __future__ import annotations

import numpy as np

from gem_jax.data.synthetic import (ROW_BLOCK, Feature, Preset, Stream, SyntheticIterator,
                                    SyntheticSource)

PLANTED = Preset(
    features=(Feature("user", 400, effect=0.7, top=96),
              Feature("ad", 600, effect=0.7, top=96, conv_effect=0.5),
              Feature("category", 60, effect=0.5, top=60)),
    streams=(Stream("clicks", "click_category", "category", max_len=8, recent=3),),
    pairs=(("user", "category"),),
    n_dense=2,
    domain_probs=(0.5, 0.35, 0.15),
    click_bias=-1.0,
    conv_bias=-0.8,
)
STUDENT_DOMAIN = 2
DENSE_SHIFT = np.array([0.5, -0.5])
DRIFT_BIAS = np.array([-0.4, 0.3])             # per task (click, conversion)
DRIFT_W = np.array([[0.9, -0.7], [-0.6, 0.6]])  # (task, dense feature)
_ROLES = {"teacher": 0, "student": 1}
_SPLIT_IDS = {"train": 1, "eval": 2, "oracle": 3}


class PlantedSource:
  """Rows of one role and split (module docstring); `batches()` as every source.

  Args:
    role: 'teacher' (old labels, all domains) or 'student' (fresh labels, one shifted domain).
    split: 'train' or 'eval'.
    seed: the data seed (hidden model and rows).
    num_examples: rows per pass (None: endless).
  """

  def __init__(self, role: str = "teacher", split: str = "train", *, seed: int = 0,
               num_examples: int | None = None):
    if role not in _ROLES:
      raise ValueError(f"role must be one of {sorted(_ROLES)}, got {role!r}")
    self.role, self.split, self.seed = role, split, int(seed)
    self.num_examples = None if num_examples is None else int(num_examples)
    self.base = SyntheticSource(PLANTED, seed=seed, split=split)
    self.spec = self.base.spec
    self.shared_vocab = self.base.shared_vocab

  @classmethod
  def from_config(cls, cfg, split: str) -> "PlantedSource":
    """data fields: role, seed, train_examples, eval_examples."""
    n = cfg.get("train_examples") if split == "train" else cfg.get("eval_examples")
    return cls(cfg.get("role", "teacher"), split, seed=cfg.get("seed", 0),
               num_examples=n or None)

  def describe(self) -> str:
    return f"planted({self.role}, {self.split}, seed={self.seed}, n={self.num_examples})"

  def true_logits(self, batch) -> np.ndarray:
    """The logits (B, T) the labels of this role are drawn from."""
    z = self.base.true_logits(batch)
    if self.role == "student":
      x = np.asarray(batch["dense"], np.float64)
      z = z + DRIFT_BIAS[None, :] + x @ DRIFT_W.T
    return z

  def _block(self, stream_seed: int, k: int) -> dict:
    role = _ROLES[self.role]
    b = self.base.examples(k * ROW_BLOCK, (k + 1) * ROW_BLOCK, 7919 * role + stream_seed)
    if self.role == "student":
      b["domain"] = np.full_like(b["domain"], STUDENT_DOMAIN)
      b["dense"] = (b["dense"] + DENSE_SHIFT[None, :]).astype(np.float32)
    z = self.true_logits(b)                                           # (n, T)
    rng = np.random.default_rng([self.seed, _SPLIT_IDS[self.split], role, stream_seed, k, 31])
    labels = (rng.random(z.shape) < 1 / (1 + np.exp(-z))).astype(np.float32)
    mask = np.ones_like(labels)
    mask[:, 1:] = labels[:, :1]                                       # conversion after a click
    labels[:, 1:] *= mask[:, 1:]
    b["labels"], b["label_mask"] = labels, mask
    return b

  def examples(self, start: int, stop: int, stream_seed: int = 0) -> dict:
    """Rows [start, stop) of this role's stream."""
    k0, k1 = start // ROW_BLOCK, (stop - 1) // ROW_BLOCK + 1
    blocks = [self._block(stream_seed, k) for k in range(k0, k1)]
    lo = start - k0 * ROW_BLOCK
    return _concat(blocks, lo, lo + stop - start)

  def oracle_auc(self, n: int = 50_000) -> dict[str, float]:
    """AUC of the true probabilities of this role on n fresh rows (the best achievable)."""
    from gem_jax.data.synthetic import rank_auc  # pylint: disable=import-outside-toplevel
    src = PlantedSource(self.role, "eval", seed=self.seed)
    b = src.examples(0, n, stream_seed=4242)
    z = src.true_logits(b)
    out = {}
    for t, name in enumerate(self.spec.tasks):
      keep = b["label_mask"][:, t] > 0
      out[f"auc/{name}"] = rank_auc(z[keep, t], b["labels"][keep, t])
    out["auc"] = float(np.mean([out[f"auc/{t}"] for t in self.spec.tasks]))
    return out

  def batches(self, batch_size: int, *, process_index: int = 0, process_count: int = 1,
              seed: int = 0, repeat: bool = True, state: dict | None = None):
    return SyntheticIterator(self, batch_size, process_index=process_index,
                             process_count=process_count, seed=seed, repeat=repeat, state=state)


def _concat(trees, lo: int, hi: int):
  if isinstance(trees[0], dict):
    return {k: _concat([t[k] for t in trees], lo, hi) for k in trees[0]}
  return np.concatenate(trees, 0)[lo:hi]


def register() -> None:
  """Makes `data.kind = 'transfer_planted'` available to the trainer's registry."""
  from gem_jax.data import registry  # pylint: disable=import-outside-toplevel
  registry.register("transfer_planted", PlantedSource.from_config)


register()
