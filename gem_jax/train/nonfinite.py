"""Non-finite losses and gradients: detected inside the jitted step, handled by policy.

Inside the step (every mode):

  new, m = train_step(state, batch)
  ok     = isfinite(loss) & isfinite(||g_dense||)          (one scalar each)
  state' = ok ? new : state (params, optimizer moments: a select; tables and
           slots: the sparse update is disabled, no copy), with step + 1, the
           RNG advanced and skipped += !ok

so a bad batch never changes the model (optax's own update count, which drives
the dense lr schedule, stays behind `state.step` by the skipped steps); `skipped` lives in the optimizer state
(`SkipCountState`, checkpointed with it) and the step's metrics carry
`nonfinite_loss` / `nonfinite_grad` (0/1) and the loss/grad norm with the bad
value replaced by 0 (so the logged means stay finite; a window with skipped
steps under-reports the mean loss by that share).

On the host, `train.nonfinite` picks what happens next:

  'skip'      (default) nothing: the update was skipped and counted; no host sync.
  'rollback'  the model goes back to the last checkpoint; the step counter and
              the data position do not (the batches since that checkpoint are
              not replayed, so a bad batch cannot bring the run back to the same
              spot); after `max_rollbacks` rollbacks the run stops.
  'stop'      `NonFiniteError` naming the step and the metric.

'rollback' and 'stop' read the two flags every step (one small device->host
transfer per step). The embedding gradients are not checked on their own: a
non-finite value anywhere in the forward pass reaches the loss and the dense
gradients. Cost of the guard: a select over the dense params and optimizer
moments; the tables are not selected: a bad step turns the sparse update into
a no-op (`apply_sparse_updates(..., enabled=ok)`), so they stay updated in
place.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from absl import logging

from gem_jax.train import step as step_lib
from gem_jax.train.state import TrainState

MODES = ("skip", "rollback", "stop")


class NonFiniteError(FloatingPointError):
  """A non-finite loss or gradient under `train.nonfinite='stop'` (or too many rollbacks)."""


class SkipCountState(NamedTuple):
  """Steps whose update was skipped because of a non-finite loss or gradient."""
  skipped: jax.Array  # int32 ()


def with_skip_counter(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """`tx` whose state also holds the skipped-steps counter (last element of the chain)."""
  counter = optax.GradientTransformation(
      lambda _: SkipCountState(jnp.zeros((), jnp.int32)),
      lambda updates, state, params=None: (updates, state))
  return optax.chain(tx, counter)


def skipped_steps(state: TrainState) -> int:
  """The skipped-steps counter of a state built with `with_skip_counter`."""
  return int(jax.device_get(state.opt_state[-1].skipped))


def _inject_nan(batch: dict, hit: jax.Array) -> dict:
  """Debug hook: the batch's dense features become NaN where `hit` (a traced bool)."""
  dense = batch["dense"]
  return dict(batch, dense=jnp.where(hit, jnp.full_like(dense, jnp.nan), dense))


def guarded_train_step(state: TrainState, batch: dict, *, cfg: step_lib.StepConfig,
                       inject_nan_step: int = 0) -> tuple[TrainState, dict]:
  """`train_step` that skips (and counts) an update with a non-finite loss or gradient.

  Args:
    state: the train state (its optimizer built with `with_skip_counter`).
    batch: a global batch.
    cfg: the step config.
    inject_nan_step: debug: step number (1-based, the step that ends at
      `state.step == inject_nan_step`) whose batch gets NaN dense features; 0: off.
  """
  if inject_nan_step:
    batch = _inject_nan(batch, state.step + 1 == inject_nan_step)
  new, m = step_lib.train_step(state, batch, cfg=cfg, skip_nonfinite=True)
  bad_loss = ~jnp.isfinite(m["train_loss"])
  bad_grad = ~jnp.isfinite(m["grad_norm"])
  ok = ~(bad_loss | bad_grad)
  *inner, count = new.opt_state
  opt_state = (*inner, SkipCountState(count.skipped + (~ok).astype(jnp.int32)))
  out = new.replace(opt_state=type(new.opt_state)(opt_state))
  m = dict(m, train_loss=jnp.where(bad_loss, 0.0, m["train_loss"]),
           grad_norm=jnp.where(bad_grad, 0.0, m["grad_norm"]),
           nonfinite_loss=bad_loss.astype(jnp.float32),
           nonfinite_grad=bad_grad.astype(jnp.float32))
  return out, m


def jit_guarded_train_step(cfg: step_lib.StepConfig, state_shardings: TrainState,
                           batch_shardings: dict, inject_nan_step: int = 0):
  """`guarded_train_step` jitted once (explicit shardings, state donated, metrics replicated)."""
  rep = jax.sharding.NamedSharding(state_shardings.rng.mesh, jax.sharding.PartitionSpec())
  return jax.jit(lambda s, b: guarded_train_step(s, b, cfg=cfg, inject_nan_step=inject_nan_step),
                 in_shardings=(state_shardings, batch_shardings),
                 out_shardings=(state_shardings, rep),
                 donate_argnums=0)


class NonFinitePolicy:
  """Host side of `train.nonfinite`: `check(step, metrics)` after every step.

  Returns True when the caller must roll the model back to its last
  checkpoint (mode 'rollback'); raises NonFiniteError in mode 'stop' or after
  `max_rollbacks` rollbacks; does nothing (no device sync) in mode 'skip'.
  """

  def __init__(self, mode: str = "skip", max_rollbacks: int = 3):
    if mode not in MODES:
      raise ValueError(f"train.nonfinite={mode!r}: expected one of {MODES}")
    self.mode, self.max_rollbacks, self.rollbacks = mode, int(max_rollbacks), 0

  def check(self, step: int, metrics: dict) -> bool:
    if self.mode == "skip":
      return False
    flags = jax.device_get({k: metrics[k] for k in ("nonfinite_loss", "nonfinite_grad")})
    bad = [name for name, k in (("train_loss", "nonfinite_loss"), ("grad_norm", "nonfinite_grad"))
           if float(flags[k])]
    if not bad:
      return False
    what = f"non-finite {' and '.join(bad)} at step {step} (the update was skipped)"
    if self.mode == "stop":
      raise NonFiniteError(f"{what}; train.nonfinite='stop'")
    if self.rollbacks >= self.max_rollbacks:
      raise NonFiniteError(f"{what}; already rolled back {self.rollbacks} times "
                           f"(train.max_rollbacks={self.max_rollbacks})")
    self.rollbacks += 1
    logging.warning("%s; rolling back to the last checkpoint (%d/%d)", what, self.rollbacks,
                    self.max_rollbacks)
    return True


def rolled_back(current: TrainState, checkpointed: TrainState) -> TrainState:
  """The checkpointed model/optimizer/tables, with the current step and skip count.

  The step counter keeps going (the data position is not rewound either), and
  the counter of skipped steps keeps its current value.
  """
  *inner, _ = checkpointed.opt_state
  opt_state = type(checkpointed.opt_state)((*inner, current.opt_state[-1]))
  return checkpointed.replace(step=current.step, opt_state=opt_state)
