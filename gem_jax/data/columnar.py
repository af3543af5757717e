"""The columnar training format: host batches as Parquet columns, plus a metadata file.

A converted dataset is a directory

  DIR/dataset.json          schema, DataSpec, files with row counts, bad-row report
  DIR/part-00000.parquet    row groups of `row_group_rows` rows, in source order
  DIR/part-00001.parquet    ...

written by `scripts/preprocess.py` (gem_jax/data/convert.py) and read by
`gem_jax.data.parquet.ParquetSource`. Every leaf of the batch contract
(gem_jax/data/spec.py) is one column named by its path:

  leaf                          column type                  read back as
  ----------------------------  ---------------------------  -------------------------
  'domain' (B,)                 int32                        (B,)
  'dense' (B, 13)               fixed_size_list<float>[13]   (B, 13)
  'ids/C1' (B, 1)               int64                        (B, 1)
  'ids/hist_item' (B, L)        list<int64>, len[i] values   (B, L), padded with -1
  'seq/history/dt' (B, L)       list<float>, len[i] values   (B, L), padded with 0
  'seq/history/len' (B,)        int32                        (B,)

A (B, L) leaf of a sequence stream (its `seq/<s>/*` fields and the ids/weights
of its item features) is stored *jagged*, only the first `len[i]` values of row
i, when every value past `len` equals one pad value (checked on every batch the
converter writes; otherwise the leaf is stored dense). Ids are stored raw
(int64, as the readers emit them); the table's id policy maps them at training
time, as for the text readers.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import numpy as np
import pyarrow as pa

from gem_jax.data.spec import DataSpec, SequenceStreamSpec, SparseFeatureSpec

META_NAME = "dataset.json"
FORMAT = "gem_jax.columnar"
VERSION = 1


class DatasetError(ValueError):
  """A converted dataset that is damaged or does not match its metadata or the config."""


# -- DataSpec <-> JSON ------------------------------------------------------------------

def spec_to_json(spec: DataSpec) -> dict:
  return dataclasses.asdict(spec)


def spec_from_json(d: dict) -> DataSpec:
  return DataSpec(
      n_dense=int(d["n_dense"]),
      sparse=tuple(SparseFeatureSpec(**f) for f in d["sparse"]),
      sequences=tuple(SequenceStreamSpec(**{**s, "item_features": tuple(s["item_features"])})
                      for s in d["sequences"]),
      num_domains=int(d["num_domains"]), tasks=tuple(d["tasks"]))


# -- leaves ---------------------------------------------------------------------------

def flatten(batch: dict, prefix: str = "") -> dict[str, np.ndarray]:
  """{'ids': {'C1': x}} -> {'ids/C1': x} (sorted paths)."""
  out = {}
  for k in sorted(batch):
    v = batch[k]
    if isinstance(v, dict):
      out.update(flatten(v, f"{prefix}{k}/"))
    else:
      out[f"{prefix}{k}"] = np.asarray(v)
  return out


def unflatten(leaves: dict[str, np.ndarray]) -> dict:
  out: dict = {"ids": {}, "seq": {}}
  for path, v in leaves.items():
    d = out
    *parents, name = path.split("/")
    for p in parents:
      d = d.setdefault(p, {})
    d[name] = v
  return out


def jagged_candidates(spec: DataSpec) -> dict[str, str]:
  """{leaf path: its stream's 'seq/<s>/len' path} for every (B, max_len) sequence leaf."""
  out = {}
  for s in spec.sequences:
    length = f"seq/{s.name}/len"
    for k in ("action", "surface", "dt"):
      out[f"seq/{s.name}/{k}"] = length
    for f in s.item_features:
      out[f"ids/{f}"] = length
      out[f"weights/{f}"] = length
  return out


@dataclasses.dataclass(frozen=True)
class Leaf:
  """One column: `path`, numpy `dtype`, per-row `shape`, and for jagged leaves the
  path of the length column and the value of positions past the length."""
  path: str
  dtype: str
  shape: tuple[int, ...]
  length: str | None = None
  pad: float | int | None = None

  def arrow_type(self) -> pa.DataType:
    value = pa.from_numpy_dtype(np.dtype(self.dtype))
    if self.length is not None:
      return pa.list_(value)
    if int(np.prod(self.shape)) > 1:
      return pa.list_(value, int(np.prod(self.shape)))
    return value          # () and (1,): a plain column (no list levels to encode)

  def to_json(self) -> dict:
    return {"path": self.path, "dtype": self.dtype, "shape": list(self.shape),
            "length": self.length, "pad": self.pad}

  @classmethod
  def from_json(cls, d: dict) -> "Leaf":
    return cls(d["path"], d["dtype"], tuple(d["shape"]), d.get("length"), d.get("pad"))


def infer_leaves(spec: DataSpec, leaves: dict[str, np.ndarray]) -> list[Leaf]:
  """The column layout of a batch's leaves: jagged where the padding allows it."""
  cands = jagged_candidates(spec)
  out = []
  for path, x in leaves.items():
    length, pad = cands.get(path), None
    if length is not None and x.ndim == 2 and length in leaves:
      pad = _pad_value(path, x, leaves[length])
      if pad is None:
        length = None
    else:
      length = None
    out.append(Leaf(path, x.dtype.str.lstrip("<>|="), tuple(x.shape[1:]), length, pad))
  return out


def _pad_value(path: str, x: np.ndarray, lens: np.ndarray):
  """The one value at every position >= lens of x (B, L), or None if there is none.

  With no such position, the batch contract's padding: -1 for ids, else 0.
  """
  tail = np.arange(x.shape[1])[None, :] >= lens[:, None]                  # (B, L)
  if not tail.any():
    return -1 if path.startswith("ids/") else (0.0 if x.dtype.kind == "f" else 0)
  vals = np.unique(x[tail])
  if len(vals) != 1:
    return None
  v = vals[0].item()
  return float(v) if x.dtype.kind == "f" else int(v)


def check_padding(leaves: dict[str, np.ndarray], layout: list[Leaf]) -> str | None:
  """Why `leaves` cannot be stored with `layout` (a jagged leaf with another pad value)."""
  for leaf in layout:
    if leaf.length is None:
      continue
    x, lens = leaves[leaf.path], leaves[leaf.length]
    tail = np.arange(x.shape[1])[None, :] >= lens[:, None]
    if tail.any() and not np.all(x[tail] == leaf.pad):
      return f"{leaf.path}: values past {leaf.length} are not all {leaf.pad}"
  return None


def to_table(leaves: dict[str, np.ndarray], layout: list[Leaf]) -> pa.Table:
  """numpy leaves (n rows each) -> an Arrow table with one column per leaf."""
  cols = []
  for leaf in layout:
    x = np.ascontiguousarray(leaves[leaf.path], dtype=leaf.dtype)
    n = x.shape[0]
    if leaf.length is not None:
      lens = leaves[leaf.length].astype(np.int64)
      keep = np.arange(x.shape[1])[None, :] < lens[:, None]                 # (n, L)
      offsets = np.zeros(n + 1, np.int32)
      np.cumsum(lens, out=offsets[1:])
      cols.append(pa.ListArray.from_arrays(pa.array(offsets), pa.array(x[keep])))
    elif int(np.prod(leaf.shape)) > 1:
      cols.append(pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)),
                                                    int(np.prod(leaf.shape))))
    else:
      cols.append(pa.array(x.reshape(-1)))
  return pa.Table.from_arrays(cols, schema=schema(layout))


