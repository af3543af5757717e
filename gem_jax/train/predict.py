"""Batch scoring: a checkpoint restored onto this run's mesh scores every row of an input.

  model = restore_model(config, workdir, batch_size)   # checked against the checkpoint's config
  rows  = input_rows(model.setup.eval_src, seed)       # text records | dataset rows | generated
  part k covers input rows [D + k R, D + (k + 1) R), R = P x rows_per_part (P processes):
    process p scores its contiguous slice [p r, (p + 1) r) in batches of b = B / P rows
    (padding rows fill the last batch; every process runs the same number of steps)
    -> OUT/part-<first row>.{parquet,tsv} + OUT/_parts/<first row>.json (the commit)
  process 0 writes OUT/_index.json once every part is there

Output rows follow the input order: sorting the part files by name concatenates them
in input order, whatever the process count. Columns: `row` (the input row: record
index in file order for text sources, counting bad rows; row index of a converted
dataset or a generated split), `key` ('file:line', text sources), `error` (the bad-row
reason, '' for good rows; text sources), with `key_column=NAME` that raw column of the
row as text (a text source's `columns`, e.g. Avazu's `id`), `p_<task>` per task
(float32), and with `trunk=True` the model's trunk embedding (list<float32>; TSV:
comma-joined).

Bad rows (a reader's `BadRow`, gem_jax/data/badrows.py) are counted against
`data.bad_row_limit` and, per `bad_rows`: 'reject' (default) -> the row is written with
NaN probabilities and its reason; 'missing' -> scored as a row whose every field is
missing (the reader's missing-value rule: dense 0, empty bags, domain 0), reason kept;
'drop' -> left out (its `row` number is skipped, never reused). A converted dataset has
no bad rows left (the converter counted them, dataset.json).

Resume: a part is committed by its JSON sidecar (written after the part file, both
renamed into place). A restart scores from the end of the committed prefix, with any
process count; a finished output (_index.json present) is returned as it is.
Multi-process runs need OUT on a file system every process sees (like checkpoints).
"""
from __future__ import annotations

import json
import logging as std_logging
import math
import os
import threading
import time
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from flax import nnx

from gem_jax import embedding as emb_lib
from gem_jax.data import columnar
from gem_jax.data import pipeline
from gem_jax.data.badrows import BadRow, BadRowCounter
from gem_jax.parallel import sharding as shd
from gem_jax.train import checkpoint as ckpt_lib
from gem_jax.train import report
from gem_jax.train import setup as setup_lib
from gem_jax.train import step as step_lib
from gem_jax.train.validate import ConfigError

BAD_ROWS = ("reject", "missing", "drop")
FORMATS = ("parquet", "tsv")
INDEX = "_index.json"
RUN = "_run.json"
PARTS = "_parts"

# Config fields that fix what a checkpoint's arrays mean: another value is another model.
IDENTITY = ("model.name", "model.preset", "model.overrides", "embedding.dim",
            "embedding.id_policy", "embedding.share_tables", "embedding.optimizer",
            "embedding.per_table", "data.kind",
            "data.preset", "data.vocab_size", "data.int_buckets", "data.max_len",
            "data.max_genres", "data.num_tables", "data.rows", "data.pooling")


# ------------------------------------------------------------ the restored model --

class Model(NamedTuple):
  """A restored model: its run setup (mesh, plan, spec, eval source), state, checkpoint step."""
  setup: Any
  state: Any
  step: int


def scoring_config(config, batch_size: int, data: str | None = None) -> ml_collections.ConfigDict:
  """An unlocked copy of a run config for scoring: train/eval batch `batch_size`, both
  splits reading `data` (when given), at least one train step (the schedules' length;
  scoring never counts the train files)."""
  c = ml_collections.ConfigDict(config.to_dict())
  c.data.batch_size = c.data.eval_batch_size = int(batch_size)
  if data:
    c.data.train = c.data.eval = data
  if c.train.steps <= 0:
    c.train.steps = 1
  return c


def _field(tree: Any, path: str) -> Any:
  for k in path.split("."):
    if not isinstance(tree, dict) or k not in tree:
      return None
    tree = tree[k]
  return tree


