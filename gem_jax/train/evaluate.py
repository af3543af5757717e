"""Evaluation: a jitted `eval_step` that adds a batch to the metric accumulators
kept in the train state, and the host loop over an eval source.

  acc <- metrics.update(acc, model(inputs(batch, lookup(emb, ids))), labels, label_mask, domain)

Padded rows of the last eval batch carry `label_mask = 0` and so add nothing.
Metrics are read on the host once per evaluation (`metrics.compute`).

`evaluate(s, eval_fn, state, config)` is one pass over a run's eval source (the
trainer's periodic evaluation); `evaluate_checkpoint` restores a workdir's
checkpoint and evaluates it (scripts/evaluate.py).
"""
from __future__ import annotations

import functools
import math
import os
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
from flax import nnx

from gem_jax import embedding as emb_lib
from gem_jax.parallel import sharding
from gem_jax.train import checkpoint as ckpt_lib
from gem_jax.train import metrics as metrics_lib
from gem_jax.train import report
from gem_jax.train import setup as setup_lib
from gem_jax.train.state import TrainState
from gem_jax.train import step as step_lib
from gem_jax.train.step import StepConfig


def eval_step(state: TrainState, batch: dict, *, cfg: StepConfig,
              forward: Callable = step_lib.forward) -> dict:
  """The accumulators after adding `batch` (pure; forward only).

  forward(model, spec, batch, emb) -> logits (B, T) fp32 (default: the trainer's
  `step.forward`; the transfer student passes its own), run with the model's
  activations pinned to the mesh like in the train step.
  """
  emb = emb_lib.lookup(cfg.plan, state.emb, batch["ids"], batch.get("weights"))
  model = nnx.merge(cfg.graphdef, state.params, state.model_state)
  with sharding.activation_sharding(cfg.plan.mesh):
    logits = forward(model, cfg.spec, batch, emb).astype(jnp.float32)  # (B, T)
  return metrics_lib.update(state.metrics, logits, batch["labels"], batch["label_mask"],
                            batch["domain"])


def jit_eval_step(cfg: StepConfig, state_shardings: TrainState, batch_shardings: dict,
                  **step_kwargs):
  """`eval_step(..., **step_kwargs)` jitted once with explicit shardings (accumulators
  replicated)."""
  return jax.jit(functools.partial(eval_step, cfg=cfg, **step_kwargs),
                 in_shardings=(state_shardings, batch_shardings),
                 out_shardings=state_shardings.metrics)


def run_evaluation(eval_fn: Callable, state: TrainState, batches: Iterable[dict],
                   task_names, num_domains: int, max_batches: int | None = None
                   ) -> tuple[TrainState, dict]:
  """Resets the accumulators, streams `batches` (global device batches) through
  `eval_fn`, returns (state with the filled accumulators, {'eval_auc': ..., ...})."""
  state = state.replace(metrics=jax.tree.map(
      lambda a: jax.device_put(jnp.zeros(a.shape, a.dtype), a.sharding), state.metrics))
  n = 0
  for batch in batches:
    if max_batches is not None and n >= max_batches:
      break
    state = state.replace(metrics=eval_fn(state, batch))
    n += 1
  values = metrics_lib.compute(state.metrics, task_names, num_domains)
  out = {f"eval_{k}": float(v) for k, v in values.items()}
  out["eval_batches"] = n
  return state, out


def vs_base_rate(acc, metrics: dict, task_names) -> tuple[dict, dict]:
  """An evaluation's log loss against the base rate's: predicting the eval rows' own label
  rate (label sum / count of the accumulators `acc` just filled: no extra pass) for every
  row. -> ({'eval_base_rate_logloss': mean over tasks (as eval_logloss), per task
  'eval_base_rate_logloss/TASK' when there are several, 'worse_than_base_rate': bool},
  {task: (eval log loss, base rate's) of the tasks where the first is the larger})."""
  base = metrics_lib.base_rate_logloss(acc, task_names)
  finite = [v for v in base.values() if math.isfinite(v)]
  out = {"eval_base_rate_logloss": sum(finite) / len(finite) if finite else float("nan")}
  if len(task_names) > 1:
    out.update({f"eval_base_rate_logloss/{t}": v for t, v in base.items()})
  worse = {t: (metrics[f"eval_logloss/{t}"], base[t]) for t in task_names
           if metrics.get(f"eval_logloss/{t}", float("nan")) > base[t]}
  out["worse_than_base_rate"] = bool(worse)
  return out, worse


# ------------------------------------------------------------- a run's eval --

def _eval_batches(s: setup_lib.Setup, config):
  """This process's rows of the eval source's global batches (one pass)."""
  return s.eval_src.batches(config.data.eval_batch_size, process_index=jax.process_index(),
                            process_count=jax.process_count(), seed=config.seed, repeat=False)


def evaluate(s: setup_lib.Setup, fn, state, config):
  """One pass (at most `eval_batches` batches) over the eval source of setup `s`."""
  put = setup_lib.device_putter(s.eval_plan, s.mesh)
  return run_evaluation(fn, state, (put(b) for b in _eval_batches(s, config)), s.spec.tasks,
                        s.spec.num_domains, max_batches=config.train.eval_batches or None)


def eval_fn(s: setup_lib.Setup, config):
  """`eval_step` jitted for the eval batches' shardings (taken from one eval batch)."""
  first = next(iter(_eval_batches(s, config)))
  put = setup_lib.device_putter(s.eval_plan, s.mesh)
  batch_sh = jax.tree.map(lambda x: x.sharding, put(first))
  return jit_eval_step(s.eval_cfg, s.shardings, batch_sh)


def evaluate_checkpoint(config, workdir: str, step: int | None = None) -> dict[str, Any]:
  """Restores the latest (or `step`) checkpoint of `workdir` and evaluates it."""
  report.quiet_library_logs()
  s = setup_lib.setup(config)
  ckpt = ckpt_lib.CheckpointManager(os.path.join(workdir, "checkpoints"), save_every=None,
                                    keep=config.train.keep, best_metric=config.train.best_metric)
  try:
    state, restored = setup_lib.restore(s, ckpt, step)
  finally:
    ckpt.close()
  if restored is None:
    raise setup_lib.ConfigError(f"no checkpoint in {os.path.join(workdir, 'checkpoints')}")
  _, out = evaluate(s, eval_fn(s, config), state, config)
  out["step"] = restored.step
  return out
