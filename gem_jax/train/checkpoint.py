"""Checkpoints of a training run: an Orbax `CheckpointManager` with our retention rules.

One checkpoint (directory `WORKDIR/checkpoints/STEP/`) holds three items:

  state   the train-state pytree (step, params, optimizer state, tables and
          sparse slots, RNG keys, metric accumulators) as sharded jax arrays
  data    the data iterator state(s): any JSON-serialisable value
  config  the run config as JSON (a ConfigDict is converted with `to_dict()`)

Saving is asynchronous: `save` returns once the arrays are copied off the
devices, and Orbax finishes the write in the background. Orbax writes into a
temporary directory and renames it when every process has finished, so only
complete checkpoints are ever listed or restored; a crash mid-write leaves a
temporary directory that is ignored (and cleaned up by the next manager).

Retention: the last `keep` checkpoints, plus the best one by `best_metric`
(among checkpoints saved with that metric), everything else is deleted. Whether
larger or smaller is better follows from the metric's name
(`metrics.metric_mode`: AUC max, log loss / NE / loss min) unless `best_mode` says.

Restoring onto another mesh: `restore(abstract_state)` takes a pytree of
`jax.ShapeDtypeStruct(shape, dtype, sharding=...)` built for the *current*
mesh; each array is read as its global value and laid out in the given
sharding, whatever mesh wrote it. (Embedding tables and slots are stored as
unpadded global arrays by the embedding engine, so this holds for them too.)
"""
from __future__ import annotations

import math
import os
from typing import Any, Mapping, NamedTuple

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as ocm

from gem_jax.train import integrity
from gem_jax.train import metrics as metrics_lib

_ITEMS = ("state", "data", "config")


class Restored(NamedTuple):
  """What `CheckpointManager.restore` returns."""
  step: int
  state: Any
  data_state: Any
  config: dict | None


def _to_json(config: Any) -> Any:
  if config is None:
    return None
  if hasattr(config, "to_dict"):
    config = config.to_dict()
  return config


