"""Id statistics of a sample of batches, for the planner: how many ids are distinct, how hot.

  stats = id_stats(tables, features, sample_ids, num_devices=R * S)
  plan = plan_embeddings(tables, features, mesh, B, id_stats=stats)

Per feature, over the sample (ids mapped by their table's id policy first, as the
step sees them; the batch split over the R S devices in order, as the mesh does):

  valid_share     valid ids / id slots (B x bag)
  distinct_share  mean over batches and devices of distinct rows on a device / its
                  id slots (b x bag): what the row-wise all_to_all has to move
  top_share       share of the valid ids that hit one of the k most frequent rows
  max_owner_share the largest share of a device's distinct rows that one row-wise
                  owner holds (1 / S when uniform; 1 when all on one shard)
  batch_distinct_share  the largest over batches of distinct rows in the whole batch /
                  its id slots (B x bag): what the owners resolve after deduplicating
                  the ids of all requesters (a managed table's route, managed.py)

Managed tables (`id_policy='managed'`) count distinct raw ids (each gets a row of its
own); the owner share, which needs rows, is that of the ids hashed into the table.

The planner sizes each row-wise unit's all_to_all capacity from `distinct_share`
(`EmbeddingPlan.capacity`) and weighs table-wise placement by the valid lookups;
`EmbeddingPlan.describe()` prints them.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping, Sequence

import numpy as np

from gem_jax.embedding.config import FeatureConfig, TableConfig
from gem_jax.embedding.ids import apply_id_policy


@dataclasses.dataclass(frozen=True)
class IdStats:
  batches: int
  valid_share: float
  distinct_share: float
  top_share: float
  max_owner_share: float
  k: int
  batch_distinct_share: float = 1.0

  def describe(self) -> str:
    return (f"valid {self.valid_share:.0%}, distinct/slot {self.distinct_share:.2f}, "
            f"top-{self.k} rows {self.top_share:.0%} of ids, max owner share "
            f"{self.max_owner_share:.2f}, distinct/slot of a batch "
            f"{self.batch_distinct_share:.2f} ({self.batches} batches)")


def id_stats(tables: Sequence[TableConfig], features: Sequence[FeatureConfig],
             sample: Iterable[Mapping[str, np.ndarray]], *, num_devices: int,
             num_shards: int = 1, k: int = 100) -> dict[str, IdStats]:
  """{feature: IdStats} of `sample` (an iterable of {feature: raw ids (B, bag)}); see the
  module docstring. `num_shards` S sets the row-wise owners (rows // ceil(rows / S))."""
  tables = {t.name: t for t in tables}
  acc = {f.name: {"n": 0, "slots": 0, "distinct": [], "owner": 0.0, "valid": [], "batch": 0.0}
         for f in features}
  for ids in sample:
    for f in features:
      t, a = tables[f.table], acc[f.name]
      policy = "hash" if t.id_policy == "managed" else t.id_policy   # ~ distinct rows
      raw = np.asarray(ids[f.name])
      rows = apply_id_policy(raw, t.rows, policy, f.name, t.name)
      keys = np.where(raw >= 0, raw, -1) if t.id_policy == "managed" else rows  # -1: padding
      B = rows.shape[0]
      if B % num_devices:
        raise ValueError(f"batch of {B} rows does not split over {num_devices} devices")
      rps = -(-t.rows // num_shards)
      a["n"] += 1
      a["slots"] += rows.size
      a["valid"].append(keys[keys >= 0])
      a["batch"] = max(a["batch"], np.unique(keys[keys >= 0]).size / max(keys.size, 1))
      for dev, dev_rows in zip(np.split(keys, num_devices), np.split(rows, num_devices)):
        a["distinct"].append(np.unique(dev[dev >= 0]).size / dev.size)
        d = np.unique(dev_rows[dev_rows >= 0])
        if d.size:
          a["owner"] = max(a["owner"], np.bincount(d // rps).max() / d.size)
  out = {}
  for name, a in acc.items():
    if not a["n"]:
      raise ValueError("id_stats: the sample holds no batches")
    valid = np.concatenate(a["valid"])
    counts = np.sort(np.unique(valid, return_counts=True)[1])[::-1]
    out[name] = IdStats(a["n"], valid.size / max(a["slots"], 1),
                        float(np.mean(a["distinct"])),
                        float(counts[:k].sum() / max(valid.size, 1)), float(a["owner"]), k,
                        float(a["batch"]))
  return out