def check_config(saved: dict | None, config, where: str) -> None:
  """ConfigError naming every IDENTITY field on which the checkpoint's saved config
  differs from `config` (fields the saved config lacks are not compared). `config` is
  compared as the checkpoint stores it, in JSON (a tuple reads back as a list)."""
  if not saved:
    return
  mine = json.loads(json.dumps(config.to_dict()))
  diffs = [(k, _field(saved, k), _field(mine, k)) for k in IDENTITY
           if _field(saved, k) is not None and _field(saved, k) != _field(mine, k)]
  if diffs:
    raise ConfigError(f"{where} was written by a run with " + ", ".join(
        f"{k}={a!r} (this config: {b!r})" for k, a, b in diffs)
        + ": score it with the config it was trained with")


def _keys(path) -> tuple[str, ...]:
  return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def check_shapes(step_dir: str, abstract: Any) -> None:
  """ConfigError naming the first leaves whose saved shape (Orbax metadata) differs from
  `abstract` (the restore target); no-op when the metadata cannot be read."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  absl_logger = logging.get_absl_logger()    # Orbax warns of a file it does not need; the
  level = absl_logger.level                   # logger's own level comes back as it was (an
  absl_logger.setLevel(std_logging.ERROR)     # unset level must stay unset: set_verbosity(
  try:                                        # get_verbosity()) would pin it to WARNING)
    tree = ocp.PyTreeCheckpointer().metadata(os.path.join(step_dir, "state")).item_metadata.tree
    saved = {_keys(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
             if hasattr(x, "shape")}
  except (OSError, ValueError, AttributeError):
    return
  finally:
    absl_logger.setLevel(level)
  want = {_keys(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(abstract)[0]}
  bad = [f"{'/'.join(k)}: checkpoint {saved[k]}, this config {s}"
         for k, s in want.items() if k in saved and saved[k] != s]
  bad += [f"{'/'.join(k)}: not in the checkpoint" for k in want if k not in saved]
  bad += [f"{'/'.join(k)}: only in the checkpoint" for k in saved if k not in want]
  if bad:
    raise ConfigError(f"{step_dir} does not fit this config ({len(bad)} leaves): "
                      + "; ".join(bad[:4]))


def _saved_config(step_dir: str) -> dict | None:
  try:
    with open(os.path.join(step_dir, "config", "metadata")) as f:
      return json.load(f).get("config")
  except (OSError, ValueError):
    return None


def restore_model(config, workdir: str, batch_size: int, step: int | None = None, *,
                  data: str | None = None) -> Model:
  """The latest (or `step`) checkpoint of `workdir` on `config.mesh`, its plan made for
  `batch_size`; `data` replaces both splits' inputs. A checkpoint of another model or
  config: ConfigError naming the field (or the leaves whose shapes differ)."""
  s = setup_lib.setup(scoring_config(config, batch_size, data))
  directory = os.path.join(workdir, "checkpoints")
  ckpt = ckpt_lib.CheckpointManager(directory, save_every=None, keep=1)
  try:
    want = step if step is not None else ckpt.latest_step()
    if want is None:
      raise ConfigError(f"no checkpoint in {directory}")
    step_dir = os.path.join(directory, str(want))
    check_config(_saved_config(step_dir), config, f"checkpoint {step_dir}")
    check_shapes(step_dir, setup_lib.checkpoint_abstract(s.abstract, s.plan))
    state, restored = setup_lib.restore(s, ckpt, step)
  finally:
    ckpt.close()
  if restored is None:
    raise ConfigError(f"no checkpoint in {directory}")
  check_config(restored.config, config, f"checkpoint {directory}/{restored.step}")
  return Model(s, state, restored.step)


def model_outputs(net, inputs: dict, fields: Sequence[str] = ()) -> dict:
  """{'logits': (B, T) fp32, field: (B, D) fp32 for each aux field} of a model call."""
  logits, aux = net(inputs, return_aux=True)
  out = {"logits": logits.astype(jnp.float32)}
  for f in fields:
    if f not in aux:
      raise KeyError(f"the model's aux outputs have no {f!r}; they have {sorted(aux)}")
    out[f] = aux[f].reshape(aux[f].shape[0], -1).astype(jnp.float32)   # (B, D)
  return out


def local_rows(x: jax.Array) -> np.ndarray:
  """This process's rows of a batch-sharded global array, in global row order (its
  addressable shards sorted by start row, replicas' duplicates left out)."""
  seen, parts = set(), []
  for sh in sorted(x.addressable_shards, key=lambda t: t.index[0].start or 0):
    start = sh.index[0].start or 0
    if start not in seen:
      seen.add(start)
      parts.append(np.asarray(sh.data))
  return np.concatenate(parts, axis=0)


