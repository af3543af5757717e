"""Student training: `train_student(config, workdir)`, and the pieces it is made of.

  1. sources: the student's data (`config.data`) zipped with the teacher's
     knowledge of it (`config.knowledge.train` / `.eval`, see knowledge.py);
  2. `build_student_run`: the trainer's setup pieces (`gem_jax.train.setup`: plan,
     optimizers, abstract state and shardings) for a StudentBundle, plus the
     step config (frozen masks), compiled lazily;
  3. `init_student_state`: initialise into the shardings, then copy shared
     tables/blocks from the teacher's checkpoint (`share_from_teacher`);
  4. `train_steps`, `evaluate_student`: the loop and one eval pass.

    python -m gem_jax.transfer.train --config configs/student_planted.py --workdir runs/student

Train and eval read with one global batch size (`config.data.batch_size`),
the one the knowledge was generated with; every process reads its
`batch_size // process_count` rows of each global batch (the sources split it).
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from gem_jax import embedding as emb_lib
from gem_jax.data import pipeline
from gem_jax.data.spec import DataSpec
from gem_jax.parallel.mesh import make_mesh, resolve_mesh_shape
from gem_jax.train import checkpoint as ckpt_lib
from gem_jax.train import evaluate as eval_lib
from gem_jax.train import setup as setup_lib
from gem_jax.train import state as state_lib
from gem_jax.train import validate
from gem_jax.transfer import knowledge as kn
from gem_jax.transfer import step as tstep
from gem_jax.transfer.student import (StudentBundle, TransferOptions, frozen_row_ranges,
                                      share_from_teacher, student_flops, trainable_mask)


class StudentRun(NamedTuple):
  """Everything of a student run but its arrays (plain values; compiled steps cached)."""
  mesh: Any
  spec: DataSpec
  plan: Any
  model_cfg: Any
  feature_dims: dict
  opts: TransferOptions
  tx: Any
  step_cfg: tstep.StudentStepConfig
  abstract: state_lib.TrainState
  shardings: state_lib.TrainState
  model_fn: Callable
  acc_fn: Callable
  emb_init: Callable
  cache: dict


def options_from_config(t, teacher_emb_dim: int = 0) -> TransferOptions:
  """TransferOptions from the `transfer` block of a student config."""
  w = t.get("distill_weights")
  return TransferOptions(
      distill_weights=tuple(float(x) for x in w) if w else None,
      temperature=float(t.get("temperature", 1.0)), adapter=bool(t.get("adapter", False)),
      adapter_hidden=tuple(t.get("adapter_hidden", (16,))),
      teacher_emb=t.get("teacher_emb") or None,
      teacher_emb_dim=teacher_emb_dim if t.get("teacher_emb") else 0,
      share_tables=tuple(t.get("share_tables", ())), share_blocks=tuple(t.get("share_blocks", ())),
      freeze_shared=bool(t.get("freeze_shared", False)),
      train_student=bool(t.get("train_student", True)))


def build_student_run(spec: DataSpec, mesh, model_cfg, emb_cfg, optim_cfg, *, steps: int,
                      batch_size: int, opts: TransferOptions,
                      shared_vocab: dict | None = None, grad_accum: int = 1) -> StudentRun:
  """Plans and abstract state of a student (nothing allocated, nothing compiled).

  Args:
    spec: the student's DataSpec.  mesh: the ('replica', 'shard') mesh.
    model_cfg: a GEMConfig for the Student.
    emb_cfg, optim_cfg: the `embedding` / `optim` blocks (as in the trainer configs).
    steps: training steps (for the lr schedule).  batch_size: global batch size.
    opts: the transfer options.  shared_vocab: feature -> table it reads.
    grad_accum: micro-batches per step (the trainer's step does the accumulation).
  """
  plan = setup_lib.make_plan(spec, emb_cfg, mesh, batch_size, shared_vocab)
  feature_dims = setup_lib.table_widths(plan)
  model_fn = lambda rngs: StudentBundle(model_cfg, spec, feature_dims, opts, rngs=rngs)  # noqa: E731
  p = setup_lib.state_parts(model_fn, plan, spec, mesh, optim_cfg, emb_cfg, steps,
                            skip_counter=False)
  frozen_tables = opts.share_tables if opts.freeze_shared else ()
  table_of = {f: (shared_vocab or {}).get(f, f) for f in plan.features}
  frozen = tuple(sorted({table_of.get(t, t) for t in frozen_tables}))
  step_cfg = tstep.StudentStepConfig(
      p.graphdef, plan, p.tx, p.schedule, p.sparse_lr, spec, opts,
      trainable_mask(p.abstract.params, opts), frozen_row_ranges(plan, frozen), grad_accum)
  return StudentRun(mesh, spec, plan, model_cfg, feature_dims, opts, p.tx, step_cfg, p.abstract,
                    p.shardings, model_fn, p.acc_fn, p.emb_init, {})


def init_student_state(run: StudentRun, seed: int, teacher=None) -> state_lib.TrainState:
  """A fresh student state in its shardings; shared parts copied from `teacher` (a
  `predict.Model` or anything with `.state.params` and `.setup.plan`)."""
  state = setup_lib.init_state(run, seed)
  if run.opts.share_tables or run.opts.share_blocks:
    if teacher is None:
      raise ValueError("share_tables/share_blocks need the teacher (its checkpoint)")
    canon = (emb_lib.export_state(teacher.setup.plan, teacher.state.emb)
             if run.opts.share_tables else {})
    state = share_from_teacher(state, run.plan, teacher.state.params, canon, run.opts)
  return state


def _compiled(run: StudentRun, kind: str, batch_shardings):
  key = (kind, jax.tree.structure(batch_shardings))
  if key not in run.cache:
    fn = tstep.jit_student_train_step if kind == "train" else tstep.jit_student_eval_step
    run.cache[key] = fn(run.step_cfg, run.shardings, batch_shardings)
  return run.cache[key]


def train_steps(run: StudentRun, state, source, *, steps: int, batch_size: int, seed: int = 0,
                data_state: dict | None = None, log_every: int = 0,
                log_fn: Callable[[int, dict], None] | None = None):
  """Trains `steps` steps from `state` on `source` batches (`batch_size` global rows each);
  returns (state, data state, last)."""
  pc, pi = jax.process_count(), jax.process_index()
  it = source.batches(batch_size, process_index=pi, process_count=pc, seed=seed,
                      repeat=True, state=data_state)
  put = setup_lib.device_putter(run.plan, run.mesh)
  last, running, n = {}, None, 0
  with pipeline.Prefetcher(it, put_fn=put, size=2) as batches:
    for i in range(steps):
      batch = next(batches)
      fn = _compiled(run, "train", jax.tree.map(lambda x: x.sharding, batch))
      state, m = fn(state, batch)
      running = m if running is None else jax.tree.map(lambda a, b: a + b, running, m)
      n += 1
      if (log_every and (i + 1) % log_every == 0) or i + 1 == steps:
        last = {k: float(v) / n for k, v in jax.device_get(running).items()}
        if not math.isfinite(last["train_loss"]):
          raise FloatingPointError(f"student train_loss became {last['train_loss']} at step {i + 1}")
        if log_fn is not None:
          log_fn(int(state.step), last)
        running, n = None, 0
    data_state = batches.state()
  return state, data_state, last


def evaluate_student(run: StudentRun, state, source, *, batch_size: int, seed: int = 0,
                     max_batches: int | None = None) -> tuple[Any, dict]:
  """One pass over `source` (repeat=False, `batch_size` global rows a batch):
  {'eval_auc', 'eval_ne', ... per task/domain}."""
  pc, pi = jax.process_count(), jax.process_index()
  it = source.batches(batch_size, process_index=pi, process_count=pc, seed=seed, repeat=False)
  put = setup_lib.device_putter(run.plan, run.mesh)
  batches = (put(b) for b in it)
  first = next(batches)
  fn = _compiled(run, "eval", jax.tree.map(lambda x: x.sharding, first))
  import itertools  # pylint: disable=import-outside-toplevel
  return eval_lib.run_evaluation(fn, state, itertools.chain([first], batches), run.spec.tasks,
                                 run.spec.num_domains, max_batches=max_batches)


# ------------------------------------------------------------------ config-driven --

def train_student(config, workdir: str | None = None, teacher=None) -> dict:
  """Trains the student of `config` (see configs/student_planted.py); returns the summary.

  Args:
    config: the student run config (data, knowledge, teacher, model, embedding,
      optim, train, transfer blocks).
    workdir: where metrics.jsonl (process 0) and the final checkpoint go (None: nowhere).
    teacher: an already restored teacher for parameter sharing (else restored
      from `config.teacher` when sharing is configured).
  """
  from gem_jax.train import predict  # pylint: disable=import-outside-toplevel
  mesh = make_mesh(resolve_mesh_shape(tuple(config.mesh), jax.device_count()))
  per_device, k = config.data.batch_size // mesh.size, config.train.grad_accum
  if k < 1 or per_device % k:
    raise validate.ConfigError(f"config.train.grad_accum={k} must divide the per-device "
                               f"batch {per_device}")
  train_raw, eval_raw, shared = setup_lib.sources(config)
  train_src = kn.KnowledgeSource(train_raw, config.knowledge.train)
  eval_src = kn.KnowledgeSource(eval_raw, config.knowledge.eval)
  dims = train_src.fields
  field = config.transfer.get("teacher_emb") or None
  opts = options_from_config(config.transfer, int(np.prod(dims[field])) if field else 0)
  b = config.data.batch_size
  run = build_student_run(train_src.spec, mesh, setup_lib.model_config(config.model),
                          config.embedding, config.optim, steps=config.train.steps,
                          batch_size=b, opts=opts, shared_vocab=shared,
                          grad_accum=config.train.grad_accum)
  if (opts.share_tables or opts.share_blocks) and teacher is None:
    teacher = predict.restore_model(_load_config(config.teacher.config), config.teacher.workdir, b)
  state = init_student_state(run, config.seed, teacher)
  log = []
  state, data_state, last = train_steps(
      run, state, train_src, steps=config.train.steps, batch_size=b, seed=config.seed,
      log_every=config.train.get("log_every", 0), log_fn=lambda s, m: log.append({"step": s, **m}))
  state, ev = evaluate_student(run, state, eval_src, batch_size=b, seed=config.seed)
  flops = student_flops(run.model_cfg, run.spec, run.feature_dims, opts.teacher_emb_dim)["total"]
  summary = {**last, **ev, "step": int(state.step), "student_flops_per_example": flops}
  if workdir is not None:
    os.makedirs(workdir, exist_ok=True)
    if jax.process_index() == 0:  # one writer (the metrics are global values)
      with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
        for row in log + [summary]:
          f.write(json.dumps(row, default=float) + "\n")
    with ckpt_lib.CheckpointManager(os.path.join(workdir, "checkpoints"), save_every=None,
                                    keep=1) as ckpt:
      ckpt.save(int(state.step), setup_lib.checkpoint_tree(state, run.plan),
                data_state={"train": data_state}, config=config, force=True)
  return summary


def _load_config(path: str):
  """`get_config()` of a config file path."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  spec = importlib.util.spec_from_file_location("_cfg", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config()


def main(argv=None) -> dict:
  import argparse  # pylint: disable=import-outside-toplevel
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", required=True)
  p.add_argument("--workdir", default=None)
  args = p.parse_args(argv)
  out = train_student(_load_config(args.config), args.workdir)
  print(json.dumps(out, default=float), flush=True)
  return out


if __name__ == "__main__":
  main()
