"""The training loop, top to bottom: `train_and_evaluate(config, workdir)`.

  1. validate the config (before anything compiles): mesh vs devices, batch
     divisibility, data present, tables within the memory budget;
  2. mesh, data sources, embedding plan, model, optimizer;
  3. train state: abstract shapes -> shardings -> restore the latest checkpoint
     (state + data position) or initialise directly into the shardings;
  4. compile the train/eval steps once (compile time reported on its own);
  5. loop: step; every `log_every` read the metrics on the host (examples/s,
     step time, TFLOP/s per device, MFU) -> JSONL + TensorBoard; every
     `eval_every` evaluate; every `checkpoint_every` save (async);
  6. final eval + checkpoint, return the summary dict (the final JSON line).

No trainer class: each stage is a function of this module or of the library.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import logging as pylogging
import math
import os
import time
from typing import Any, Callable, NamedTuple

import jax
import numpy as np
from absl import logging
from flax import nnx

from gem_jax import embedding as emb_lib
from gem_jax.data import pipeline
from gem_jax.data import registry as data_registry
from gem_jax.data.spec import DataSpec
from gem_jax.parallel import distributed as dist
from gem_jax.parallel import sharding as shd
from gem_jax.parallel.mesh import make_mesh, resolve_mesh_shape
from gem_jax.train import checkpoint as ckpt_lib
from gem_jax.train import evaluate as eval_lib
from gem_jax.train import metrics as metrics_lib
from gem_jax.train import nonfinite
from gem_jax.train import optim
from gem_jax.train import preemption
from gem_jax.train import report
from gem_jax.train import state as state_lib
from gem_jax.train import step as step_lib
from gem_jax.train import validate
from gem_jax.train import watchdog as watchdog_lib


class ConfigError(ValueError):
  """A run-config problem found before anything compiles."""


# ---------------------------------------------------------------- validation --

def check_config(config, num_devices: int) -> tuple[int, int]:
  """Static checks of a run config; returns the resolved (replica, shard) mesh shape."""
  try:
    mesh_shape = resolve_mesh_shape(tuple(config.mesh), num_devices)
  except ValueError as e:
    hint = ("; on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N "
            "(scripts/train.py sets 8)" if jax.default_backend() == "cpu" else "")
    raise ConfigError(f"config.mesh={tuple(config.mesh)}: {e}{hint}") from None
  n = math.prod(mesh_shape)
  b, k = config.data.batch_size, config.train.grad_accum
  if b % (n * jax.process_count()) or b % n:
    raise ConfigError(f"config.data.batch_size={b} must be divisible by the {n} devices of "
                      f"mesh {mesh_shape} (and by the {jax.process_count()} processes)")
  if k < 1 or (b // n) % k:
    raise ConfigError(f"config.train.grad_accum={k} must divide the per-device batch {b // n}")
  if config.data.eval_batch_size % n:
    raise ConfigError(f"config.data.eval_batch_size={config.data.eval_batch_size} must be "
                      f"divisible by the {n} devices")
  if config.train.steps < 1:
    raise ConfigError(f"config.train.steps={config.train.steps} must be >= 1")
  return mesh_shape


def embedding_configs(spec: DataSpec, emb_cfg, shared: dict | None = None) -> tuple[list, list]:
  """One table per sparse feature (rows = its vocab, width = emb_cfg.dim).

  Pooled features are sum-pooled bags; sequence item features are looked up
  per event (pooling 'none', bag = the stream length). `shared` maps a feature
  to another feature whose table it reads (e.g. a history of ad categories
  and the candidate's category share one table, as the source declares with
  `shared_vocab`).
  """
  shared = dict(shared or {})
  seq_len = {f: s.max_len for s in spec.sequences for f in s.item_features}
  tables, features = [], []
  for f in spec.sparse:
    table = shared.get(f.name, f.name)
    if table == f.name:
      tables.append(emb_lib.TableConfig(f.name, rows=f.vocab, dim=emb_cfg.dim,
                                        sharding=emb_cfg.sharding, id_policy=emb_cfg.id_policy,
                                        vocab=f.vocab))
    if f.name in seq_len:
      features.append(emb_lib.FeatureConfig(f.name, table, bag=seq_len[f.name], pooling="none"))
    else:
      features.append(emb_lib.FeatureConfig(f.name, table, bag=f.bag, pooling="sum"))
  return tables, features


def sparse_optimizer(emb_cfg):
  return emb_lib.SparseOptimizerConfig(kind=emb_cfg.optimizer, lr=emb_cfg.lr)


def make_plan(spec: DataSpec, emb_cfg, mesh, batch_size: int, shared: dict | None = None):
  """The embedding plan; a table over the memory budget is a ConfigError."""
  tables, features = embedding_configs(spec, emb_cfg, shared)
  budget = emb_cfg.get("memory_budget_gb")
  try:
    return emb_lib.plan_embeddings(
        tables, features, mesh, batch_size=batch_size, optimizer=sparse_optimizer(emb_cfg),
        memory_budget_bytes=int(budget * 2**30) if budget else None,
        replica_sync=emb_cfg.get("replica_sync", "auto"))
  except ValueError as e:
    raise ConfigError(f"embedding plan: {e}") from None


_MODELS = {"gem": ("gem_jax.models.gem", "GEM"), "dlrm": ("gem_jax.models.dlrm", "DLRM"),
           "dcnv2": ("gem_jax.models.dlrm", "DCNv2"), "lr": ("gem_jax.models.linear", "LinearModel")}


def _model_config(model_cfg):
  """The GEMConfig of the `model` block: preset + dtype/fp8/remat + overrides."""
  from gem_jax.models import config as model_config  # pylint: disable=import-outside-toplevel
  overrides = {k: tuple(v) if isinstance(v, list) else v
               for k, v in model_cfg.get("overrides", {}).items()}
  remat = None if model_cfg.remat in (None, "", "none") else model_cfg.remat
  try:
    return model_config.get_config(model_cfg.preset, dtype=model_cfg.dtype, fp8=model_cfg.fp8,
                                   remat=remat, **overrides)
  except (KeyError, TypeError) as e:
    raise ConfigError(f"config.model (preset {model_cfg.preset!r}, overrides "
                      f"{sorted(overrides)}): {e}") from None


def model_factory(model_cfg, spec: DataSpec, feature_dims: dict) -> Callable[[nnx.Rngs], nnx.Module]:
  """rngs -> model, from the `model` block (name, preset, overrides, dtype, fp8, remat)."""
  if model_cfg.name not in _MODELS:
    raise ConfigError(f"config.model.name={model_cfg.name!r}: expected one of {sorted(_MODELS)}")
  cfg = _model_config(model_cfg)
  module, name = _MODELS[model_cfg.name]
  cls = getattr(importlib.import_module(module), name)
  return lambda rngs: cls(cfg, spec, feature_dims, rngs=rngs)


def train_flops_per_example(model_cfg, spec: DataSpec, feature_dims: dict) -> float:
  """Analytic training FLOPs per example: 3 x the forward count of `gem_jax.flops`
  (sequences at their padded lengths; embedding gathers count 0)."""
  from gem_jax import flops  # pylint: disable=import-outside-toplevel
  cfg = _model_config(model_cfg)
  if model_cfg.name == "gem":
    fwd = flops.gem_flops(cfg, spec, feature_dims)["total"]
  elif model_cfg.name == "lr":
    from gem_jax.models import linear  # pylint: disable=import-outside-toplevel
    fwd = linear.linear_flops(spec, feature_dims)
  else:
    fwd = flops.dlrm_flops(cfg, spec, feature_dims,
                           "dot" if model_cfg.name == "dlrm" else "dcn")["total"]
  return float(flops.train_flops(fwd))


def xla_flops_per_example(compiled, batch_size: int) -> float | None:
  """FLOPs per example from XLA's cost analysis of the compiled (per-device) step
  (logged next to the analytic count as a cross-check; it includes the optimizer,
  loss and exchange work the analytic count leaves out)."""
  try:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"]) * jax.device_count() / batch_size
  except (KeyError, TypeError, IndexError, AttributeError):
    return None


# ------------------------------------------------------------------ helpers --

def _host_batch(plan, batch: dict, collisions: report.IdCollisions | None = None) -> dict:
  """Host-side preparation: ids through the tables' id policy (-> int32 in range);
  with `collisions`, the batch's per-table id collisions are counted into it."""
  batch = dict(batch)
  raw = batch["ids"]
  batch["ids"] = dist.prepare_local_ids(plan, raw)  # this process's rows
  if collisions is not None:
    collisions.add(emb_lib.table_collisions(plan, raw, batch["ids"]))
  return batch


