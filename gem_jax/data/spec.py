"""The batch contract shared by every data source, the embedding engine and the models.

A `DataSpec` describes a dataset's features; every source (synthetic generator,
Criteo/Avazu/MovieLens/... readers) yields host batches of this structure, as
numpy arrays with a leading global-or-local batch axis B:

  batch = {
    'dense':      float32 (B, n_dense)            dense features, already normalised
    'ids':        {feature: int64 (B, bag)}       multi-hot bags, -1 = padding
                  {feature: int64 (B, L)}         sequence item ids (pooling 'none'), -1 = padding
    'weights':    {feature: float32 (B, bag)}     optional per-id weights (absent = 1)
    'seq':        {stream: {                      one entry per event stream
                     'len':     int32 (B,)        valid events (left-aligned, most recent first)
                     'action':  int32 (B, L)      action type of each event (0 = padding)
                     'surface': int32 (B, L)      surface/domain of each event
                     'dt':      float32 (B, L)    seconds between the event and the request
                  }}
    'domain':     int32 (B,)                      domain (surface) of the request
    'labels':     float32 (B, n_tasks)            0/1 labels
    'label_mask': float32 (B, n_tasks)            1 where the label is observed
  }

Ids may be raw (hashed later by the table's id policy) or already in range.
Sequence events are stored most recent first, so `[:, :k]` are the k most
recent events and position i < len is valid.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np


@dataclasses.dataclass(frozen=True)
class SparseFeatureSpec:
  """A categorical feature: `bag` ids per example (1 = one-hot), from `vocab` values."""
  name: str
  vocab: int              # number of distinct values (or hash buckets) expected
  bag: int = 1            # max ids per example; shorter bags are padded with -1


@dataclasses.dataclass(frozen=True)
class SequenceStreamSpec:
  """An event stream (e.g. ad clicks, organic views) of at most `max_len` events.

  `item_features` name the sparse features (in `DataSpec.sparse`) whose ids are
  stored in `batch['ids']` with shape (B, max_len), one per event.
  """
  name: str
  max_len: int
  item_features: tuple[str, ...]
  num_actions: int = 4
  num_surfaces: int = 4


@dataclasses.dataclass(frozen=True)
class DataSpec:
  """What a dataset provides; configs derive tables and model sizes from it."""
  n_dense: int
  sparse: tuple[SparseFeatureSpec, ...]
  sequences: tuple[SequenceStreamSpec, ...] = ()
  num_domains: int = 1
  tasks: tuple[str, ...] = ("click",)

  @property
  def sequence_item_features(self) -> set[str]:
    return {f for s in self.sequences for f in s.item_features}

  @property
  def pooled_features(self) -> tuple[SparseFeatureSpec, ...]:
    """Features pooled to one vector per example (not sequence items)."""
    seq = self.sequence_item_features
    return tuple(f for f in self.sparse if f.name not in seq)

  def feature(self, name: str) -> SparseFeatureSpec:
    for f in self.sparse:
      if f.name == name:
        return f
    raise KeyError(f"unknown sparse feature {name!r}; known: {[f.name for f in self.sparse]}")


def validate_batch(spec: DataSpec, batch: Mapping, source: str = "batch") -> None:
  """Raises ValueError naming the field if `batch` does not follow `spec`."""
  def fail(field, msg):
    raise ValueError(f"{source}: field {field!r}: {msg}")

  b = np.shape(batch["dense"])[0]
  if np.shape(batch["dense"]) != (b, spec.n_dense):
    fail("dense", f"shape {np.shape(batch['dense'])} != ({b}, {spec.n_dense})")
  seq_len = {f: s.max_len for s in spec.sequences for f in s.item_features}
  for f in spec.sparse:
    if f.name not in batch["ids"]:
      fail(f"ids/{f.name}", "missing")
    want = (b, seq_len.get(f.name, f.bag))
    if np.shape(batch["ids"][f.name]) != want:
      fail(f"ids/{f.name}", f"shape {np.shape(batch['ids'][f.name])} != {want}")
  for s in spec.sequences:
    for k in ("len", "action", "surface", "dt"):
      if k not in batch["seq"].get(s.name, {}):
        fail(f"seq/{s.name}/{k}", "missing")
  t = len(spec.tasks)
  for k in ("labels", "label_mask"):
    if np.shape(batch[k]) != (b, t):
      fail(k, f"shape {np.shape(batch[k])} != ({b}, {t})")
  if np.shape(batch["domain"]) != (b,):
    fail("domain", f"shape {np.shape(batch['domain'])} != ({b},)")