def forward_fn(model: Model, batch_shardings, fields: Sequence[str] = ()):
  """`(state, batch) -> {'logits': (B, T) fp32, field: (B, D) fp32 per aux field}` (e.g.
  'trunk', 'seq_summary'): the eval step's forward (lookup, the model under the activation
  pins), jitted once with explicit shardings; scoring and knowledge generation run it."""
  s = model.setup

  def forward(state, batch):
    emb = emb_lib.lookup(s.eval_plan, state.emb, batch["ids"], batch.get("weights"))
    net = nnx.merge(s.eval_cfg.graphdef, state.params, state.model_state)
    with shd.activation_sharding(s.mesh):
      return model_outputs(net, step_lib.model_inputs(s.spec, batch, emb), fields)

  return jax.jit(forward, in_shardings=(s.shardings, batch_shardings),
                 out_shardings=pipeline.batch_sharding(s.mesh))


# ------------------------------------------------------------------- input rows --

def pad_rows(batch: dict, n: int) -> dict:
  """`batch` with n padding rows appended (ids -1, everything else 0)."""
  def pad(path, x):
    x = np.asarray(x)
    fill = -1 if path and getattr(path[0], "key", None) == "ids" else 0
    return np.concatenate([x, np.full((n, *x.shape[1:]), fill, x.dtype)])
  return jax.tree_util.tree_map_with_path(pad, batch) if n else batch


class Slice(NamedTuple):
  """A process's rows of one part: `rows` input rows from `start`, read by `batch(i, j)`."""
  start: int
  rows: int
  keys: list | None          # 'file:line' per row (text sources)
  ids: list | None           # the key column's raw text per row (key_column)
  errors: list | None        # bad-row reason per row, None for good rows (text sources)
  examples: list | None      # decoded examples (None: bad) (text sources)
  pos: Any                   # the input position after these rows (resume)


class StreamRows:
  """Rows of a record source (text readers, any `StreamingSource`) in file order."""

  keyed = True

  def __init__(self, source, seed: int, counter: BadRowCounter, key_column: str | None = None):
    self.source, self.seed, self.counter = source, seed, counter
    self.key_column = key_column
    if key_column is not None and key_column not in source.columns:
      raise ConfigError(f"key column {key_column!r}: {source.describe()} has "
                        + (f"the columns {list(source.columns)}" if source.columns
                           else "no named raw columns"))
    self.stream = source.open_stream(0, seed)

  def position(self, pos: Any) -> None:
    if pos is not None:
      self.stream.seek(pos)

  def total(self) -> int | None:
    count = getattr(self.source, "num_rows", None)
    return count() if count is not None else None

  def read(self, start: int, size: int, lo: int, hi: int) -> tuple[int, Slice]:
    """Reads the next `size` records (rows [start, start + size)); decodes [lo, hi) of them.
    -> (records read, this process's slice)."""
    n, keys, errors, examples, pos = 0, [], [], [], self.stream.tell()
    ids = [] if self.key_column is not None else None
    while n < size:
      try:
        rec = next(self.stream)
      except StopIteration:
        break
      if lo <= n < hi:
        keys.append(self.source.where(rec))
        if ids is not None:
          ids.append(self.source.field(rec, self.key_column))
        try:
          examples.append(self.source.decode(rec))
          errors.append(None)
          self.counter.good()
        except BadRow as e:
          self.counter.report(keys[-1], str(e))
          examples.append(None)
          errors.append(str(e))
      n += 1
      if n == hi:
        pos = self.stream.tell()
    if n < hi:
      pos = self.stream.tell()
    self.counter.check(end_of_pass=n < size)
    return n, Slice(start + lo, len(keys), keys, ids, errors, examples, pos)

  def batch(self, sl: Slice, i: int, j: int) -> dict:
    ex = sl.examples[i:j] if sl.examples else []
    return self.source.collate(ex + [None] * (j - i - len(ex)))


