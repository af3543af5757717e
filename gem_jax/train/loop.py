"""The training loop, top to bottom: `train_and_evaluate(config, workdir)`.

  1. validate the config (before anything compiles): mesh vs devices, batch
     divisibility, data present, tables within the memory budget;
  2. mesh, data sources, embedding plan, model, optimizer;
  3. train state: abstract shapes -> shardings -> restore the latest checkpoint
     (state + data position) or initialise directly into the shardings;
  4. compile the train/eval steps once (compile time reported on its own);
  5. loop: step; every `log_every` read the metrics on the host (examples/s,
     step time, TFLOP/s per device, MFU, host RSS/heap) -> JSONL + TensorBoard; every
     `eval_every` evaluate; every `checkpoint_every` save (async); with
     `early_stop_patience` N, stop (and save) after N evaluations in a row
     without a new best `best_metric`;
  6. final eval + checkpoint, return the summary dict (the final JSON line): the
     last eval's keys, `best` (the best eval by `best_metric`, with its step),
     `stopped_early`, and the last eval against the base rate
     (`eval_base_rate_logloss`, `worse_than_base_rate`; a warning when worse).

The run's length is `s.steps` (setup.resolve_steps: train.steps, or train.epochs
passes over data.train).

No trainer class: stages 1-3 are `setup.py` (config -> objects, shared with
evaluation, the benchmarks and knowledge transfer); evaluation passes are
`evaluate.py`; this module keeps the loop and the command-line helpers.
"""
from __future__ import annotations

import ast
import dataclasses
import json
import math
import os
import sys
import time
from typing import Any, Callable

import jax
import numpy as np
from absl import logging

from gem_jax import hostmem
from gem_jax.data import pipeline
from gem_jax.parallel import distributed as dist
from gem_jax.parallel import sharding as shd
from gem_jax.train import checkpoint as ckpt_lib
from gem_jax.train import evaluate as eval_lib
from gem_jax.train import metrics as metrics_lib
from gem_jax.train import nonfinite
from gem_jax.train import packing as packing_lib
from gem_jax.train import preemption
from gem_jax.train import report
from gem_jax.train import setup as setup_lib
from gem_jax.train import step as step_lib
from gem_jax.train import validate
from gem_jax.train import watchdog as watchdog_lib



# --------------------------------------------------------------------- loop --

class EvalRecord:
  """The evaluations of a run: the best by `metric` so far and early stopping.

  `add(step, metrics, last_step)` -> whether it is a new best (strictly better, in the
  metric's direction: metrics.metric_mode); `stop` turns true after `patience` (> 0)
  evaluations in a row that were not, before `last_step` (at the last step the run
  ends anyway: not early). `state()` / `EvalRecord(..., state=)` carry it
  through a checkpoint (the 'evals' data entry), so a resumed run keeps its best and
  its count, and a run that stopped early stays stopped.
  """

  def __init__(self, metric: str | None, patience: int, state: dict | None = None):
    self.metric, self.patience = metric or None, int(patience)
    self.mode = metrics_lib.metric_mode(metric) if self.metric else None
    state = state or {}
    self.best: dict | None = state.get("best")
    self.since_best = int(state.get("since_best", 0))
    self.stopped_at: int | None = state.get("stopped_at")

  def state(self) -> dict:
    return {"best": self.best, "since_best": self.since_best, "stopped_at": self.stopped_at}

  def add(self, step: int, metrics: dict, last_step: int) -> bool:
    if self.metric is None:
      return False
    v = metrics.get(self.metric)
    better = v is not None and math.isfinite(v) and (
        self.best is None or (v > self.best[self.metric] if self.mode == "max"
                              else v < self.best[self.metric]))
    if better:
      self.best, self.since_best = {"step": int(step), **metrics}, 0
    else:
      self.since_best += 1
    if 0 < self.patience <= self.since_best and step < last_step and self.stopped_at is None:
      self.stopped_at = int(step)
      logging.info("early stop at step %d: %s did not improve on %.6g (step %d) in %d "
                   "evaluations", step, self.metric, self.best[self.metric] if self.best
                   else float("nan"), self.best["step"] if self.best else -1, self.since_best)
    return better

  @property
  def stop(self) -> bool:
    return self.stopped_at is not None


