"""Alimama display ads in the DMR/DIN preprocessed format (fixed-length histories + masks).

Row format (no header, 267 comma-separated fields, L = 50):

  cols   0..49   btag:        behaviour type per event (0 = padding, 1..4 = pv/cart/fav/buy)
  cols  50..99   his_cate:    category id per event
  cols 100..149  his_brand:   brand id per event
  cols 150..199  mask:        1 = real event, 0 = padding
  cols 200..249  match_mask:  (unused)
  cols 250..258  uid, cms_segid, cms_group_id, final_gender_code, age_level,
                 pvalue_level, shopping_level, occupation, new_user_class_level
  cols 259..265  mid (ad id), cate_id, campaign_id, customer, brand, price (float), pid (0/1)
  col  266       target (click)

Mapping to the batch contract:
* One event stream `behavior` (max_len 50) with item features `his_cate`,
  `his_brand`. The preprocessed histories are chronological and right-aligned
  (padding first, the most recent event last; mask[49] = 1 in every row of the
  shared sample); the contract wants the most recent event first and valid
  events left-aligned, so the masked events are taken in reverse column order.
  action = btag; surface = 0; dt = 0 (the format has no timestamps).
* 14 sparse one-hot features: the 9 user-profile and the 5 ad id columns (the
  candidate's `cate_id`/`brand` may share tables with `his_cate`/`his_brand` in
  the embedding config for target attention).
* dense: [price] (already normalised in the file); domain: pid (ad slot, 2 domains).
Bad rows: wrong field count, non-integer ids, mask/btag values out of range, a
non-numeric price, label not 0/1.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from gem_jax.data import text
from gem_jax.data.badrows import BadRow
from gem_jax.data.source import LineSource, base_batch, valid_rows
from gem_jax.data.spec import DataSpec, SequenceStreamSpec, SparseFeatureSpec

L = 50
N_FIELDS = 5 * L + 17
USER = ("uid", "cms_segid", "cms_group_id", "final_gender_code", "age_level",
        "pvalue_level", "shopping_level", "occupation", "new_user_class_level")
AD = ("mid", "cate_id", "campaign_id", "customer", "brand")
ONE_HOT = USER + AD
SEQ_FEATURES = ("his_cate", "his_brand")
NUM_ACTIONS = 5


def alimama_spec(vocab_size: int = 1 << 20) -> DataSpec:
  sparse = [SparseFeatureSpec(n, vocab_size) for n in ONE_HOT + SEQ_FEATURES]
  stream = SequenceStreamSpec("behavior", L, SEQ_FEATURES, num_actions=NUM_ACTIONS,
                              num_surfaces=1)
  return DataSpec(n_dense=1, sparse=tuple(sparse), sequences=(stream,), num_domains=2,
                  tasks=("click",))


class AlimamaSource(LineSource):
  """Streams DMR-format Alimama rows as sequence batches (see module docstring).

  Args:
    paths: file(s), comma-separated string or list; globs allowed.
    vocab_size: expected distinct values per id feature (the spec's vocab hint).
    **kw: StreamingSource options (shuffle_buffer, bad_row_limit, bad_row_min_rows).
  """

  def __init__(self, paths: str | Sequence[str], *, vocab_size: int = 1 << 20, **kw):
    super().__init__(paths, alimama_spec(vocab_size), **kw)

  @classmethod
  def from_config(cls, cfg, split: str) -> "AlimamaSource":
    train = split == "train"
    return cls(cfg.train if train else cfg.eval,
               vocab_size=cfg.get("vocab_size", 1 << 20),
               shuffle_buffer=cfg.get("shuffle_buffer", 0) if train else 0,
               bad_row_limit=cfg.get("bad_row_limit", 0.01))

  @property
  def shared_vocab(self) -> dict[str, str]:
    """History features -> the candidate ad feature whose table they share."""
    return {"his_cate": "cate_id", "his_brand": "brand"}

  def parse(self, line: bytes):
    """-> (label, price, pid, one_hot (14,), actions, cates, brands (len each, recent first))."""
    f = text.split_fields(line, b",", N_FIELDS)
    ints = [text.parse_int(t, f"column {i}") for i, t in enumerate(f[:5 * L])]
    btag, cate, brand, mask = (ints[k * L:(k + 1) * L] for k in range(4))
    if any(m not in (0, 1) for m in mask):
      raise BadRow("mask: values must be 0 or 1")
    valid = [i for i in range(L - 1, -1, -1) if mask[i]]       # most recent first
    actions = [btag[i] for i in valid]
    if any(not 1 <= a < NUM_ACTIONS for a in actions):
      raise BadRow(f"btag: unmasked behaviour types must be in 1..{NUM_ACTIONS - 1}")
    one_hot = [text.parse_int(t, n) for t, n in zip(f[250:264], ONE_HOT)]
    price = text.parse_float(f[264], "price")
    pid = text.parse_int(f[265], "pid")
    if pid not in (0, 1):
      raise BadRow(f"pid: expected 0 or 1, got {pid}")
    label = text.parse_label(f[266], "target")
    return (label, price, pid, one_hot, actions, [cate[i] for i in valid],
            [brand[i] for i in valid])

  def collate(self, examples: list) -> dict:
    b = len(examples)
    out = base_batch(b, 1, 1)
    one_hot = np.full((b, len(ONE_HOT)), -1, np.int64)
    cates = np.full((b, L), -1, np.int64)
    brands = np.full((b, L), -1, np.int64)
    actions = np.zeros((b, L), np.int32)
    lens = np.zeros((b,), np.int32)
    idx, ex = valid_rows(examples)
    for i, e in zip(idx, ex):
      n = len(e[4])
      lens[i] = n
      actions[i, :n], cates[i, :n], brands[i, :n] = e[4], e[5], e[6]
    if len(idx):
      out["labels"][idx, 0] = [e[0] for e in ex]
      out["label_mask"][idx, 0] = 1.0
      out["dense"][idx, 0] = [e[1] for e in ex]
      out["domain"][idx] = [e[2] for e in ex]
      one_hot[idx] = [e[3] for e in ex]
    out["ids"] = {n: one_hot[:, j:j + 1] for j, n in enumerate(ONE_HOT)}
    out["ids"]["his_cate"] = cates                                  # (B, 50)
    out["ids"]["his_brand"] = brands                                # (B, 50)
    out["seq"] = {"behavior": {"len": lens, "action": actions,
                               "surface": np.zeros((b, L), np.int32),
                               "dt": np.zeros((b, L), np.float32)}}
    return out
