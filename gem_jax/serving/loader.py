"""Loads a serving artifact (scripts/export.py) and scores raw feature batches with it.

  predict = gem_jax.serving.load("artifacts/criteo")
  probs = predict({"dense": (B, 13) float32, "ids": {"C1": (B, 1) raw ids, ...}})  # (B, T)

Needs jax and numpy only: the scoring function is the serialized `jax.export` module,
the arrays are .npy files, and the id policy is gem_jax.embedding.ids (numpy). No model
class, config, checkpoint or data reader is imported.

Batch fields (the batch contract of gem_jax/data/spec.py, B rows, any B):
  dense    float (B, n_dense)                           required when n_dense > 0
  ids      {feature: int (B, bag)} raw ids, < 0 = none  required, every feature
  weights  {feature: float (B, bag)}                    optional (default 1)
  seq      {stream: {len (B,), action, surface, dt (B, L)}}  required for each stream
  domain   int (B,)                                     optional when there is one domain
Labels are not read. A missing or misshaped field, a non-finite dense value, weight or
dt, or a domain, action, surface or length outside its range is a ValueError naming the
field (a model would read a clamped or NaN row instead). Ids go through each table's id policy first (manifest 'tables'):
'hash' maps every id, seen in training or not, to splitmix64(id) mod rows; 'clip' maps
ids >= rows to the last row; 'error' raises ValueError naming the feature and the id.
A batch is scored by the exported function of a symbolic batch size in one call, or
cut into the exported sizes (the last piece padded; padding rows never come back).

Loading never runs code from the artifact: the manifest is JSON, checked field by field
(`check_manifest`: unknown fields, wrong types, a file outside the artifact are a
ValueError naming the field); arrays are read with `allow_pickle=False` (an object
array is refused, not unpickled); the scoring function is StableHLO, and one calling
a custom call outside JAX's stable set (a host callback, say) is refused.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from gem_jax.embedding import managed
from gem_jax.embedding.ids import apply_id_policy

FORMAT = "gem_jax.serving"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


def read_manifest(path: str) -> dict:
  """The manifest of the artifact at `path`; ValueError for another format, a newer one,
  or content that is not what an export writes (`check_manifest`)."""
  file = os.path.join(path, MANIFEST)
  if not os.path.isfile(file):
    raise FileNotFoundError(f"{path}: no {MANIFEST} (not a serving artifact, or its export "
                            "did not finish)")
  try:
    with open(file, encoding="utf-8") as f:
      m = json.load(f)
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"{file}: not a JSON manifest ({e})") from None
  if not isinstance(m, dict):
    raise ValueError(f"{file}: expected a JSON object, got {type(m).__name__}")
  if m.get("format") != FORMAT:
    raise ValueError(f"{file}: format {m.get('format')!r}, expected {FORMAT!r}")
  v = m.get("format_version")
  if not isinstance(v, int) or v > FORMAT_VERSION:
    raise ValueError(f"{file}: artifact format version {v!r} is newer than this loader's "
                     f"{FORMAT_VERSION}: load it with the gem_jax that exported it (or newer)")
  check_manifest(m, path)
  return m


_FIELDS = {"format": str, "format_version": int, "jax_version": str, "platforms": list,
           "checkpoint_step": (int, type(None)), "model": (dict, type(None)), "spec": dict,
           "features": dict, "tables": dict, "table_dtype": str, "inputs": list,
           "outputs": list, "functions": dict, "batch_sizes": (str, list), "params": str}
_REQUIRED = ("spec", "features", "tables", "inputs", "functions", "params")
_POLICIES = ("hash", "clip", "error", "managed")
_TABLE_DTYPES = ("float32", "bfloat16", "int8")


def _member(path: str, rel: Any, field: str) -> str:
  """`path/rel` for a file name that stays inside the artifact; ValueError naming `field`."""
  if (not isinstance(rel, str) or not rel or "\0" in rel or os.path.isabs(rel)
      or os.path.normpath(rel).split(os.sep)[0] == ".."):
    raise ValueError(f"{path}/{MANIFEST}: {field} = {rel!r} is not a file inside the artifact")
  full = os.path.join(path, rel)
  root = os.path.realpath(path)
  if os.path.commonpath([root, os.path.realpath(full)]) != root:
    raise ValueError(f"{path}/{MANIFEST}: {field} = {rel!r} leads outside the artifact")
  if not os.path.isfile(full):
    raise ValueError(f"{path}/{MANIFEST}: {field} = {rel!r}: no such file in the artifact")
  return full


def check_manifest(m: dict, path: str) -> None:
  """Raises ValueError naming the first field of `m` that an export would not write."""
  where = f"{path}/{MANIFEST}"
  unknown = sorted(set(m) - set(_FIELDS))
  if unknown:
    raise ValueError(f"{where}: unexpected field(s) {unknown}")
  for k in _REQUIRED:
    if k not in m:
      raise ValueError(f"{where}: field {k!r} is missing")
  for k, t in _FIELDS.items():
    if k in m and not isinstance(m[k], t):
      raise ValueError(f"{where}: field {k!r} has type {type(m[k]).__name__}")
  _member(path, m["params"], "params")
  if not m["functions"]:
    raise ValueError(f"{where}: 'functions' is empty")
  for size, file in m["functions"].items():
    if size != "b" and not (isinstance(size, str) and size.isdigit() and int(size) > 0):
      raise ValueError(f"{where}: functions key {size!r} is neither 'b' nor a batch size")
    _member(path, file, f"functions[{size!r}]")
  for name, t in m["tables"].items():
    f = f"tables[{name!r}]"
    if not isinstance(t, dict) or not isinstance(t.get("files"), dict):
      raise ValueError(f"{where}: {f} must be an object with 'files'")
    if t.get("dtype") not in _TABLE_DTYPES or t.get("id_policy") not in _POLICIES:
      raise ValueError(f"{where}: {f}: dtype {t.get('dtype')!r} / id_policy "
                       f"{t.get('id_policy')!r} not among {_TABLE_DTYPES} / {_POLICIES}")
    if type(t.get("rows")) is not int or t["rows"] < 1:
      raise ValueError(f"{where}: {f}: rows {t.get('rows')!r} is not a positive integer")
    for leaf, file in t["files"].items():
      _member(path, file, f"{f}.files[{leaf!r}]")
    if "map" in t:
      _member(path, t["map"], f"{f}.map")
  for name, feat in m["features"].items():
    if not isinstance(feat, dict) or feat.get("table") not in m["tables"]:
      raise ValueError(f"{where}: features[{name!r}] names no table of 'tables'")
  for leaf in m["inputs"]:
    ok = (isinstance(leaf, dict) and isinstance(leaf.get("path"), str)
          and isinstance(leaf.get("shape"), list) and isinstance(leaf.get("dtype"), str))
    try:
      ok = ok and np.dtype(leaf["dtype"]).kind in "biuf"
    except TypeError:
      ok = False
    if not ok:
      raise ValueError(f"{where}: inputs entry {str(leaf)[:80]} is not {{path, shape, "
                       "numeric dtype}")


def _np_load(path: str, **kw) -> Any:
  """np.load without pickles: an object array is a clear ValueError, never unpickled."""
  try:
    return np.load(path, allow_pickle=False, **kw)
  except ValueError as e:
    raise ValueError(f"{path}: not a plain numeric array file ({e}); artifacts hold no "
                     "pickled objects") from None


def _load_array(path: str, dtype: str) -> np.ndarray:
  x = _np_load(path, mmap_mode="r")
  return x.view(jnp.bfloat16) if dtype == "bfloat16" else x   # stored as uint16 bits


_CUSTOM_CALL = re.compile(r'stablehlo\.custom_call\s+@([\w.$-]+)|call_target_name\s*=\s*"([^"]+)"')


def _stable_targets() -> set[str] | None:
  try:
    from jax._src.export import _export  # pylint: disable=import-outside-toplevel
    return set(_export._CUSTOM_CALL_TARGETS_GUARANTEED_STABLE)  # pylint: disable=protected-access
  except (ImportError, AttributeError):
    return None


def check_function(exported, file: str) -> None:
  """ValueError when the exported module calls a custom call JAX does not guarantee
  (host callbacks into this process among them)."""
  stable = _stable_targets()
  for target in {a or b for a, b in _CUSTOM_CALL.findall(exported.mlir_module())}:
    if re.search(r"callback|python", target, re.I) or (stable is not None
                                                        and target not in stable):
      raise ValueError(f"{file}: the scoring function calls custom call {target!r}, which "
                       "a gem_jax export never contains; refusing to load it")


def padding(inputs: list[dict], n: int) -> dict:
  """n padding rows of the exported input signature (ids -1, everything else 0)."""
  out: dict = {}
  for leaf in inputs:
    d = out
    *parents, name = leaf["path"].split("/")
    for p in parents:
      d = d.setdefault(p, {})
    fill = -1 if parents and parents[0] == "ids" else 0
    d[name] = np.full((n, *leaf["shape"][1:]), fill, leaf["dtype"])
  return out


class Predictor:
  """`predict(batch) -> probs (B, T)` of a loaded artifact; `outputs(batch)` -> every output
  ('probs', 'logits' (B, T), and 'trunk' (B, H) when exported)."""

  def __init__(self, path: str, manifest: dict, fns: dict, params: dict, tables: dict,
               maps: dict | None = None):
    self.path, self.manifest = path, manifest
    self._maps = maps or {}   # managed tables: `managed.host_map` lookups
    self.tasks = tuple(manifest["spec"]["tasks"])
    self._fns, self._params, self._tables = fns, params, tables
    self._sizes = sorted(k for k in fns if k is not None)

  def __call__(self, batch: Mapping[str, Any]) -> np.ndarray:
    return self.outputs(batch)["probs"]

  def prepare(self, batch: Mapping[str, Any]) -> dict:
    """The exported function's inputs of `batch`: checked (ValueError naming the field),
    ids through the id policy, defaults filled."""
    m = self.manifest
    b = _rows(batch)
    out = padding(m["inputs"], b)
    if m["spec"]["n_dense"]:
      out["dense"] = _finite(_field(batch, ("dense",), out["dense"].shape, np.float32), "dense")
    for name, f in m["features"].items():
      t = m["tables"][f["table"]]
      raw = np.asarray(_field(batch, ("ids", name), out["ids"][name].shape, None))
      if not np.issubdtype(raw.dtype, np.integer):
        raise ValueError(f"batch field 'ids/{name}': ids must be integers, got {raw.dtype}")
      if t["id_policy"] == "managed":   # through the training map
        out["ids"][name] = managed.host_rows(raw, self._maps[f["table"]], name, f["table"])
      else:
        out["ids"][name] = apply_id_policy(raw, t["rows"], t["id_policy"], name, f["table"])
      w = (batch.get("weights") or {}).get(name)
      out["weights"][name] = (np.ones(raw.shape, np.float32) if w is None else _finite(
          _field(batch, ("weights", name), raw.shape, np.float32), f"weights/{name}"))
    for s in m["spec"]["sequences"]:
      seq, limits = out["seq"][s["name"]], {"len": s["max_len"] + 1, "action": s["num_actions"],
                                            "surface": s["num_surfaces"]}
      for k, want in seq.items():
        seq[k] = _field(batch, ("seq", s["name"], k), want.shape, want.dtype)
        if k in limits:
          _in_range(seq[k], limits[k], f"seq/{s['name']}/{k}")
      _finite(seq["dt"], f"seq/{s['name']}/dt")
    if "domain" in batch or m["spec"]["num_domains"] > 1:
      out["domain"] = _in_range(_field(batch, ("domain",), (b,), np.int32),
                                max(m["spec"]["num_domains"], 1), "domain")
    return out

  def outputs(self, batch: Mapping[str, Any]) -> dict[str, np.ndarray]:
    x = self.prepare(batch)
    b = _rows(x)
    if b == 0:                                   # the outputs' widths, of one padding row
      return {k: v[:0] for k, v in self.outputs(padding(self.manifest["inputs"], 1)).items()}
    if None in self._fns:
      return _numpy(self._fns[None](self._params, self._tables, x))
    pieces, i = [], 0
    while i < b:
      size = next((s for s in self._sizes if s >= b - i), self._sizes[-1])
      n = min(size, b - i)
      part = jax.tree.map(lambda v: v[i:i + n], x)
      if n < size:
        part = jax.tree.map(lambda v, p: np.concatenate([v, p]), part,
                            padding(self.manifest["inputs"], size - n))
      got = _numpy(self._fns[size](self._params, self._tables, part))
      pieces.append({k: v[:n] for k, v in got.items()})
      i += n
    return {k: np.concatenate([p[k] for p in pieces]) for k in pieces[0]}


def _rows(batch: Mapping) -> int:
  for k in ("dense", "domain"):
    if k in batch:
      return int(np.shape(batch[k])[0])
  ids = batch.get("ids") or {}
  if not ids:
    raise ValueError("batch has no 'dense', 'domain' or 'ids' field: cannot tell its rows")
  return int(np.shape(next(iter(ids.values())))[0])


def _field(batch: Mapping, path: tuple[str, ...], shape: tuple, dtype) -> np.ndarray:
  """batch[path...] as an array of `shape` (and `dtype` if given); ValueError naming it."""
  x: Any = batch
  for k in path:
    if not isinstance(x, Mapping) or k not in x:
      raise ValueError(f"batch field {'/'.join(path)!r} is missing")
    x = x[k]
  x = np.asarray(x) if dtype is None else np.asarray(x, dtype)
  if x.shape != tuple(shape):
    raise ValueError(f"batch field {'/'.join(path)!r}: shape {x.shape}, expected {tuple(shape)}")
  return x


def _finite(x: np.ndarray, name: str) -> np.ndarray:
  if not np.isfinite(x).all():
    raise ValueError(f"batch field {name!r}: non-finite value at {np.argwhere(~np.isfinite(x))[0]}")
  return x


def _in_range(x: np.ndarray, high: int, name: str) -> np.ndarray:
  bad = (x < 0) | (x >= high)
  if bad.any():
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(f"batch field {name!r}: {int(x[where])} at {where} is outside [0, {high})")
  return x


def _numpy(tree) -> dict:
  return {k: np.asarray(v) for k, v in tree.items()}


def load(path: str, device: Any = None) -> Predictor:
  """The artifact at `path` on `device` (default: the first device), ready to score."""
  m = read_manifest(path)
  device = device or jax.devices()[0]
  put = lambda x: jax.device_put(np.ascontiguousarray(x), device)  # noqa: E731
  file = os.path.join(path, m["params"])
  with _np_load(file) as z:
    try:
      params = {k: put(z[k]) for k in z.files}
    except ValueError as e:
      raise ValueError(f"{file}: not plain numeric arrays ({e}); artifacts hold no pickled "
                       "objects") from None
  tables = {name: {leaf: put(_load_array(os.path.join(path, file), t["dtype"]))
                   for leaf, file in t["files"].items()}
            for name, t in m["tables"].items()}
  maps = {name: managed.host_map(_np_load(os.path.join(path, t["map"])))
          for name, t in m["tables"].items() if "map" in t}
  fns = {}
  for size, file in m["functions"].items():
    with open(os.path.join(path, file), "rb") as f:
      data = bytearray(f.read())
    try:
      exported = jax.export.deserialize(data)
    except Exception as e:  # pylint: disable=broad-except
      raise ValueError(f"{os.path.join(path, file)}: not a serialized jax.export module "
                       f"({type(e).__name__}: {str(e)[:200]})") from None
    check_function(exported, os.path.join(path, file))
    fns[None if size == "b" else int(size)] = jax.jit(exported.call)
  return Predictor(path, m, fns, params, tables, maps)
