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

Failed saves (disk full, read-only directory, any write error): the failure of an
async save surfaces when the next save (or `wait`) collects it. It is logged as
`checkpoint save failed at step N: PATH: No space left on device (ENOSPC)`, the
partial temporary directory is removed, the manager re-reads the directory (the
retention deletions planned for that save never happened: every committed
checkpoint stays) and training goes on. `max_save_failures` failures in a row are
tolerated; the next one raises `CheckpointSaveError`, and so does `close()` when the
last save failed (the newest state is not on disk). A success resets the count.

A save still being written when the next one is due: `busy='wait'` (default) lets
the new save wait for it, so a step that saves blocks at most for the rest of the
previous save (plus its own copy off the devices) and saves never pile up;
`busy='skip'` skips a due periodic save instead (with a message); forced saves
always wait. Steps that do not save never wait.

Restoring onto another mesh: `restore(abstract_state)` takes a pytree of
`jax.ShapeDtypeStruct(shape, dtype, sharding=...)` built for the *current*
mesh; each array is read as its global value and laid out in the given
sharding, whatever mesh wrote it. (Embedding tables and slots are stored as
unpadded global arrays by the embedding engine, so this holds for them too.)
"""
from __future__ import annotations

import errno
import glob
import math
import os
import re
import shutil
import time
from typing import Any, Mapping, NamedTuple

import jax
import orbax.checkpoint as ocp
from absl import logging
from orbax.checkpoint import checkpoint_managers as ocm

from gem_jax import hostmem
from gem_jax.train import integrity
from gem_jax.train import tensorstore_leaks
from gem_jax.train import metrics as metrics_lib

_ITEMS = ("state", "data", "config")
TMP_MARK = ".orbax-checkpoint-tmp"   # Orbax's unfinished step directories: STEP<TMP_MARK>*
BUSY_MODES = ("wait", "skip")


class CheckpointSaveError(RuntimeError):
  """Checkpoint saves keep failing (more than `max_save_failures` in a row), or the last did."""


_TS_PATH = re.compile(
    r'(?:Failed writing|Error opening|Failed to open|Error writing)[^"]*"([^"]+)"')
_TS_ERRNO = re.compile(r"os_error_code='?(\d+)")


def _exceptions(e: BaseException):
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    yield e
    e = e.__cause__ or e.__context__


def storage_error(e: BaseException, where: str = "") -> str | None:
  """'PATH: strerror (ENAME)' when `e` (or its cause) is a file-system error, else None.

  Understands OSError and the tensorstore errors Orbax raises for array writes
  (`... "PATH" ...: No space left on device [os_error_code='28']`).
  """
  for x in _exceptions(e):
    if isinstance(x, OSError) and x.errno:
      name = errno.errorcode.get(x.errno, str(x.errno))
      return f"{x.filename or where}: {os.strerror(x.errno)} ({name})"
    text = str(x)
    code = _TS_ERRNO.search(text)
    if code:
      path = _TS_PATH.search(text)
      n = int(code.group(1))
      return (f"{path.group(1) if path else where}: {os.strerror(n)} "
              f"({errno.errorcode.get(n, n)})")
  return None


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
    max_save_failures: failed saves in a row that are logged and survived; one
      more raises CheckpointSaveError (0: the first failure raises).
    busy: a periodic save due while the previous one is still being written:
      'wait' for it, or 'skip' this one (forced saves always wait; one process
      only: with several, 'wait').

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
               async_save: bool = True, max_save_failures: int = 3, busy: str = "wait"):
    if keep < 1:
      raise ValueError(f"keep must be >= 1, got {keep}")
    if busy not in BUSY_MODES:
      raise ValueError(f"busy must be one of {BUSY_MODES}, got {busy!r}")
    if max_save_failures < 0:
      raise ValueError(f"max_save_failures must be >= 0, got {max_save_failures}")
    if busy == "skip" and jax.process_count() > 1:   # the decision would differ per process
      logging.warning("checkpoint busy='skip' needs one process; waiting instead")
      busy = "wait"
    self.max_save_failures, self.busy, self._async = int(max_save_failures), busy, async_save
    self.failures = 0                   # failed saves in a row
    self.last_error: str | None = None  # message of the last failed save
    self.last_wait_s = 0.0              # how long the last save waited for the previous one
    self._in_flight: int | None = None  # step of the async save not yet collected
    self._last_failed = False
    self._closed = False
    self._failed_steps: set[int] = set()   # their partial directories are removed
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
        # The step directory is made inside `save`: a read-only or full directory fails
        # there, not in writes left waiting (minutes) for a directory that never came.
        async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
        create=True,
    )
    tensorstore_leaks.install()
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
    if self._in_flight is not None and self._manager.is_saving_in_progress():
      if self.busy == "skip" and not force:
        logging.warning("checkpoint at step %d skipped: the save of step %d is still being "
                        "written (busy='skip')", step, self._in_flight)
        return False
    t0 = time.perf_counter()
    prev = self._in_flight
    self._collect()     # waits for the previous save; a failure is handled (or raises) here
    self.last_wait_s = time.perf_counter() - t0
    if prev is not None and self.last_wait_s > 1.0:
      logging.warning("checkpoint at step %d waited %.1f s for the save of step %d to finish "
                      "(saves take longer than the steps between them)", step,
                      self.last_wait_s, prev)
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave({"data": data_state}),
        config=ocp.args.JsonSave({"config": _to_json(config)}),
    )
    try:
      saved = bool(self._manager.save(step, args=args, metrics=tracked, force=True))
    except Exception as e:  # pylint: disable=broad-except
      self._failed(step, e)   # raises unless a tolerated storage error
      return False
    self._in_flight = step if saved else None
    integrity.seal(self.directory, exclude=(step,))  # manifests of the finished saves
    if not saved or not self._async:
      self._collect()
    return saved

  def _collect(self) -> None:
    """Waits for the save in flight; a failed one is reported (see `_failed`)."""
    step, self._in_flight = self._in_flight, None
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      self._failed(-1 if step is None else step, e)
      return
    if step is not None:
      self.failures, self._last_failed = 0, False
      hostmem.release_free_heap()  # the save's host copies are freed: give the pages back
    self._remove_partials()

  def _failed(self, step: int, e: BaseException) -> None:
    """A save of `step` failed: log, remove its temporary directory, re-read the directory.

    Raises CheckpointSaveError after more than `max_save_failures` in a row, and
    re-raises `e` itself when it is not a file-system error (a bug, not the disk).
    """
    where = os.path.join(self.directory, f"{step}{TMP_MARK}")
    reason = storage_error(e, where)
    if reason is None:
      raise e
    self.failures += 1
    self._last_failed = True
    self.last_error = f"checkpoint save failed at step {step}: {reason}"
    self._drain()
    if step >= 0:
      self._failed_steps.add(step)
    removed = self._remove_partials()
    try:
      self._manager.reload()
    except Exception as err:  # pylint: disable=broad-except
      logging.warning("could not re-read %s after the failed save: %s", self.directory, err)
    committed = self.all_steps()
    logging.error("%s; %s; committed checkpoints %s untouched; %d failed save(s) in a row, "
                  "%d tolerated", self.last_error,
                  f"removed {removed}" if removed else "no partial directory left",
                  committed, self.failures, self.max_save_failures)
    if self.failures > self.max_save_failures:
      raise CheckpointSaveError(
          f"{self.last_error}; {self.failures} checkpoint saves in a row failed "
          f"({self.max_save_failures} tolerated: train.save_failures); newest committed "
          f"checkpoint: {committed[-1] if committed else 'none'} in {self.directory}") from e

  def _drain(self, attempts: int = 16) -> None:
    """Collects the other errors of a failed save (each of its writes may fail, and Orbax
    raises them one at a time), so that none is blamed on the next save.

    Orbax's finalize thread can fail (on the write of the step's metadata) while the
    checkpointer's commit thread still runs; `CheckpointManager.check_for_errors` does not
    wait for that thread, only its next `save` does, which would then raise this save's
    error as its own. So the checkpointer itself is waited for too, and each of the save's
    writes (the commit thread stops at the first failed one while the others still run).
    Some write still recreates the temporary directory after its removal now and then
    (not located); `_remove_partials` at the next save, `wait` and `close` handles that.
    """
    checkpointer = getattr(self._manager, "_checkpointer", None)
    waits = [self._manager.wait_until_finished, self._manager.check_for_errors]
    if hasattr(checkpointer, "wait_until_finished"):
      waits.append(checkpointer.wait_until_finished)
    writes = getattr(getattr(checkpointer, "_async_manager", None), "_commit_futures", None)
    for write in writes or ():
      try:
        write.result()
      except Exception:  # pylint: disable=broad-except
        pass
    for _ in range(attempts):
      try:
        for wait in waits:
          wait()
        return
      except Exception:  # pylint: disable=broad-except
        continue

  def _remove_partials(self) -> list[str]:
    """Removes what failed saves left (process 0); the paths removed.

    Writes of a failed save that were still running may recreate its temporary
    directory after it was removed: every later save, `wait` and `close` look again.
    """
    if jax.process_index() != 0:
      return []
    out = []
    for step in sorted(self._failed_steps):
      for path in glob.glob(os.path.join(self.directory, f"{step}{TMP_MARK}*")):
        try:
          shutil.rmtree(path)
          out.append(path)
        except OSError as err:
          logging.warning("could not remove the partial checkpoint %s: %s", path, err)
    return out

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
    """Blocks until pending asynchronous saves are complete on disk (and sealed).

    A failed save is reported as in `save` (CheckpointSaveError past the tolerance).
    """
    self._collect()
    integrity.seal(self.directory)

  @property
  def last_save_failed(self) -> bool:
    """Whether the most recent save (collected by `wait`) failed."""
    return self._last_failed

  def close(self, check: bool = True) -> None:
    """Waits for pending saves and releases the manager's resources.

    Raises CheckpointSaveError when the last save failed (the newest state is not
    on disk), unless `check` is False (it is then only logged). A second call does
    nothing.
    """
    if self._closed:
      return
    try:
      self.wait()
    finally:
      self._closed = True
      self._manager.close()
      self._remove_partials()   # every write has ended now
    if self._last_failed:
      msg = (f"the last checkpoint save failed ({self.last_error}); newest committed "
             f"checkpoint: {self.latest_step()} in {self.directory}")
      if check:
        raise CheckpointSaveError(msg)
      logging.error("%s", msg)

  def __enter__(self) -> "CheckpointManager":
    return self

  def __exit__(self, exc_type, *exc) -> None:
    self.close(check=exc_type is None)


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