def train_and_evaluate(config, workdir: str) -> dict[str, Any]:
  """Trains `config` in `workdir` (resuming from its latest checkpoint); returns the summary."""
  report.quiet_library_logs()
  report.enable_compilation_cache(config.train.compile_cache or None)
  s = setup_lib.setup(config)
  validate.check_workdir(workdir, validate.checkpoint_bytes(s.abstract, config.train.keep))
  if jax.process_index() == 0:
    logging.info("mesh %s on %d %s devices\n%s", dict(s.mesh.shape), jax.device_count(),
                 jax.default_backend(), s.plan.describe())
    malloc_line, warn = hostmem.malloc_summary()
    (logging.warning if warn else logging.info)(malloc_line)
  os.makedirs(workdir, exist_ok=True)
  writer = report.MetricWriter(workdir)
  ckpt = ckpt_lib.CheckpointManager(
      os.path.join(workdir, "checkpoints"), save_every=config.train.checkpoint_every,
      keep=config.train.keep, best_metric=config.train.best_metric,
      max_save_failures=config.train.save_failures, busy=config.train.save_when_busy)
  saved: dict = {}
  state, data_state, restored_step = setup_lib.restore_or_init(s, ckpt, config.seed,
                                                               saved=saved)
  step, steps, batch_size = int(state.step), s.steps, config.data.batch_size
  evals = EvalRecord(config.train.best_metric, config.train.early_stop_patience,
                     saved.get("evals"))
  save_best = evals.patience > 0   # early stopping: every new best is checkpointed
  stop_at = config.train.stop_at or steps  # < steps: simulated preemption
  if restored_step is not None:
    logging.info("resumed from the checkpoint at step %d", restored_step)

  # Data (prefetched to the devices in a background thread) and the compiled step.
  pc, pi = jax.process_count(), jax.process_index()
  train_it = s.train_src.batches(batch_size, process_index=pi, process_count=pc,
                                 seed=config.seed, repeat=True, state=data_state)
  hashed = any(t.id_policy in ("hash", "clip") for t in s.plan.tables.values())
  collisions = (report.IdCollisions()
                if hashed and config.train.id_collision_metrics else None)
  put = setup_lib.device_putter(s.plan, s.mesh, collisions)
  fit = setup_lib.packing_fit(config, s.spec)
  if fit is not None:  # packed histories: even out the events over this process's shards
    reorder = packing_lib.balanced(fit, shd.batch_groups(s.mesh) // jax.process_count())
    put = lambda b, put=put: put(reorder(b))  # noqa: E731
  batches = pipeline.Prefetcher(train_it, put_fn=put, size=2)
  batch = next(batches)
  batch_sh = jax.tree.map(lambda x: x.sharding, batch)
  train_fn, timing = report.timed_compile(
      step_lib.jit_train_step(s.step_cfg, s.shardings, batch_sh, skip_nonfinite=True,
                              inject_nan_step=config.train.inject_nan_step),
      state, batch)
  compile_s = timing.lower_s + timing.compile_s
  eval_fn = None
  # Packed histories: MFU from useful FLOPs, the real lengths of the first batch's rows here.
  lengths = None if fit is None else {
      name: np.concatenate(fit.shard_lengths(batch, name)) for name in fit.streams}
  flops = setup_lib.train_flops_per_example(config.model, s.spec, s.feature_dims, lengths)
  xla_flops = setup_lib.xla_flops_per_example(train_fn, batch_size)
  peak = report.peak_flops_per_device(jax.devices()[0], config.model.dtype)
  writer.write(step, {"compile_s": compile_s, "lower_s": timing.lower_s,
                      "xla_compile_s": timing.compile_s, "train_flops_per_example": flops,
                      "xla_train_flops_per_example": xla_flops or float("nan"),
                      "peak_flops_per_device": peak or 0.0,
                      "flops_count": "padded" if fit is None else "real_tokens_first_batch"})
  if fit is not None:  # packed histories: batches that do not fit step padded
    padded_cfg = dataclasses.replace(s.step_cfg, graphdef=s.eval_cfg.graphdef)
    train_fn = packing_lib.PackedOrPadded(
        train_fn, lambda: step_lib.jit_train_step(
            padded_cfg, s.shardings, batch_sh, skip_nonfinite=True,
            inject_nan_step=config.train.inject_nan_step), fit)
  logging.info("train step lowered in %.1f s, compiled in %.1f s", timing.lower_s,
               timing.compile_s)

  profiler = report.Profiler(workdir, config.train.profile_steps)
  progress = report.Progress(steps, initial=step, keys=report.PROGRESS_KEYS + (
      ("mc_hit_rate", "mc_collisions", "mc_broadcast") if s.plan.managed_tables() else ()))
  watchdog = watchdog_lib.StepWatchdog.from_env(step)  # a stalled step exits non-zero
  summary, last, running, n_log, worse = {}, {}, None, 0, {}
  t_log = time.perf_counter()
  nf_policy = nonfinite.NonFinitePolicy(config.train.nonfinite,
                                        config.train.max_rollbacks)
  preempt = preemption.PreemptionWatcher(
      check_every=config.train.preempt_check_every).install()
  try:
    while step < min(steps, stop_at) and not evals.stop:
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
        state = nonfinite.rolled_back(state, setup_lib.restore_or_init(s, ckpt, config.seed)[0])
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
        host.update(hostmem.host_memory_mb())  # host_rss_mb, host_heap_used/free_mb
        if fit is not None:  # steps so far whose batch did not fit the packed rows
          host["pack_fallback_steps"] = float(train_fn.fallbacks)
        writer.write(step, host)
        progress.update(step, host)
        last, running, n_log = host, None, 0

      eval_metrics, new_best = None, False
      if (config.train.eval_every and step % config.train.eval_every == 0) or step == steps:
        eval_fn = eval_fn or eval_lib.eval_fn(s, config)
        state, eval_metrics = eval_lib.evaluate(s, eval_fn, state, config)
        writer.write(step, eval_metrics)
        progress.update(step, eval_metrics)
        vs_base, worse = eval_lib.vs_base_rate(state.metrics, eval_metrics, s.spec.tasks)
        record = {**eval_metrics, **vs_base}
        summary.update(record)
        new_best = evals.add(step, record, steps)
      preempted = preempt.should_stop(step)  # SIGTERM/SIGINT: checkpoint now and return
      force = step in (steps, stop_at) or preempted or evals.stop or (new_best and save_best)
      if ckpt.should_save(step) or force:  # every process's data position
        ckpt.save(step, setup_lib.checkpoint_tree(state, s.plan),
                  data_state={"train": dist.data_positions(batches.state()),
                              "evals": evals.state()},
                  config=config, metrics=eval_metrics, force=force)
      if preempted or evals.stop:
        ckpt.wait()
        break
      if eval_metrics is not None or step % config.train.log_every == 0:
        t_log = time.perf_counter()  # eval / checkpoint time is not step time
      if step < min(steps, stop_at):
        batch = next(batches)
    if summary.get("eval_auc") is None and (step >= steps or evals.stop):  # restarted after
      state, eval_metrics = eval_lib.evaluate(s, eval_fn or eval_lib.eval_fn(s, config), state,
                                              config)                       # the end
      vs_base, worse = eval_lib.vs_base_rate(state.metrics, eval_metrics, s.spec.tasks)
      summary.update(eval_metrics)
      summary.update(vs_base)
    if worse:  # the last eval
      logging.warning(
          "eval log loss is worse than the base rate's (predicting the eval label rate for "
          "every row): %s; the model overfits or diverged%s",
          ", ".join(f"{t} {a:.4f} > {b:.4f}" for t, (a, b) in worse.items()),
          f" (best eval, step {evals.best['step']}: {evals.metric} "
          f"{evals.best[evals.metric]:.4f})" if evals.best else "")
    oracle = oracle_summary(s.eval_src, summary, config.data.eval_examples)
    if oracle:
      writer.write(step, oracle)
  finally:
    watchdog.stop()
    preempt.uninstall()
    batches.close()
    train_it.close()
    if getattr(train_it, "bytes_read", None) is not None:   # columnar reader: this process's
      logging.info("input: process %d of %d read %d bytes", pi, pc, train_it.bytes_read)
    ckpt.close(check=sys.exc_info()[0] is None)   # a failed last save: CheckpointSaveError
    profiler.close()
    progress.close()
    writer.close()
  summary.update(last)
  summary.update(step=step, compile_s=compile_s, workdir=os.path.abspath(workdir), **oracle)
  summary["stopped_early"] = evals.stop
  if evals.stop:
    summary["stopped_early_step"] = evals.stopped_at
  if evals.best is not None:
    summary["best"] = dict(evals.best)
  return summary


def oracle_summary(eval_src, metrics: dict, n: int) -> dict:
  """For sources with a planted signal: the best achievable AUC and the share of
  the gap closed, (AUC - 0.5) / (oracle AUC - 0.5)."""
  if not hasattr(eval_src, "oracle_auc") or "eval_auc" not in metrics:
    return {}
  oracle = eval_src.oracle_auc(n)
  out = {"oracle_auc": oracle["auc"]}
  if "short_auc" in oracle:   # long_history: the best logit of the newest `recent` events
    out["short_oracle_auc"] = oracle["short_auc"]
  if oracle["auc"] > 0.5:
    out["auc_gap_closed"] = (metrics["eval_auc"] - 0.5) / (oracle["auc"] - 0.5)
  return out


# ---------------------------------------------------------------------- CLI --

MODEL_OVERRIDES = "--config.model.overrides."


def split_model_overrides(argv) -> tuple[list[str], dict[str, Any]]:
  """(argv without them, {field: value}) of the `--config.model.overrides.FIELD=VALUE`
  flags; values are Python literals (`3`, `True`, `(64, 32)`, `'full'`) or plain strings."""
  rest, overrides = [], {}
  for a in argv:
    if a.startswith(MODEL_OVERRIDES) and "=" in a:
      key, value = a[len(MODEL_OVERRIDES):].split("=", 1)
      try:
        overrides[key] = ast.literal_eval(value)
      except (ValueError, SyntaxError):
        overrides[key] = value
    else:
      rest.append(a)
  return rest, overrides


def parse_flags_or_exit(argv) -> list[str]:
  """absl flag parsing with a one-line message for unknown config fields.

  ml_collections rejects `--config.train.stepz=1` with a traceback; this turns it
  into `config error: unknown field 'train.stepz' ...` and exit status 1.
  `--config.model.overrides.FIELD=VALUE` sets any model-config field (the block is open;
  the model checks the fields when it is built). Use as
  `app.run(main, flags_parser=parse_flags_or_exit)`.
  """
  from absl import flags  # pylint: disable=import-outside-toplevel
  argv, overrides = split_model_overrides(argv)
  sys.argv[:] = split_model_overrides(sys.argv)[0]  # ml_collections reads sys.argv too
  try:
    rest = flags.FLAGS(argv)
  except (AttributeError, KeyError) as e:
    bad = [a.split("=")[0][len("--config."):] for a in argv[1:] if a.startswith("--config.")]
    raise SystemExit(f"config error: unknown config field among {bad}: "
                     f"{str(e).strip(chr(39))}".replace("\\n", " ")) from None
  except flags.Error as e:
    raise SystemExit(f"flag error: {e}") from None
  if overrides:
    block = flags.FLAGS.config.model.overrides
    with block.unlocked():
      for key, value in overrides.items():
        block[key] = value
  return rest


def run_and_print(fn: Callable[..., dict], *args) -> dict:
  """Runs `fn(*args)`; ConfigErrors become a one-line message (exit 1), the result
  one JSON line on stdout (process 0)."""
  try:
    out = fn(*args)
  except validate.ConfigError as e:
    raise SystemExit(f"config error: {e}") from None
  if jax.process_index() == 0:
    print(json.dumps(out, default=float), flush=True)
  return out