class CheckpointManager:
  """Saves every `save_every` steps (and on `force=True`), keeps the last `keep` + the best.

  Args:
    directory: where step directories are written (created if needed).
    save_every: save when `step % save_every == 0` (0 or None: only forced saves).
    keep: number of most recent checkpoints kept.
    best_metric: name of the metric (passed to `save(metrics=...)`) whose best
      checkpoint is kept in addition; None keeps only the last `keep`.
    best_mode: 'max' (e.g. AUC) or 'min' (e.g. loss); None: from the metric's name
      (`metrics.metric_mode`; ValueError for a metric without a direction).
    async_save: write in a background thread (`wait()` blocks until done).

  Example::

    ckpt = CheckpointManager(workdir + '/checkpoints', save_every=1000, keep=3,
                             best_metric='eval_auc')
    restored = ckpt.restore(abstract_state)          # None on a fresh start
    ...
    ckpt.save(step, state, data_state=it.state(), config=config,
              metrics={'eval_auc': auc})             # no-op unless step is due
    ckpt.save(last_step, state, ..., force=True)
    ckpt.close()
  """

  def __init__(self, directory: str, *, save_every: int | None = 1000, keep: int = 3,
               best_metric: str | None = None, best_mode: str | None = None,
               async_save: bool = True):
    if keep < 1:
      raise ValueError(f"keep must be >= 1, got {keep}")
    if best_mode is None:
      best_mode = metrics_lib.metric_mode(best_metric) if best_metric else "max"
    if best_mode not in ("max", "min"):
      raise ValueError(f"best_mode must be 'max' or 'min', got {best_mode!r}")
    self.directory = os.path.abspath(os.fspath(directory))
    self.best_metric = best_metric
    self.best_mode = best_mode
    policies: list = [ocm.LatestN(n=keep)]
    best_fn = None
    if best_metric is not None:
      best_fn = lambda m: float(m[best_metric])  # noqa: E731
      policies.append(ocm.BestN(get_metric_fn=best_fn, reverse=best_mode == "min", n=1,
                                keep_checkpoints_without_metrics=False))
    save_policy = (ocm.FixedIntervalPolicy(int(save_every)) if save_every
                   else ocm.SpecificStepsPolicy(steps=()))
    options = ocp.CheckpointManagerOptions(
        save_decision_policy=save_policy,
        preservation_policy=ocm.AnyPreservationPolicy(policies),
        best_fn=best_fn,
        best_mode=best_mode,
        enable_async_checkpointing=async_save,
        create=True,
    )
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_names=_ITEMS)

  def all_steps(self) -> list[int]:
    """Steps of the complete checkpoints on disk, ascending."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def best_step(self) -> int | None:
    """Step of the best checkpoint by `best_metric` (the latest if there is no metric)."""
    return self._manager.best_step()

  def metrics(self, step: int) -> dict | None:
    """The metrics saved with checkpoint `step` (None if it has none)."""
    return self._manager.metrics(step)

  def should_save(self, step: int) -> bool:
    """Whether `save(step, ...)` without `force` would write a checkpoint."""
    return step not in self._manager.all_steps() and self._manager.should_save(step)

  def save(self, step: int, state: Any, *, data_state: Any = None, config: Any = None,
           metrics: Mapping[str, float] | None = None, force: bool = False) -> bool:
    """Starts saving checkpoint `step` if it is due (or `force`); returns whether it did.

    A step that is already on disk is never rewritten (so a final forced save
    right after a periodic one is a no-op). Must be called by every process.

    Args:
      step: the training step the state is at.
      state: the train-state pytree (jax arrays, any sharding).
      data_state: JSON-serialisable data iterator state(s).
      config: the run config (ConfigDict or JSON-serialisable mapping).
      metrics: scalar metrics; `best_metric` among them makes this checkpoint a
        candidate for "best" (non-finite values are ignored).
      force: save even if `step` is not a multiple of `save_every`.
    """
    step = int(step)
    if step in self._manager.all_steps():
      return False
    if not force and not self._manager.should_save(step):
      return False
    tracked = None
    if metrics is not None and self.best_metric is not None:
      value = metrics.get(self.best_metric)
      if value is not None and math.isfinite(float(value)):
        tracked = {k: float(v) for k, v in metrics.items()
                   if isinstance(v, (int, float)) or hasattr(v, "__float__")}
    integrity.check_finite(state)  # no NaN/Inf ever reaches a checkpoint
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave({"data": data_state}),
        config=ocp.args.JsonSave({"config": _to_json(config)}),
    )
    saved = bool(self._manager.save(step, args=args, metrics=tracked, force=True))
    integrity.seal(self.directory, exclude=(step,))  # manifests of the finished saves
    return saved

  def restore(self, abstract_state: Any, step: int | None = None) -> Restored | None:
    """Restores checkpoint `step` (default: the latest); None if there is none.

    Args:
      abstract_state: pytree matching the saved state, of
        `jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))`
        (e.g. `jax.eval_shape(init)` with shardings attached) for the mesh the
        arrays should land on; it may differ from the mesh that saved them.
      step: a step from `all_steps()`, or None for the latest that passes its
        integrity check (`gem_jax.train.integrity`; corrupt ones are moved aside).
    """
    self.wait()
    if step is None:
      return integrity.restore_newest(self.directory, self.all_steps(),
                                      lambda s: self.restore(abstract_state, step=s),
                                      self._manager.reload)
    if step not in self._manager.all_steps():
      raise FileNotFoundError(f"no complete checkpoint for step {step} in {self.directory}; "
                              f"available: {self.all_steps()}")
    out = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=ocp.args.JsonRestore(),
        config=ocp.args.JsonRestore(),
    ))
    return Restored(step=int(step), state=out["state"], data_state=out["data"]["data"],
                    config=out["config"]["config"])

  def wait(self) -> None:
    """Blocks until pending asynchronous saves are complete on disk (and sealed)."""
    self._manager.wait_until_finished()
    integrity.seal(self.directory)

  def close(self) -> None:
    """Waits for pending saves and releases the manager's resources."""
    self.wait()
    self._manager.close()

  def __enter__(self) -> "CheckpointManager":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def abstract_like(tree: Any, shardings: Any = None) -> Any:
  """`jax.ShapeDtypeStruct`s of `tree`'s arrays, with `shardings` (a matching pytree) if given.

  Handy for tests and for restoring a state that exists with another layout:
  `restore(abstract_like(state, new_shardings))`.
  """
  if shardings is None:
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        tree)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)