class IndexedRows:
  """Rows of a converted dataset (ParquetSource, file order) or a generated split
  (SyntheticSource with num_examples, the eval stream of `seed`), read by index."""

  keyed = False

  def __init__(self, source, seed: int):
    self.source, self.seed = source, seed
    if hasattr(source, "read_block"):
      self.n = source.num_rows()
      self.cum = np.concatenate([[0], np.cumsum([n for *_, n in source.blocks])])
      self._block: tuple[int, dict] | None = None
    else:
      self.n = source.num_examples

  def position(self, pos: Any) -> None:
    del pos

  def total(self) -> int:
    return self.n

  def read(self, start: int, size: int, lo: int, hi: int) -> tuple[int, Slice]:
    n = max(0, min(size, self.n - start))
    a, b = start + min(lo, n), start + min(hi, n)
    return n, Slice(a, b - a, None, None, None, None, b)

  def _rows(self, a: int, b: int) -> dict:
    if not hasattr(self.source, "read_block"):
      return self.source.examples(a, b, self.seed)
    parts, k = [], int(np.searchsorted(self.cum, a, side="right")) - 1
    while a < b:
      if self._block is None or self._block[0] != k:
        self._block = (k, self.source.read_block(k)[0])
      leaves, lo = self._block[1], a - self.cum[k]
      hi = min(b, self.cum[k + 1]) - self.cum[k]
      parts.append({p: v[lo:hi] for p, v in leaves.items()})
      a, k = self.cum[k] + hi, k + 1
    return columnar.unflatten({p: np.concatenate([x[p] for x in parts]) for p in parts[0]})

  def batch(self, sl: Slice, i: int, j: int) -> dict:
    got = max(0, min(j, sl.rows) - i)
    if got == 0:
      first = self._rows(0, 1)
      return pad_rows(jax.tree.map(lambda x: x[:0], first), j - i)
    return pad_rows(self._rows(sl.start + i, sl.start + i + got), j - i - got)


def input_rows(source, seed: int, counter: BadRowCounter, key_column: str | None = None):
  """The rows reader of `source` (StreamRows for record sources, else IndexedRows)."""
  if hasattr(source, "open_stream"):
    return StreamRows(source, seed, counter, key_column)
  if key_column is not None:
    raise ConfigError(f"key column {key_column!r}: {source.describe()} is keyed by `row`, its "
                      "row index (a converted dataset keeps no raw columns; score the text "
                      "files to key by a column)")
  if hasattr(source, "read_block") or getattr(source, "num_examples", None):
    return IndexedRows(source, seed)
  raise ConfigError(f"{source.describe()} cannot be scored row by row (a record source, a "
                    "converted dataset, or a generated split with data.eval_examples)")


# ----------------------------------------------------------------------- output --

def _columns(tasks: Sequence[str], keyed: bool, trunk: bool,
             key_column: str | None = None) -> list[str]:
  return (["row"] + (["key", "error"] if keyed else []) + ([key_column] if key_column else [])
          + [f"p_{t}" for t in tasks]
          + (["trunk"] if trunk else []))


def _part_name(start: int, fmt: str) -> str:
  return f"part-{start:012d}.{fmt}"


def _write_atomic(path: str, write) -> None:
  tmp = f"{path}.tmp{os.getpid()}"
  write(tmp)
  os.replace(tmp, path)


def _write_json(path: str, value: dict) -> None:
  def write(tmp):
    with open(tmp, "w") as f:
      json.dump(value, f, indent=1, sort_keys=True)
  _write_atomic(path, write)


def write_part(path: str, cols: dict, fmt: str, header: list[str] | None) -> None:
  """One part file of `cols` ({name: array or list}); TSV gets `header` as its first line."""
  if fmt == "parquet":
    import pyarrow as pa  # pylint: disable=import-outside-toplevel
    import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
    arrays = {}
    for k, v in cols.items():
      if k == "trunk":
        v = np.asarray(v, np.float32)
        arrays[k] = pa.FixedSizeListArray.from_arrays(pa.array(v.reshape(-1)), v.shape[1])
      else:
        arrays[k] = pa.array(v)
    _write_atomic(path, lambda tmp: pq.write_table(pa.table(arrays), tmp))
    return

  def fmt_col(k, v):
    if k == "trunk":
      return [",".join(f"{x:.9g}" for x in r) for r in np.asarray(v)]
    if k.startswith("p_"):
      return [f"{x:.9g}" for x in np.asarray(v)]
    return [str(x).replace("\t", " ").replace("\n", " ") for x in v]

  def write(tmp):
    cells = [fmt_col(k, v) for k, v in cols.items()]
    with open(tmp, "w") as f:
      if header:
        f.write("\t".join(header) + "\n")
      for r in zip(*cells):
        f.write("\t".join(r) + "\n")
  _write_atomic(path, write)