def _device_putter(plan, mesh, collisions: report.IdCollisions | None = None):
  ids_sh = plan.ids_shardings()

  def put(batch):
    batch = _host_batch(plan, batch, collisions)
    return pipeline.global_batch(batch, shd.batch_shardings(batch, mesh, ids_sh))
  return put


def checkpoint_tree(state: state_lib.TrainState, plan) -> state_lib.TrainState:
  """The saved form: embedding state as unpadded canonical arrays (any mesh can restore).

  Every leaf handed to the asynchronous save is a fresh copy: the next step donates
  the live state, and on CPU the save's host view of a buffer can be the buffer itself.
  """
  fresh = jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x,
                       state.replace(emb=None))
  return fresh.replace(emb=emb_lib.export_state(plan, state.emb))


def checkpoint_abstract(abstract: state_lib.TrainState, plan) -> state_lib.TrainState:
  """Abstract `checkpoint_tree` on this plan's mesh (canonical tables as the plan lays them out)."""
  canon = jax.eval_shape(lambda e: emb_lib.export_state(plan, e), abstract.emb)
  canon = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                       canon, plan.canonical_shardings())
  return abstract.replace(emb=canon)


# -------------------------------------------------------------------- setup --

class Setup(NamedTuple):
  """What a run is made of (built once by `setup`; plain values, no behaviour)."""
  mesh: Any
  spec: DataSpec
  train_src: Any
  eval_src: Any
  plan: Any
  eval_plan: Any
  model_fn: Callable
  feature_dims: dict
  tx: Any
  step_cfg: step_lib.StepConfig
  eval_cfg: step_lib.StepConfig
  abstract: state_lib.TrainState
  shardings: state_lib.TrainState
  acc_fn: Callable
  emb_init: Callable


