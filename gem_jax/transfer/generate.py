"""Knowledge generation: a trained teacher, restored sharded like training, run over a dataset.

  teacher = restore_teacher(teacher_config, teacher_workdir, batch_size)
  for host batch b of this process (the source's order, one pass, streamed):
    out = teacher.forward(state, put(b))           {'logits': (B, T), 'trunk': (B, H), ...}
    writer.add(local rows of out + valid + fingerprint(b))
  process 0 writes index.json once every process is done

Each process decodes and writes only its own rows (`batch_size // process_count`
of every global batch), so the dataset is never held in memory and hosts
never exchange knowledge rows. The teacher's state is restored from its
checkpoint onto this run's mesh (`config.mesh`, any shape: checkpoints are
mesh-independent) and the forward is jitted once with explicit shardings.
"""
from __future__ import annotations

import os
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from gem_jax import embedding as emb_lib
from gem_jax.data import pipeline
from gem_jax.train import checkpoint as ckpt_lib
from gem_jax.train import setup as setup_lib
from gem_jax.train import step as step_lib
from gem_jax.transfer import knowledge as kn


class Teacher(NamedTuple):
  """A restored teacher: its run setup (mesh, plan, spec, ...), state and checkpoint step."""
  setup: Any
  state: Any
  step: int


def with_batch_size(config, batch_size: int) -> ml_collections.ConfigDict:
  """An unlocked copy of a run config whose train/eval batch size is `batch_size`."""
  c = ml_collections.ConfigDict(config.to_dict())
  c.data.batch_size = int(batch_size)
  c.data.eval_batch_size = int(batch_size)
  return c


def restore_teacher(config, workdir: str, batch_size: int, step: int | None = None) -> Teacher:
  """The teacher of `workdir` (its latest or `step` checkpoint) on `config.mesh`.

  The embedding plan is made for `batch_size` (the generation batch), and the
  canonical tables of the checkpoint are laid out for it (`import_state`).
  """
  s = setup_lib.setup(with_batch_size(config, batch_size))
  ckpt = ckpt_lib.CheckpointManager(os.path.join(workdir, "checkpoints"), save_every=None,
                                    keep=1)
  try:
    state, restored = setup_lib.restore(s, ckpt, step)
  finally:
    ckpt.close()
  if restored is None:
    raise FileNotFoundError(f"no teacher checkpoint in {os.path.join(workdir, 'checkpoints')}")
  return Teacher(s, state, restored.step)


def teacher_outputs(model, inputs, fields: Sequence[str]) -> dict:
  """{'logits': (B, T) fp32, field: (B, D) fp32 for each aux field} of a model call."""
  logits, aux = model(inputs, return_aux=True)
  out = {"logits": logits.astype(jnp.float32)}
  for f in fields:
    if f not in aux:
      raise KeyError(f"teacher aux has no {f!r}; it has {sorted(aux)}")
    x = aux[f]
    out[f] = x.reshape(x.shape[0], -1).astype(jnp.float32)  # (B, D)
  return out


def forward_fn(teacher: Teacher, fields: Sequence[str], batch_shardings) -> Callable:
  """The teacher forward `(state, batch) -> {'logits', *fields}`, jitted once."""
  s = teacher.setup
  graphdef = s.step_cfg.graphdef
  out_sh = pipeline.batch_sharding(s.mesh)

  def forward(state, batch):
    emb = emb_lib.lookup(s.plan, state.emb, batch["ids"], batch.get("weights"))
    model = nnx.merge(graphdef, state.params, state.model_state)
    return teacher_outputs(model, step_lib.model_inputs(s.spec, batch, emb), fields)

  return jax.jit(forward, in_shardings=(s.shardings, batch_shardings), out_shardings=out_sh)


def local_rows(x: jax.Array) -> np.ndarray:
  """This process's rows of a batch-sharded global array, in global row order.

  `make_array_from_process_local_data` placed the local rows on this process's
  devices in order, so the addressable shards sorted by start row, without the
  replicas' duplicates, are exactly the local batch.
  """
  seen, parts = set(), []
  for sh in sorted(x.addressable_shards, key=lambda t: t.index[0].start or 0):
    start = sh.index[0].start or 0
    if start in seen:
      continue
    seen.add(start)
    parts.append(np.asarray(sh.data))
  return np.concatenate(parts, axis=0)


def generate_knowledge(teacher: Teacher, source, out_dir: str, *, batch_size: int,
                       fields: Sequence[str] = ("trunk",), seed: int = 0,
                       rows_per_shard: int = 65536, max_batches: int | None = None) -> dict:
  """Runs `teacher` over one pass of `source` and writes the knowledge of every row.

  Args:
    teacher: from `restore_teacher` (its plan made for `batch_size`).
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
  put = setup_lib.device_putter(s.plan, s.mesh)
  it = source.batches(batch_size, process_index=pi, process_count=pc, seed=seed, repeat=False)
  writer = kn.KnowledgeWriter(out_dir, pi, rows_per_shard)
  fwd, n = None, 0
  with pipeline.Prefetcher(it, put_fn=lambda b: (b, put(b)), size=2) as batches:
    for host, dev in batches:
      if max_batches is not None and n >= max_batches:
        break
      if fwd is None:
        fwd = forward_fn(teacher, fields, jax.tree.map(lambda x: x.sharding, dev))
      out = jax.device_get({k: local_rows(v) for k, v in fwd(teacher.state, dev).items()})
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