def committed(out: str) -> tuple[int, Any, list[dict]]:
  """(end of the committed prefix of rows, the input position there, its parts' records)."""
  d = os.path.join(out, PARTS)
  parts = []
  if os.path.isdir(d):
    for name in os.listdir(d):
      if name.endswith(".json"):
        with open(os.path.join(d, name)) as f:
          parts.append(json.load(f))
  parts.sort(key=lambda p: p["start"])
  end, pos, done = 0, None, []
  for p in parts:
    if p["start"] != end:
      break
    end, pos = p["start"] + p["rows"], p["pos"]
    done.append(p)
  return end, pos, done


def _drop_after(out: str, end: int) -> None:
  """Removes parts (and sidecars, temporaries) at or after row `end` (process 0)."""
  for d in (out, os.path.join(out, PARTS)):
    if not os.path.isdir(d):
      continue
    for name in os.listdir(d):
      if ".tmp" in name:
        os.remove(os.path.join(d, name))
        continue
      stem = name.split(".")[0].removeprefix("part-")
      if stem.isdigit() and int(stem) >= end and name != INDEX:
        os.remove(os.path.join(d, name))


def _barrier(name: str) -> None:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    multihost_utils.sync_global_devices(name)


class RowProgress(report.Progress):
  """`report.Progress` counting rows: 'rows 1,200/5,000 (24%) rows_per_s=... ETA 0:00:10'
  (total 0: not known yet, no ETA)."""

  def __init__(self, total: int, initial: int = 0):
    super().__init__(total, initial, keys=("rows_per_s",))
    if self._bar is not None:
      self._bar.unit = "row"

  def format(self, step: int, metrics) -> str:
    elapsed = time.perf_counter() - self._t0
    rate = " ".join(f"{k}={report._fmt(metrics[k])}" for k in self.keys if k in metrics)
    if not self.total:
      return f"rows {step:,} {rate} | elapsed {report._hms(elapsed)}"
    return (f"rows {step:,}/{self.total:,} ({100.0 * step / self.total:.0f}%) {rate} | "
            f"elapsed {report._hms(elapsed)} ETA {report._hms(self.eta_s(step))}")

  def set_total(self, total: int) -> None:
    self.total = int(total)
    if self._bar is not None:
      self._bar.total = self.total


# ------------------------------------------------------------------------- loop --