def setup(config) -> Setup:
  """Validates `config` and builds everything up to (not including) the arrays.

  Every config error surfaces here, before anything is compiled or allocated.
  """
  mesh_shape = check_config(config, jax.device_count())
  mesh = make_mesh(mesh_shape)
  try:
    train_src, eval_src = data_registry.make_sources(config.data)
  except (FileNotFoundError, OSError) as e:
    raise ConfigError(f"config.data ({config.data.kind}): {e}") from None
  spec = train_src.spec
  shared = getattr(train_src, "shared_vocab", None) if config.embedding.share_tables else None
  validate.check_embedding(spec, config.embedding, shared)
  plan = make_plan(spec, config.embedding, mesh, config.data.batch_size, shared)
  eval_plan = (plan if config.data.eval_batch_size == config.data.batch_size else
               make_plan(spec, config.embedding, mesh, config.data.eval_batch_size, shared))
  feature_dims = {f.name: config.embedding.dim for f in spec.sparse}
  model_fn = model_factory(config.model, spec, feature_dims)
  tx, schedule = optim.optimizer_from_config(config.optim, config.train.steps)
  tx = nonfinite.with_skip_counter(tx)  # steps skipped for non-finite values, checkpointed
  sparse_lr = optim.sparse_lr_schedule(config.embedding.lr, config.embedding.get("warmup_steps", 0))
  n_tasks, n_domains = len(spec.tasks), spec.num_domains
  acc_fn = lambda: metrics_lib.init_accumulators(n_tasks, n_domains)  # noqa: E731
  emb_init = lambda key: emb_lib.init_embedding_state(plan, key)  # noqa: E731
  abstract, shardings = state_lib.abstract_train_state(model_fn, tx, plan, emb_init, acc_fn, mesh)
  graphdef = state_lib.model_graphdef(model_fn)
  step_cfg = step_lib.StepConfig(graphdef, plan, tx, schedule, sparse_lr, spec,
                                 config.train.grad_accum)
  eval_cfg = dataclasses.replace(step_cfg, plan=eval_plan, grad_accum=1)
  return Setup(mesh, spec, train_src, eval_src, plan, eval_plan, model_fn, feature_dims, tx,
               step_cfg, eval_cfg, abstract, shardings, acc_fn, emb_init)


