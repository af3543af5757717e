"""Non-finite losses and gradients: detected inside the jitted step, handled by policy.

Inside the step (`train_step(..., skip_nonfinite=True)`, the one guard, for the
trainer and the transfer student alike):

  bad_loss, bad_grad = flags(loss, ||g_dense||)            (one scalar each)
  ok     = !(bad_loss | bad_grad)
  state' = ok ? new : state (params, optimizer moments: `keep_if`, a select;
           tables and slots: the sparse update is disabled, no copy), with
           step + 1, the RNG advanced and skipped += !ok (`count_skipped`)

so a bad batch never changes the model (optax's own update count, which drives
the dense lr schedule, stays behind `state.step` by the skipped steps). `skipped`
lives in the optimizer state (`SkipCountState`, added by `with_skip_counter`,
checkpointed with it; found by its type, wherever it sits in the chain; an
optimizer without it skips without counting), and the step's metrics carry
`nonfinite_loss` / `nonfinite_grad` (0/1) and the losses/grad norm with a bad
value replaced by 0 (`flagged_metrics`: the logged means stay finite; a window
with skipped steps under-reports the mean loss by that share).

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

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from absl import logging

from gem_jax.train.state import TrainState

MODES = ("skip", "rollback", "stop")


class NonFiniteError(FloatingPointError):
  """A non-finite loss or gradient under `train.nonfinite='stop'` (or too many rollbacks)."""


class SkipCountState(NamedTuple):
  """Steps whose update was skipped because of a non-finite loss or gradient."""
  skipped: jax.Array  # int32 ()


def with_skip_counter(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """`tx` whose state also holds the skipped-steps counter (a `SkipCountState`)."""
  counter = optax.GradientTransformation(
      lambda _: SkipCountState(jnp.zeros((), jnp.int32)),
      lambda updates, state, params=None: (updates, state))
  return optax.chain(tx, counter)


def _is_counter(x) -> bool:
  return isinstance(x, SkipCountState)


def _counters(opt_state) -> list:
  return [x for x in jax.tree.leaves(opt_state, is_leaf=_is_counter) if _is_counter(x)]


def _replace_counter(opt_state, fn):
  """`opt_state` with every SkipCountState c replaced by fn(c) (found by type)."""
  return jax.tree.map(lambda x: fn(x) if _is_counter(x) else x, opt_state, is_leaf=_is_counter)


def skipped_steps(state: TrainState) -> int:
  """The skipped-steps counter of a state whose optimizer was built with `with_skip_counter`."""
  found = _counters(state.opt_state)
  if len(found) != 1:
    raise ValueError(f"expected one SkipCountState in the optimizer state, found {len(found)} "
                     "(build the optimizer with nonfinite.with_skip_counter)")
  return int(jax.device_get(found[0].skipped))


def flags(loss: jax.Array, grad_norm: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(bad_loss, bad_grad): traced bools, True where the value is not finite."""
  return ~jnp.isfinite(loss), ~jnp.isfinite(grad_norm)


def keep_if(ok: jax.Array, new, old):
  """`new` where `ok` (a traced bool), else `old` (a select per leaf)."""
  return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def count_skipped(opt_state, skipped: jax.Array):
  """`opt_state` with its skip counter (if any) advanced by `skipped` (a traced bool)."""
  return _replace_counter(opt_state, lambda c: SkipCountState(
      c.skipped + skipped.astype(jnp.int32)))


def flagged_metrics(metrics: dict, bad_loss: jax.Array, bad_grad: jax.Array) -> dict:
  """The step's metrics with the 0/1 flags added and non-finite losses / grad norm set to 0."""
  out = dict(metrics)
  for k, v in metrics.items():
    if k == "train_loss" or k.startswith("loss_"):
      out[k] = jnp.where(jnp.isfinite(v), v, 0.0)
  out["grad_norm"] = jnp.where(bad_grad, 0.0, metrics["grad_norm"])
  out["nonfinite_loss"] = bad_loss.astype(jnp.float32)
  out["nonfinite_grad"] = bad_grad.astype(jnp.float32)
  return out


def inject_nan(batch: dict, hit: jax.Array) -> dict:
  """Debug hook: the batch's dense features become NaN where `hit` (a traced bool)."""
  dense = batch["dense"]
  return dict(batch, dense=jnp.where(hit, jnp.full_like(dense, jnp.nan), dense))


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
  now = _counters(current.opt_state)
  opt_state = (_replace_counter(checkpointed.opt_state, lambda _: now[0]) if len(now) == 1
               else checkpointed.opt_state)
  return checkpointed.replace(step=current.step, opt_state=opt_state)
