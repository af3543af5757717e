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
"""
from __future__ import annotations

import json
import os
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
  """The manifest of the artifact at `path`; ValueError for another format or a newer one."""
  file = os.path.join(path, MANIFEST)
  if not os.path.isfile(file):
    raise FileNotFoundError(f"{path}: no {MANIFEST} (not a serving artifact, or its export "
                            "did not finish)")
  with open(file) as f:
    m = json.load(f)
  if m.get("format") != FORMAT:
    raise ValueError(f"{file}: format {m.get('format')!r}, expected {FORMAT!r}")
  v = m.get("format_version")
  if not isinstance(v, int) or v > FORMAT_VERSION:
    raise ValueError(f"{file}: artifact format version {v!r} is newer than this loader's "
                     f"{FORMAT_VERSION}: load it with the gem_jax that exported it (or newer)")
  return m


def _load_array(path: str, dtype: str) -> np.ndarray:
  x = np.load(path, mmap_mode="r")
  return x.view(jnp.bfloat16) if dtype == "bfloat16" else x   # stored as uint16 bits


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
  with np.load(os.path.join(path, m["params"])) as z:
    params = {k: put(z[k]) for k in z.files}
  tables = {name: {leaf: put(_load_array(os.path.join(path, file), t["dtype"]))
                   for leaf, file in t["files"].items()}
            for name, t in m["tables"].items()}
  maps = {name: managed.host_map(np.load(os.path.join(path, t["map"])))
          for name, t in m["tables"].items() if "map" in t}
  fns = {}
  for size, file in m["functions"].items():
    with open(os.path.join(path, file), "rb") as f:
      exported = jax.export.deserialize(bytearray(f.read()))
    fns[None if size == "b" else int(size)] = jax.jit(exported.call)
  return Predictor(path, m, fns, params, tables, maps)