def restore_or_init(s: Setup, ckpt, seed: int):
  """(state, train data position or None, restored step or None)."""
  restored = ckpt.restore(checkpoint_abstract(s.abstract, s.plan))
  if restored is None:
    state = state_lib.init_train_state(jax.random.key(seed), s.model_fn, s.tx, s.emb_init,
                                       s.acc_fn, s.shardings)
    return state, None, None
  state = restored.state.replace(emb=emb_lib.import_state(s.plan, restored.state.emb))
  data = restored.data_state or {}
  return state, dist.own_data_position(data.get("train")), restored.step


def _evaluate(s: Setup, eval_fn, state, config):
  """One pass (at most `eval_batches` batches) over the eval source."""
  pc, pi = jax.process_count(), jax.process_index()
  it = s.eval_src.batches(config.data.eval_batch_size, process_index=pi, process_count=pc,
                          seed=config.seed, repeat=False)
  put = _device_putter(s.eval_plan, s.mesh)
  return eval_lib.run_evaluation(eval_fn, state, (put(b) for b in it), s.spec.tasks,
                                 s.spec.num_domains, max_batches=config.train.eval_batches or None)


def _eval_fn(s: Setup, config):
  """`eval_step` jitted for the eval batches' shardings (taken from one eval batch)."""
  pc, pi = jax.process_count(), jax.process_index()
  first = next(s.eval_src.batches(config.data.eval_batch_size, process_index=pi,
                                  process_count=pc, seed=config.seed, repeat=False))
  batch_sh = jax.tree.map(lambda x: x.sharding, _device_putter(s.eval_plan, s.mesh)(first))
  return eval_lib.jit_eval_step(s.eval_cfg, s.shardings, batch_sh)


# --------------------------------------------------------------------- loop --

def quiet_library_logs() -> None:
  """Drops Orbax's per-save INFO lines from the absl log (warnings still show)."""
  class _Filter(pylogging.Filter):
    def filter(self, record):
      return record.levelno >= pylogging.WARNING or "orbax" not in record.pathname
  logging.get_absl_handler().addFilter(_Filter())


