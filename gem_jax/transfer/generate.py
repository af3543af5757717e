"""Knowledge generation: a trained teacher, restored sharded like training, run over a dataset.

  teacher = predict.restore_model(teacher_config, teacher_workdir, batch_size)
  for host batch b of this process (the source's order, one pass, streamed):
    out = predict.forward_fn(teacher, ...)(state, put(b))   {'logits': (B, T), 'trunk': (B, H), ...}
    writer.add(local rows of out + valid + fingerprint(b))
  process 0 writes index.json once every process is done

Each process decodes and writes only its own rows (`batch_size // process_count`
of every global batch), so the dataset is never held in memory and hosts
never exchange knowledge rows. The teacher's state is restored from its
checkpoint onto this run's mesh (`config.mesh`, any shape: checkpoints are
mesh-independent) and the forward is jitted once with explicit shardings: the restore
and the forward are scoring's own (`gem_jax.train.predict`), config and shapes checked.
"""
from __future__ import annotations

import os
from typing import Sequence

import jax
import numpy as np

from gem_jax.data import pipeline
from gem_jax.train import predict
from gem_jax.train import setup as setup_lib
from gem_jax.transfer import knowledge as kn


def generate_knowledge(teacher: predict.Model, source, out_dir: str, *, batch_size: int,
                       fields: Sequence[str] = ("trunk",), seed: int = 0,
                       rows_per_shard: int = 65536, max_batches: int | None = None) -> dict:
  """Runs `teacher` over one pass of `source` and writes the knowledge of every row.

  Args:
    teacher: from `predict.restore_model` (its plan made for `batch_size`).
    source: a data source with the teacher's DataSpec (e.g. the student's data).
    out_dir: the knowledge directory (see `gem_jax.transfer.knowledge`).
    batch_size: global batch size (the student must read with the same one).
    fields: teacher aux outputs to store besides the logits ('trunk', 'seq_summary').
    seed: the source's iteration seed (the student must read with the same one).
    rows_per_shard: rows per shard file.
    max_batches: stop after this many batches (None: the whole pass).
  Returns:
    the index dict (also written as `out_dir/index.json` by process 0).
  """
  s = teacher.setup
  pc, pi = jax.process_count(), jax.process_index()
  if source.spec != s.spec:
    raise ValueError("the source's DataSpec differs from the teacher's: knowledge generation "
                     "needs the features the teacher was trained on")
  os.makedirs(out_dir, exist_ok=True)
  put = setup_lib.device_putter(s.eval_plan, s.mesh)
  it = source.batches(batch_size, process_index=pi, process_count=pc, seed=seed, repeat=False)
  writer = kn.KnowledgeWriter(out_dir, pi, rows_per_shard)
  fwd, n = None, 0
  with pipeline.Prefetcher(it, put_fn=lambda b: (b, put(b)), size=2) as batches:
    for host, dev in batches:
      if max_batches is not None and n >= max_batches:
        break
      if fwd is None:
        fwd = predict.forward_fn(teacher, jax.tree.map(lambda x: x.sharding, dev), fields)
      out = jax.device_get({k: predict.local_rows(v) for k, v in fwd(teacher.state, dev).items()})
      out["valid"] = kn.valid_rows(host)
      out["fingerprint"] = kn.fingerprint(host)
      writer.add(out)
      n += 1
  shard_rows = writer.close()
  all_shards = _gather_shard_rows(shard_rows)
  index = dict(fields=writer.fields, batch_size=batch_size, process_count=pc, num_batches=n,
               rows_per_shard=rows_per_shard, shards=all_shards, source=source.describe(),
               seed=seed, teacher={"step": teacher.step})
  if pi == 0:
    kn.write_index(out_dir, **index)
  if pc > 1:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    multihost_utils.sync_global_devices("knowledge_index_written")
  return kn.read_index(out_dir) if pi == 0 else index


def _gather_shard_rows(shard_rows: list[int]) -> list[list[int]]:
  """Every process's shard row counts (all processes write the same number of batches)."""
  if jax.process_count() == 1:
    return [list(shard_rows)]
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  mine = np.zeros((1024,), np.int64)
  mine[:len(shard_rows)] = shard_rows
  allp = np.asarray(multihost_utils.process_allgather(mine))  # (P, 1024)
  return [[int(r) for r in row if r > 0] for row in allp]