def predict(model: Model, source, out: str, *, fmt: str = "parquet", trunk: bool = False,
            bad_rows: str = "reject", rows_per_part: int = 65536, seed: int = 0,
            bad_row_limit: float = 0.01, max_parts: int | None = None,
            progress_every_s: float = 10.0, key_column: str | None = None) -> dict:
  """Scores every row of `source` with `model` into the directory `out` (module docstring).

  Args:
    model: from `restore_model` (its eval plan's batch is the global scoring batch B).
    source: a source with the model's DataSpec (e.g. `model.setup.eval_src`).
    fmt: 'parquet' or 'tsv'.
    trunk: also write the trunk embedding.
    bad_rows: 'reject', 'missing' or 'drop' (module docstring).
    rows_per_part: input rows per part file and process (rounded up to a multiple of B / P).
    seed: the generated source's stream seed (evaluation reads `config.seed`'s).
    bad_row_limit: the bad-row fraction that stops scoring (BadRowLimitError).
    max_parts: stop after this many parts (a simulated interruption; None: all).
    key_column: also write this raw column of every row (text sources' `columns`).
  Returns:
    the index (also OUT/_index.json): rows, written, bad, parts, columns, step, ...
  """
  if fmt not in FORMATS:
    raise ConfigError(f"output format {fmt!r}: expected one of {FORMATS}")
  if bad_rows not in BAD_ROWS:
    raise ConfigError(f"bad_rows={bad_rows!r}: expected one of {BAD_ROWS}")
  s = model.setup
  if source.spec != s.spec:
    raise ConfigError(f"{source.describe()}: its DataSpec differs from the model's (features, "
                      "tasks): score data of the kind and options the model was trained on")
  pc, pi = jax.process_count(), jax.process_index()
  B = s.eval_plan.batch_size
  b = B // pc
  r = max(b, math.ceil(rows_per_part / b) * b)
  counter = BadRowCounter(bad_row_limit, min_rows=1000)
  base = _columns(s.spec.tasks, rows_keyed := hasattr(source, "open_stream"), trunk)
  if key_column is not None and (key_column in base or key_column.startswith("p_")):
    raise ConfigError(f"key column {key_column!r} clashes with an output column ({base})")
  rows = input_rows(source, seed, counter, key_column)
  columns = _columns(s.spec.tasks, rows_keyed, trunk, key_column)
  run = {"input": source.describe(), "step": model.step, "format": fmt, "columns": columns,
         "bad_rows": bad_rows, "batch_size": B}
  if os.path.isfile(os.path.join(out, INDEX)):
    with open(os.path.join(out, INDEX)) as f:
      index = json.load(f)
    _check_run(out, index, run)
    return index
  os.makedirs(os.path.join(out, PARTS), exist_ok=True)
  run_file = os.path.join(out, RUN)
  if os.path.isfile(run_file):
    with open(run_file) as f:
      _check_run(out, json.load(f), run)
  start, pos, _ = committed(out)
  _barrier("predict_resume_read")
  if pi == 0:
    _drop_after(out, start)
    _write_json(run_file, run)
  _barrier("predict_resume_clean")
  rows.position(pos)
  if start:
    logging.info("predict: resuming %s at row %d", out, start)

  put = setup_lib.device_putter(s.eval_plan, s.mesh)
  prog = RowProgress(0, start)
  _count_in_background(rows, prog)
  fwd, t0, last_log, parts, window = None, time.perf_counter(), 0.0, 0, r * pc
  ended = False
  while not ended and (max_parts is None or parts < max_parts):
    n, sl = rows.read(start, window, pi * r, (pi + 1) * r)
    ended = n < window
    if n == 0:
      break
    steps = math.ceil(min(r, n) / b)
    chunks = []
    with pipeline.Prefetcher(_Batches(rows, sl, b, steps), put_fn=put, size=2) as batches:
      for dev in batches:
        if fwd is None:
          fwd = forward_fn(model, jax.tree.map(lambda x: x.sharding, dev), ("trunk",) * trunk)
        chunks.append(fwd(model.state, dev))
        if len(chunks) > 1:
          chunks[-2] = _local(chunks[-2])
    if chunks:
      chunks[-1] = _local(chunks[-1])
    if sl.rows:
      _commit_part(out, sl, chunks, s.spec.tasks, fmt, columns, bad_rows, counter)
    start += n
    parts += 1
    if time.perf_counter() - last_log >= progress_every_s:
      last_log = time.perf_counter()
      prog.update(start, {"rows_per_s": (start - prog.initial) / max(last_log - t0, 1e-9)})
  prog.update(start, {"rows_per_s": (start - prog.initial) / max(time.perf_counter() - t0, 1e-9)})
  prog.close()
  _barrier("predict_parts_written")
  if not ended:
    return {"interrupted_at": start}
  return _finish(out, run, counter, time.perf_counter() - t0)


class _Batches:
  """Host batches of one slice (`steps` of b rows, padded), as an iterator with `state()`."""

  def __init__(self, rows, sl: Slice, b: int, steps: int):
    self.rows, self.sl, self.b, self.steps, self.i = rows, sl, b, steps, 0

  def state(self) -> dict:
    return {"batch": self.i}

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    if self.i >= self.steps:
      raise StopIteration
    a = self.i * self.b
    self.i += 1
    return self.rows.batch(self.sl, a, a + self.b)


def _local(out: dict) -> dict:
  return {k: local_rows(v) for k, v in out.items()}


def _count_in_background(rows, prog: RowProgress) -> threading.Thread:
  """Counts the input's rows (text: a read of the files) and hands the total to `prog`."""
  def count():
    try:
      n = rows.total()
    except Exception:  # noqa: BLE001 - the count only feeds the ETA
      n = None
    if n:
      prog.set_total(n)
  t = threading.Thread(target=count, daemon=True, name="predict-count")
  t.start()
  return t


