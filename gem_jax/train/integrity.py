"""Checkpoint integrity: checksum manifests, verified restore, finite-state guard.

Orbax makes a checkpoint *complete* atomically: it writes `STEP.orbax-checkpoint-tmp-*`
and renames it to `STEP` when every process has finished (on POSIX file
systems; a commit marker elsewhere). A run killed during an async save leaves
only the temporary directory, which is never listed. That covers crashes while
writing; it does not cover what happens to the files afterwards (a truncated
copy, a flipped bit, a half-deleted directory). For that, each complete
checkpoint is *sealed*: a manifest `STEP/integrity.json` is written after the
save has finished,

  {"files": {relative path: [size in bytes, crc32 (hex)]}, "step": STEP}

(written to a temporary name and renamed, so it is itself all-or-nothing), and
checked before restoring:

  newest complete step -> manifest present?  -- no -->  restore it (unverified)
       |
       yes -> sizes and crc32s match?  -- no --> corrupt: reported by path, moved
       |                                          to CHECKPOINTS_corrupt/, next older
       restore it

Only process 0 writes manifests and moves corrupt checkpoints; every process
verifies (they read the same files, so they agree) and waits for process 0
before restoring.

`check_finite` is the last line of defence against NaN in checkpoints: it is
called before every save and refuses to write a state with a non-finite leaf.
"""
from __future__ import annotations

import json
import os
import zlib
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

MANIFEST = "integrity.json"
_CHUNK = 1 << 22


class CorruptCheckpointError(RuntimeError):
  """A checkpoint whose files do not match its manifest."""


class NonFiniteStateError(FloatingPointError):
  """A state with NaN/Inf values that must not be checkpointed."""


# ------------------------------------------------------------------ files --

def complete_steps(directory: str) -> list[int]:
  """Steps with a finalized directory `directory/STEP` (temporaries excluded), ascending."""
  try:
    names = os.listdir(directory)
  except FileNotFoundError:
    return []
  return sorted(int(n) for n in names
                if n.isdigit() and os.path.isdir(os.path.join(directory, n)))


def file_digest(path: str) -> tuple[int, str]:
  """(size in bytes, crc32 as 8 hex digits) of one file, read in 4 MiB chunks."""
  crc, size = 0, 0
  with open(path, "rb") as f:
    while chunk := f.read(_CHUNK):
      crc = zlib.crc32(chunk, crc)
      size += len(chunk)
  return size, f"{crc:08x}"


def _files(step_dir: str) -> list[str]:
  out = []
  for root, _, names in os.walk(step_dir):
    for n in names:
      rel = os.path.relpath(os.path.join(root, n), step_dir)
      if rel != MANIFEST and not rel.startswith(MANIFEST + "."):
        out.append(rel)
  return sorted(out)


def write_manifest(step_dir: str) -> str:
  """Writes `step_dir/integrity.json` (atomically: temporary file + rename); returns its path."""
  files = {rel: list(file_digest(os.path.join(step_dir, rel))) for rel in _files(step_dir)}
  path = os.path.join(step_dir, MANIFEST)
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump({"step": os.path.basename(step_dir), "files": files}, f)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)
  return path


def verify(step_dir: str) -> bool | None:
  """True if `step_dir` matches its manifest, None if it has none (unsealed).

  Raises:
    CorruptCheckpointError: naming the first file that is missing, of another
      size, or of another checksum (or an unreadable manifest).
  """
  path = os.path.join(step_dir, MANIFEST)
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      files = _manifest_files(json.load(f))
  except (OSError, ValueError, KeyError) as e:
    raise CorruptCheckpointError(f"{path}: unreadable manifest ({e})") from None
  for rel, (size, crc) in files.items():
    full = os.path.join(step_dir, rel)
    if not os.path.isfile(full):
      raise CorruptCheckpointError(f"{full}: missing")
    got_size, got_crc = file_digest(full)
    if got_size != size:
      raise CorruptCheckpointError(f"{full}: {got_size} bytes, manifest says {size}")
    if got_crc != crc:
      raise CorruptCheckpointError(f"{full}: crc32 {got_crc}, manifest says {crc}")
  return True


def _manifest_files(m: Any) -> dict:
  """The 'files' of a parsed manifest; ValueError for anything else than the format above."""
  files = m.get("files") if isinstance(m, dict) else None
  if not isinstance(files, dict):
    raise ValueError("expected an object with a 'files' object")
  for rel, entry in files.items():
    if (os.path.isabs(rel) or os.path.normpath(rel) != rel or rel.split(os.sep)[0] == ".."):
      raise ValueError(f"file {rel!r} is not a path inside the checkpoint")
    if (not isinstance(entry, list) or len(entry) != 2 or type(entry[0]) is not int
        or not isinstance(entry[1], str)):
      raise ValueError(f"entry of {rel!r} is {entry!r}, expected [size, crc32]")
  return files