def train_and_evaluate(config, workdir: str) -> dict[str, Any]:
  """Trains `config` in `workdir` (resuming from its latest checkpoint); returns the summary."""
  quiet_library_logs()
  report.enable_compilation_cache(config.train.compile_cache or None)
  s = setup(config)
  validate.check_workdir(workdir, validate.checkpoint_bytes(s.abstract, config.train.keep))
  if jax.process_index() == 0:
    logging.info("mesh %s on %d %s devices\n%s", dict(s.mesh.shape), jax.device_count(),
                 jax.default_backend(), s.plan.describe())
  os.makedirs(workdir, exist_ok=True)
  writer = report.MetricWriter(workdir)
  ckpt = ckpt_lib.CheckpointManager(
      os.path.join(workdir, "checkpoints"), save_every=config.train.checkpoint_every,
      keep=config.train.keep, best_metric=config.train.best_metric)
  state, data_state, restored_step = restore_or_init(s, ckpt, config.seed)
  step, steps, batch_size = int(state.step), config.train.steps, config.data.batch_size
  stop_at = config.train.get("stop_at", 0) or steps  # < steps: simulated preemption
  if restored_step is not None:
    logging.info("resumed from the checkpoint at step %d", restored_step)

  # Data (prefetched to the devices in a background thread) and the compiled step.
  pc, pi = jax.process_count(), jax.process_index()
  train_it = s.train_src.batches(batch_size, process_index=pi, process_count=pc,
                                 seed=config.seed, repeat=True, state=data_state)
  hashed = any(t.id_policy != "error" for t in s.plan.tables.values())
  collisions = (report.IdCollisions()
                if hashed and config.train.get("id_collision_metrics", True) else None)
  batches = pipeline.Prefetcher(train_it, put_fn=_device_putter(s.plan, s.mesh, collisions),
                                size=2)
  batch = next(batches)
  batch_sh = jax.tree.map(lambda x: x.sharding, batch)
  train_fn, timing = report.timed_compile(
      nonfinite.jit_guarded_train_step(s.step_cfg, s.shardings, batch_sh,
                                       config.train.get("inject_nan_step", 0)), state, batch)
  compile_s = timing.lower_s + timing.compile_s
  eval_fn = None
  flops = train_flops_per_example(config.model, s.spec, s.feature_dims)
  xla_flops = xla_flops_per_example(train_fn, batch_size)
  peak = report.peak_flops_per_device(jax.devices()[0], config.model.dtype)
  writer.write(step, {"compile_s": compile_s, "lower_s": timing.lower_s,
                      "xla_compile_s": timing.compile_s, "train_flops_per_example": flops,
                      "xla_train_flops_per_example": xla_flops or float("nan"),
                      "peak_flops_per_device": peak or 0.0})
  logging.info("train step lowered in %.1f s, compiled in %.1f s", timing.lower_s,
               timing.compile_s)

  profiler = report.Profiler(workdir, config.train.profile_steps)
  progress = report.Progress(steps, initial=step)
  watchdog = watchdog_lib.StepWatchdog.from_env(step)  # a stalled step exits non-zero
  summary, last, running, n_log = {}, {}, None, 0
  t_log = time.perf_counter()
  nf_policy = nonfinite.NonFinitePolicy(config.train.get("nonfinite", "skip"),
                                        config.train.get("max_rollbacks", 3))
  preempt = preemption.PreemptionWatcher(
      check_every=config.train.get("preempt_check_every", 1)).install()
  try:
    while step < min(steps, stop_at):
      if profiler.starts_at(step):  # the trace holds steps only: no async checkpoint write or
        ckpt.wait()                 # queued work runs while the profiler session starts
        jax.block_until_ready(state)
      profiler.maybe_start(step)
      with report.step_annotation(step):
        state, metrics = train_fn(state, batch)
      step += 1
      n_log += 1
      if collisions is not None:
        collisions.consume()
      if nf_policy.check(step, metrics):  # train.nonfinite='rollback'
        state = nonfinite.rolled_back(state, restore_or_init(s, ckpt, config.seed)[0])
      watchdog.beat(step)
      running = metrics if running is None else jax.tree.map(lambda a, b: a + b, running, metrics)
      profiler.maybe_stop(step, state, metrics)

      if step % config.train.log_every == 0 or step == steps:
        host = {k: float(v) / n_log for k, v in jax.device_get(running).items()}
        if not math.isfinite(host["train_loss"]):
          raise FloatingPointError(f"train_loss became {host['train_loss']} at step {step}")
        host.update(report.throughput(n_log * batch_size, time.perf_counter() - t_log,
                                      n_log, flops, jax.device_count(), peak))
        host.update(collisions.metrics() if collisions is not None else {})
        writer.write(step, host)
        progress.update(step, host)
        last, running, n_log = host, None, 0

      eval_metrics = None
      if step % config.train.eval_every == 0 or step == steps:
        eval_fn = eval_fn or _eval_fn(s, config)
        state, eval_metrics = _evaluate(s, eval_fn, state, config)
        writer.write(step, eval_metrics)
        progress.update(step, eval_metrics)
        summary.update(eval_metrics)
      preempted = preempt.should_stop(step)  # SIGTERM/SIGINT: checkpoint now and return
      if ckpt.should_save(step) or step in (steps, stop_at) or preempted:  # every process's data position
        ckpt.save(step, checkpoint_tree(state, s.plan),
                  data_state={"train": dist.data_positions(batches.state())},
                  config=config, metrics=eval_metrics,
                  force=step in (steps, stop_at) or preempted)
      if preempted:
        ckpt.wait()
        break
      if eval_metrics is not None or step % config.train.log_every == 0:
        t_log = time.perf_counter()  # eval / checkpoint time is not step time
      if step < min(steps, stop_at):
        batch = next(batches)
    if summary.get("eval_auc") is None and step >= steps:  # restarted after the end
      state, eval_metrics = _evaluate(s, eval_fn or _eval_fn(s, config), state, config)
      summary.update(eval_metrics)
    oracle = oracle_summary(s.eval_src, summary, config.data.eval_examples)
    if oracle:
      writer.write(step, oracle)
  finally:
    watchdog.stop()
    preempt.uninstall()
    batches.close()
    ckpt.close()
    profiler.close()
    progress.close()
    writer.close()
  summary.update(last)
  summary.update(step=step, compile_s=compile_s, workdir=os.path.abspath(workdir), **oracle)
  return summary


