"""Keeps two reference leaks of tensorstore's Python binding out of Orbax's save path.

In tensorstore (0.1.86 at least), two calls leak the Python objects they return. They
are never freed and no Python object refers to them (docs/RELIABILITY.md, the soak):

  call (Orbax's caller)                                  leaked per call
  KvStore.Spec(spec).to_json()                           ~4 blocks (spec's keys and values)
    (_build_ocdbt_kvstore_tspec: every array, every save)
  experimental_collect_matching_metrics('/tensorstore/kvstore/')   ~70 blocks once a
    (get_tensorstore_raw_bytes: 2 per save, only for an   file kvstore has metrics
     info-level "raw throughput" log line)

With a train state of a few hundred arrays, saving every few minutes, a run's host memory
grows by tens of MB per hour. `install()` changes Orbax in two places (idempotent; a
missing hook in another Orbax version is skipped):

* The OCDBT kvstore spec of an array is the spec of its item directory with `path` set to
  the array's name. The directory's spec is built once per (directory, options) (the last
  64 kept), and copied for each array. `test_checkpoint.py` checks the copies against
  Orbax's own specs.
* The raw byte count reads 0, so Orbax skips its raw-throughput log line. The logical
  throughput line, which needs no tensorstore metrics, stays.
"""
from __future__ import annotations

import collections
import copy

from orbax.checkpoint._src.serialization import tensorstore_utils as _ts_utils


def shared_kvstore_specs(build, capacity: int = 64):
  """`build(directory, name, **options)`, resolved once per (directory, options)."""
  cache: collections.OrderedDict = collections.OrderedDict()

  def shared(directory, name=None, **options):
    try:
      key = (directory, tuple(sorted(options.items())))
      hash(key)
    except TypeError:                       # options we cannot key on: Orbax's own path
      return build(directory, name, **options)
    if key in cache:
      cache.move_to_end(key)
    else:
      cache[key] = build(directory, None, **options)
      if len(cache) > capacity:
        cache.popitem(last=False)
    spec = copy.deepcopy(cache[key])
    if name is not None:
      spec["path"] = name
    return spec

  shared.wrapped = build
  return shared


def _no_raw_bytes(direction=None) -> int:
  del direction
  return 0


def install() -> None:
  """Applies both changes to Orbax (once; a no-op for hooks this Orbax lacks)."""
  build = getattr(_ts_utils, "_build_ocdbt_kvstore_tspec", None)
  if build is not None and not hasattr(build, "wrapped"):
    _ts_utils._build_ocdbt_kvstore_tspec = shared_kvstore_specs(build)
  if hasattr(_ts_utils, "get_tensorstore_raw_bytes"):
    _ts_utils.get_tensorstore_raw_bytes = _no_raw_bytes