def schema(layout: list[Leaf]) -> pa.Schema:
  return pa.schema([pa.field(leaf.path, leaf.arrow_type(), nullable=False) for leaf in layout])


def from_table(table: pa.Table, layout: list[Leaf]) -> dict[str, np.ndarray]:
  """An Arrow table of `layout` -> numpy leaves (jagged ones padded back)."""
  n = table.num_rows
  out = {}
  for leaf in layout:
    if leaf.length is None:
      col = table.column(leaf.path).combine_chunks()
      if int(np.prod(leaf.shape)) > 1:
        col = col.flatten()
      out[leaf.path] = col.to_numpy().reshape((n, *leaf.shape))
  for leaf in layout:
    if leaf.length is not None:
      col = table.column(leaf.path).combine_chunks()
      lens = out[leaf.length].astype(np.int64)
      x = np.full((n, *leaf.shape), leaf.pad, leaf.dtype)
      keep = np.arange(leaf.shape[0])[None, :] < lens[:, None]
      values = col.flatten().to_numpy()
      if len(values) != keep.sum():
        raise DatasetError(f"column {leaf.path!r}: {len(values)} values for lengths "
                           f"summing to {int(keep.sum())}")
      x[keep] = values
      out[leaf.path] = x
  return out


# -- metadata ---------------------------------------------------------------------------

# config.data keys that choose where and how a run reads, not what the rows are: they may
# differ between the conversion and the training run.
RUN_KEYS = frozenset({
    "train", "eval", "movies", "format", "batch_size", "eval_batch_size", "eval_examples",
    "shuffle_buffer", "bad_row_limit", "train_examples", "lanes", "reader_workers"})


def write_meta(out_dir: str, meta: dict) -> None:
  tmp = os.path.join(out_dir, META_NAME + ".tmp")
  with open(tmp, "w") as f:
    json.dump(meta, f, indent=1, sort_keys=True)
  os.replace(tmp, os.path.join(out_dir, META_NAME))


def is_dataset(path: str) -> bool:
  return isinstance(path, str) and os.path.isfile(os.path.join(path, META_NAME))


def read_meta(path: str) -> dict:
  """The metadata of the dataset at `path` (a directory or its dataset.json), checked."""
  file = path if path.endswith(".json") else os.path.join(path, META_NAME)
  if not os.path.isfile(file):
    raise DatasetError(f"{path}: no {META_NAME} (not a converted dataset; "
                       "scripts/preprocess.py writes one)")
  try:
    with open(file) as f:
      meta = json.load(f)
  except json.JSONDecodeError as e:
    raise DatasetError(f"{file}: not valid JSON ({e})") from None
  if meta.get("format") != FORMAT or meta.get("version") != VERSION:
    raise DatasetError(f"{file}: format {meta.get('format')!r} version {meta.get('version')!r},"
                       f" expected {FORMAT!r} version {VERSION}")
  for k in ("spec", "leaves", "files", "rows", "kind"):
    if k not in meta:
      raise DatasetError(f"{file}: field {k!r} missing")
  return meta


def check_config(meta: dict, data_cfg: Any, where: str) -> None:
  """Raises DatasetError when `data_cfg` asks for other rows than `meta` was converted with."""
  if data_cfg is None:
    return
  kind = data_cfg.get("kind")
  if kind not in (None, "", "parquet") and kind != meta["kind"]:
    raise DatasetError(f"{where}: converted from data.kind={meta['kind']!r}, but the config "
                       f"has data.kind={kind!r}")
  for k, v in sorted(meta.get("options", {}).items()):
    if k in RUN_KEYS or k not in data_cfg:
      continue
    mine = data_cfg.get(k)
    if _plain(mine) != _plain(v):
      raise DatasetError(f"{where}: converted with data.{k}={v!r}, but the config has "
                         f"data.{k}={mine!r} (re-run scripts/preprocess.py with it)")


def _plain(v):
  return json.loads(json.dumps(v, default=str))