def oracle_summary(eval_src, metrics: dict, n: int) -> dict:
  """For sources with a planted signal: the best achievable AUC and the share of
  the gap closed, (AUC - 0.5) / (oracle AUC - 0.5)."""
  if not hasattr(eval_src, "oracle_auc") or "eval_auc" not in metrics:
    return {}
  oracle = eval_src.oracle_auc(n)
  out = {"oracle_auc": oracle["auc"]}
  if oracle["auc"] > 0.5:
    out["auc_gap_closed"] = (metrics["eval_auc"] - 0.5) / (oracle["auc"] - 0.5)
  return out


# ---------------------------------------------------------------------- CLI --

def parse_flags_or_exit(argv) -> list[str]:
  """absl flag parsing with a one-line message for unknown config fields.

  ml_collections rejects `--config.train.stepz=1` with a traceback; this turns it
  into `config error: unknown field 'train.stepz' ...` and exit status 1.
  Use as `app.run(main, flags_parser=parse_flags_or_exit)`.
  """
  from absl import flags  # pylint: disable=import-outside-toplevel
  try:
    return flags.FLAGS(argv)
  except (AttributeError, KeyError) as e:
    bad = [a.split("=")[0][len("--config."):] for a in argv[1:] if a.startswith("--config.")]
    raise SystemExit(f"config error: unknown config field among {bad}: "
                     f"{str(e).strip(chr(39))}".replace("\\n", " ")) from None
  except flags.Error as e:
    raise SystemExit(f"flag error: {e}") from None


def run_and_print(fn: Callable[..., dict], *args) -> dict:
  """Runs `fn(*args)`; ConfigErrors become a one-line message (exit 1), the result
  one JSON line on stdout (process 0)."""
  try:
    out = fn(*args)
  except ConfigError as e:
    raise SystemExit(f"config error: {e}") from None
  if jax.process_index() == 0:
    print(json.dumps(out, default=float), flush=True)
  return out


def evaluate_checkpoint(config, workdir: str, step: int | None = None) -> dict[str, Any]:
  """Restores the latest (or `step`) checkpoint of `workdir` and evaluates it."""
  quiet_library_logs()
  s = setup(config)
  ckpt = ckpt_lib.CheckpointManager(os.path.join(workdir, "checkpoints"), save_every=None,
                                    keep=config.train.keep, best_metric=config.train.best_metric)
  try:
    restored = ckpt.restore(checkpoint_abstract(s.abstract, s.plan), step=step)
  finally:
    ckpt.close()
  if restored is None:
    raise ConfigError(f"no checkpoint in {os.path.join(workdir, 'checkpoints')}")
  state = restored.state.replace(emb=emb_lib.import_state(s.plan, restored.state.emb))
  _, out = _evaluate(s, _eval_fn(s, config), state, config)
  out["step"] = restored.step
  return out