def seal(directory: str, exclude: Sequence[int] = ()) -> list[int]:
  """Writes manifests for the complete checkpoints newer than the newest sealed one.

  Call when no save is in flight for those steps (`exclude` the one being
  written). Older unsealed directories are left alone: one may be half deleted
  by the retention policy, and sealing it would bless it. Process 0 only.
  Returns the steps sealed.
  """
  if jax.process_index() != 0:
    return []
  steps = complete_steps(directory)
  sealed = [s for s in steps if os.path.exists(os.path.join(directory, str(s), MANIFEST))]
  newest_sealed = max(sealed, default=-1)
  done = []
  for s in steps:
    if s > newest_sealed and s not in exclude:
      try:
        write_manifest(os.path.join(directory, str(s)))
        done.append(s)
      except OSError as e:  # deleted under us by retention: nothing to seal
        logging.warning("could not seal checkpoint %s: %s", os.path.join(directory, str(s)), e)
  return done


def quarantine(directory: str, step: int) -> str:
  """Moves `directory/STEP` to `directory_corrupt/STEP[.n]` (kept for inspection); new path."""
  dest_root = directory.rstrip(os.sep) + "_corrupt"
  os.makedirs(dest_root, exist_ok=True)
  dest = os.path.join(dest_root, str(step))
  n = 0
  while os.path.exists(dest):
    n += 1
    dest = os.path.join(dest_root, f"{step}.{n}")
  os.replace(os.path.join(directory, str(step)), dest)
  return dest


def _sync(name: str) -> None:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    multihost_utils.sync_global_devices(name)


def restore_newest(directory: str, steps: Sequence[int], restore_fn: Callable[[int], Any],
                   reload_fn: Callable[[], None] = lambda: None) -> Any:
  """Restores the newest checkpoint among `steps` that verifies; None if none does.

  Each candidate, newest first: verified against its manifest; a mismatch is
  logged with the offending path, the directory moved aside (process 0) and
  the next older one tried. A checkpoint deleted by someone else (before or
  while it is read: the restore fails and its directory is gone, or its files no
  longer match the manifest) is reported the same way and the next older one
  tried. An unsealed checkpoint (killed between the rename and the manifest) is
  restored unverified; errors restoring it, or a sealed one whose files are
  intact, propagate (they may as well come from a changed state structure,
  which must not cost the run its checkpoints).

  Args:
    directory: the checkpoint directory (holds `STEP/` subdirectories).
    steps: candidate steps (e.g. the manager's `all_steps()`).
    restore_fn: step -> restored value (raises on unreadable data).
    reload_fn: called after a checkpoint was moved aside (refreshes the
      manager's view of the directory).
  """
  for step in sorted(steps, reverse=True):
    step_dir = os.path.join(directory, str(step))
    try:
      if not os.path.isdir(step_dir):
        raise _Vanished("deleted after it was listed")
      ok = verify(step_dir)
      if ok is None:
        logging.warning("checkpoint %s has no integrity manifest (killed right after it "
                        "was finalized?); restoring it unverified", step_dir)
      try:
        return restore_fn(step)
      except Exception as e:  # pylint: disable=broad-except
        if os.path.isdir(step_dir):
          if ok is None:
            raise              # unverifiable: maybe a changed state structure, not damage
          verify(step_dir)     # files gone or changed meanwhile: CorruptCheckpointError
          raise                # all there and intact: not damage
        raise _Vanished(f"deleted while being restored ({_first_line(e)})") from e
    except _Vanished as e:
      logging.error("checkpoint %s disappeared: %s (by another process?); falling back to "
                    "the previous one", step_dir, e)
      _sync(f"gem_jax_gone_{step}")
      reload_fn()
    except CorruptCheckpointError as e:
      logging.error("corrupt checkpoint: %s; falling back to the previous one", e)
      _sync(f"gem_jax_corrupt_{step}_a")
      if jax.process_index() == 0 and os.path.isdir(step_dir):
        logging.error("moved corrupt checkpoint %s to %s", step_dir, quarantine(directory, step))
      _sync(f"gem_jax_corrupt_{step}_b")
      reload_fn()
  if steps:
    logging.error("none of the checkpoints %s in %s could be restored", sorted(steps), directory)
  return None


class _Vanished(Exception):
  """A checkpoint directory that is no longer there."""


def _first_line(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0][:300] if text else ''}"


# ---------------------------------------------------------- finite state --

def _float_leaves(tree: Any) -> tuple[list[str], list[jax.Array]]:
  paths, leaves = [], []
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    dtype = getattr(x, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jnp.inexact):
      paths.append(jax.tree_util.keystr(path))
      leaves.append(x)
  return paths, leaves


@jax.jit
def _leaf_finite(leaves):
  return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])  # (n_leaves,)


def check_finite(tree: Any, what: str = "state") -> None:
  """Raises NonFiniteStateError naming the leaves of `tree` that hold NaN/Inf.

  One small jitted reduction over every floating leaf (a read of the state,
  at checkpoint cadence); integer leaves (step, RNG key data) are skipped.
  """
  paths, leaves = _float_leaves(tree)
  if not leaves:
    return
  finite = np.asarray(jax.device_get(_leaf_finite(leaves)))
  bad = [p for p, ok in zip(paths, finite) if not ok]
  if bad:
    raise NonFiniteStateError(f"refusing to checkpoint a {what} with non-finite values in "
                              f"{len(bad)} leaves: {', '.join(bad[:5])}")
