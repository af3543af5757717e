"""Evaluation: a jitted `eval_step` that adds a batch to the metric accumulators
kept in the train state, and the host loop over an eval source.

  acc <- metrics.update(acc, model(inputs(batch, lookup(emb, ids))), labels, label_mask, domain)

Padded rows of the last eval batch carry `label_mask = 0` and so add nothing.
Metrics are read on the host once per evaluation (`metrics.compute`).
"""
from __future__ import annotations

import functools
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
from flax import nnx

from gem_jax import embedding as emb_lib
from gem_jax.parallel import sharding
from gem_jax.train import metrics as metrics_lib
from gem_jax.train.state import TrainState
from gem_jax.train.step import StepConfig, model_inputs


def eval_step(state: TrainState, batch: dict, *, cfg: StepConfig) -> dict:
  """The accumulators after adding `batch` (pure; forward only)."""
  emb = emb_lib.lookup(cfg.plan, state.emb, batch["ids"], batch.get("weights"))
  model = nnx.merge(cfg.graphdef, state.params, state.model_state)
  with sharding.activation_sharding(cfg.plan.mesh):
    logits = model(model_inputs(cfg.spec, batch, emb)).astype(jnp.float32)  # (B, T)
  return metrics_lib.update(state.metrics, logits, batch["labels"], batch["label_mask"],
                            batch["domain"])


def jit_eval_step(cfg: StepConfig, state_shardings: TrainState, batch_shardings: dict):
  """`eval_step` jitted once with explicit shardings (accumulators replicated)."""
  return jax.jit(functools.partial(eval_step, cfg=cfg),
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