def _commit_part(out: str, sl: Slice, chunks: list, tasks, fmt: str, columns: list[str],
                 bad_rows: str, counter: BadRowCounter) -> None:
  """Writes this process's part of rows [sl.start, sl.start + sl.rows) and its sidecar."""
  got = {k: np.concatenate([c[k] for c in chunks])[:sl.rows] for k in chunks[0]}
  logits = got["logits"].astype(np.float64)
  probs = (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)           # (n, T)
  keep = np.ones(sl.rows, bool)
  errors = [e or "" for e in sl.errors] if sl.errors is not None else None
  if errors is not None:
    bad = np.asarray([e is not None for e in sl.errors], bool)
    if bad_rows == "reject":
      probs[bad] = np.nan
    elif bad_rows == "drop":
      keep = ~bad
  cols = {"row": np.arange(sl.start, sl.start + sl.rows, dtype=np.int64)[keep]}
  if sl.keys is not None:
    cols["key"] = [k for k, m in zip(sl.keys, keep) if m]
    cols["error"] = [e for e, m in zip(errors, keep) if m]
  if sl.ids is not None:
    cols[columns[3]] = [k for k, m in zip(sl.ids, keep) if m]
  for t, task in enumerate(tasks):
    cols[f"p_{task}"] = probs[keep, t]
  if "trunk" in columns:
    cols["trunk"] = got["trunk"][keep]
  write_part(os.path.join(out, _part_name(sl.start, fmt)), cols, fmt,
             columns if sl.start == 0 else None)
  n_bad = sum(e is not None for e in sl.errors) if sl.errors is not None else 0
  _write_json(os.path.join(out, PARTS, f"{sl.start:012d}.json"),
              {"start": sl.start, "rows": sl.rows, "written": int(keep.sum()), "bad": n_bad,
               "pos": sl.pos, "process": jax.process_index(),
               "bad_reports": [f"{k}: {e}" for k, e in zip(sl.keys or [], sl.errors or [])
                               if e is not None][:5]})


def _check_run(out: str, saved: dict, run: dict) -> None:
  diff = [k for k in run if saved.get(k) != run[k]]
  if diff:
    raise ConfigError(f"{out} holds predictions of another run ("
                      + ", ".join(f"{k}: {saved.get(k)!r} there, {run[k]!r} now" for k in diff)
                      + "): use another --out or delete it")


def _finish(out: str, run: dict, counter: BadRowCounter, seconds: float) -> dict:
  """Process 0 checks the committed parts cover the input and writes the index."""
  end, _, parts = committed(out)
  index = dict(run, rows=end, written=sum(p["written"] for p in parts),
               bad=sum(p["bad"] for p in parts), parts=len(parts),
               bad_reports=[m for p in parts for m in p["bad_reports"]][:10],
               seconds=round(seconds, 3), rows_per_s=round(end / max(seconds, 1e-9), 1))
  if jax.process_index() == 0:
    _write_json(os.path.join(out, INDEX), index)
  _barrier("predict_index_written")
  if counter.bad and jax.process_index() == 0:
    logging.warning("predict: %d bad rows (%s); first: %s", index["bad"], run["bad_rows"],
                    index["bad_reports"][:3])
  return index


def read_predictions(out: str) -> dict[str, np.ndarray]:
  """The columns of a finished Parquet output, in input order (for tests and notebooks)."""
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
  with open(os.path.join(out, INDEX)) as f:
    index = json.load(f)
  if index["format"] != "parquet":
    raise ValueError(f"{out}: format {index['format']!r}; read the TSV parts in name order")
  names = sorted(n for n in os.listdir(out) if n.startswith("part-") and n.endswith(".parquet"))
  tables = [pq.read_table(os.path.join(out, n)) for n in names]
  out_cols = {}
  for c in index["columns"]:
    text = c not in ("row", "trunk") and not c.startswith("p_")  # key, error, a key column
    vals = [t.column(c).to_pylist() if text else
            np.asarray(t.column(c).to_pylist() if c == "trunk" else t.column(c).to_numpy())
            for t in tables]
    out_cols[c] = sum(vals, []) if text else np.concatenate(vals)
  return out_cols

