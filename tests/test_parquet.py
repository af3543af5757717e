"""The columnar format: converter (gem_jax/data/convert.py) and reader (gem_jax/data/parquet.py).

References: the text readers. A converted dataset read in file order (one lane, no
shuffle) yields exactly the text reader's good rows, and the converter reports the
same bad rows (file:line: reason). The reader's global batches do not depend on
the process count, each process reads ~1/P of the bytes, and a resumed iterator
continues bit-identically, also onto another process count.
"""
import json
import os
import shutil

import numpy as np
import pytest
from data_fixtures import synth_data  # noqa: F401
from ml_collections import config_dict

from gem_jax.data import columnar, convert, registry
from gem_jax.data.adult import AdultSource
from gem_jax.data.alimama import AlimamaSource
from gem_jax.data.avazu import AvazuSource
from gem_jax.data.badrows import BadRowLimitError
from gem_jax.data.criteo import CriteoSource
from gem_jax.data.movielens import MovieLensSource
from gem_jax.data.parquet import ParquetSource


def rows_of(batches) -> dict:
  """The non-padding rows of host batches, leaf by leaf (label_mask > 0 on some task)."""
  leaves = [columnar.flatten(b) for b in batches]
  cat = {k: np.concatenate([x[k] for x in leaves]) for k in leaves[0]}
  keep = cat["label_mask"].max(axis=1) > 0
  return {k: v[keep] for k, v in cat.items()}


def assert_same_rows(a: dict, b: dict):
  assert sorted(a) == sorted(b)
  for k in a:
    assert a[k].dtype == b[k].dtype, k
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def text_counter(source):
  it = source.batches(64, repeat=False)
  batches = list(it)
  return batches, it.counter


@pytest.fixture(scope="module")
def criteo_ds(tmp_path_factory, synth_data):  # noqa: F811
  """The synthetic Criteo train file: 1600 rows in 64 row groups of 25 rows, 4 files."""
  out = str(tmp_path_factory.mktemp("pq") / "criteo")
  cfg = data_cfg(train=synth_data.criteo["train"], eval=synth_data.criteo["dev"])
  convert.convert_config(cfg, out, splits=("train",), row_group_rows=25, rows_per_file=400)
  return os.path.join(out, "train")


# -- converter ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["train", "dev_gz", "dev_crlf", "days", "bad"])
@pytest.mark.parametrize("workers,block_bytes", [(1, 16 << 20), (2, 3000)])
def test_criteo_converter_matches_text_reader(tmp_path, synth_data, name, workers,  # noqa: F811
                                              block_bytes):
  fx = synth_data.criteo
  paths = fx[name].path if name == "bad" else fx[name]
  make = lambda: CriteoSource(paths, int_buckets=True, bad_row_limit=0.2)
  meta = convert.convert(make(), str(tmp_path / "ds"), kind="criteo", row_group_rows=64,
                         workers=workers, block_bytes=block_bytes)
  assert meta["parser"] == "vectorised"
  batches, counter = text_counter(make())
  got = ParquetSource(str(tmp_path / "ds"), lanes=1).batches(64, repeat=False)
  assert_same_rows(rows_of(got), rows_of(batches))
  assert meta["rows"] == counter.rows - counter.bad
  assert meta["bad_rows"] == counter.state()
  if name == "bad":   # the same file:line reports as the row parser, in order
    assert meta["bad_rows"]["bad"] == len(fx["bad"].lines)
    reported = [int(r.split(":")[1]) for r in meta["bad_rows"]["reports"]]
    assert reported == sorted(fx["bad"].lines)[:len(reported)]


def test_converter_stops_above_the_bad_row_limit(tmp_path, synth_data):  # noqa: F811
  src = CriteoSource(synth_data.criteo["bad"].path, bad_row_limit=0.01)
  with pytest.raises(BadRowLimitError, match=r"bad\.tsv:\d+"):
    convert.convert(src, str(tmp_path / "ds"), kind="criteo", row_group_rows=64)
  assert not os.path.exists(tmp_path / "ds" / columnar.META_NAME)


def _row_sources(fx):
  ml = fx.movielens
  return {
      "avazu": lambda: AvazuSource(fx.avazu["train"]),
      "avazu_bad": lambda: AvazuSource(fx.avazu["bad"].path, bad_row_limit=0.2),
      "adult": lambda: AdultSource(fx.adult["train"]),
      "alimama": lambda: AlimamaSource(fx.alimama["train"]),
      "movielens": lambda: MovieLensSource(ml["ratings"], ml["movies"], split="train",
                                           split_timestamp=2 ** 40, max_len=8),
      "movielens_split": lambda: MovieLensSource(ml["ratings_crlf"], ml["movies"], split="eval",
                                                 split_quantile=0.7, max_len=5),
      "movielens_bad": lambda: MovieLensSource(ml["bad"].path, split="train", max_len=8,
                                               split_timestamp=2 ** 40, bad_row_limit=0.2),
  }


@pytest.mark.parametrize("kind", ["avazu", "avazu_bad", "adult", "alimama", "movielens",
                                  "movielens_split", "movielens_bad"])
def test_other_converters_match_text_reader(tmp_path, synth_data, kind):  # noqa: F811
  make = _row_sources(synth_data)[kind]
  meta = convert.convert(make(), str(tmp_path / "ds"), kind=kind, row_group_rows=100,
                         block_bytes=2000, workers=2)
  assert meta["parser"] == ("vectorised" if kind in ("avazu", "avazu_bad", "movielens",
                                                    "movielens_split") else "rows")
  batches, counter = text_counter(make())
  src = ParquetSource(str(tmp_path / "ds"), lanes=1)
  assert src.spec == make().spec
  assert src.shared_vocab == getattr(make(), "shared_vocab", None)
  assert_same_rows(rows_of(src.batches(64, repeat=False)), rows_of(batches))
  assert meta["bad_rows"] == counter.state()
  jagged = {leaf["path"] for leaf in meta["leaves"] if leaf["length"]}
  if kind.startswith("movielens") or kind == "alimama":   # sequences stored jagged
    assert jagged and all(p.startswith(("ids/", "seq/")) for p in jagged)
  else:
    assert not jagged


# -- reader: process count, bytes, order, resume -------------------------------------------

def global_batches(src, n, P, **kw):
  """n global batches assembled from P processes' local batches."""
  its = [src.batches(64, process_index=p, process_count=P, **kw) for p in range(P)]
  out = []
  for _ in range(n):
    parts = [columnar.flatten(next(it)) for it in its]
    out.append({k: np.concatenate([x[k] for x in parts]) for k in parts[0]})
  return out, its


@pytest.mark.parametrize("shuffle_buffer", [0, 400])
@pytest.mark.parametrize("repeat", [True, False])
def test_global_batches_do_not_depend_on_process_count(criteo_ds, shuffle_buffer, repeat):
  src = ParquetSource(criteo_ds, shuffle_buffer=shuffle_buffer, lanes=16)
  n = 60 if repeat else 25          # 1600 rows / 64: 25 per pass; 60 crosses two epochs
  ref, _ = global_batches(src, n, 1, seed=5, repeat=repeat)
  for P in (2, 4):
    got, its = global_batches(src, n, P, seed=5, repeat=repeat)
    for a, b in zip(ref, got):
      assert_same_rows(a, b)
    if not repeat:
      share = np.asarray([it.bytes_read for it in its], float)
      share /= share.sum()
      assert np.all(np.abs(share * P - 1) < 0.1), share   # each reads ~1/P of the bytes


def test_one_pass_is_every_row_once_and_shuffled(criteo_ds, synth_data):  # noqa: F811
  text = rows_of(CriteoSource(synth_data.criteo["train"]).batches(64, repeat=False))
  key = lambda rows: [tuple(r) for r in np.concatenate(
      [rows[f"ids/C{j}"] for j in range(1, 27)] + [rows["dense"].view(np.int32)], axis=1)]
  file_order = key(text)
  for shuffle_buffer in (0, 400):
    src = ParquetSource(criteo_ds, shuffle_buffer=shuffle_buffer, lanes=16)
    epochs = [key(rows_of(b for b, _ in zip(src.batches(64, seed=s, repeat=False), range(99))))
              for s in (0, 1)]
    for e in epochs:
      assert sorted(e) == sorted(file_order)      # nothing dropped, nothing twice
    assert (epochs[0] != epochs[1]) == (shuffle_buffer > 1)
    # epoch 2 of a repeating iterator is another permutation
    it = src.batches(64, seed=0)
    two = key(rows_of([next(it) for _ in range(50)]))
    assert sorted(two[:1600]) == sorted(two[1600:]) == sorted(file_order)
    assert (two[:1600] != two[1600:]) == (shuffle_buffer > 1)


@pytest.mark.parametrize("p_save,p_restore", [(1, 1), (2, 1), (1, 4), (4, 2)])
@pytest.mark.parametrize("at", [7, 24, 33])      # mid-epoch, at the epoch end, in epoch 2
def test_resume_is_bit_identical_on_any_process_count(criteo_ds, p_save, p_restore, at):
  src = ParquetSource(criteo_ds, shuffle_buffer=400, lanes=16, workers=1)
  ref, _ = global_batches(src, at + 20, 1, seed=3)
  _, its = global_batches(src, at, p_save, seed=3)
  states = [it.state() for it in its]
  assert all(s == states[0] for s in states)          # one state for every process
  state = json.loads(json.dumps(states[0]))           # as it goes through a checkpoint
  its = [src.batches(64, process_index=p, process_count=p_restore, seed=3, state=state)
         for p in range(p_restore)]
  for t in range(20):
    parts = [columnar.flatten(next(it)) for it in its]
    assert_same_rows({k: np.concatenate([x[k] for x in parts]) for k in parts[0]}, ref[at + t])


def test_reader_workers_do_not_change_batches(criteo_ds):
  out = []
  for workers in (0, 1, 3):
    it = ParquetSource(criteo_ds, shuffle_buffer=400, workers=workers).batches(64, seed=1)
    out.append([columnar.flatten(next(it)) for _ in range(30)])
    it.close()
  for other in out[1:]:
    for a, b in zip(out[0], other):
      assert_same_rows(a, b)


def test_resume_refuses_another_order(criteo_ds):
  src = ParquetSource(criteo_ds, shuffle_buffer=400)
  it = src.batches(64, seed=3)
  next(it)
  with pytest.raises(ValueError, match="seed=3 but this iterator has seed=4"):
    src.batches(64, seed=4, state=it.state())
  with pytest.raises(ValueError, match="lanes=16 but this iterator has lanes=8"):
    ParquetSource(criteo_ds, shuffle_buffer=400, lanes=8).batches(64, seed=3, state=it.state())


def test_lane_and_batch_errors(criteo_ds):
  src = ParquetSource(criteo_ds, lanes=16)
  with pytest.raises(ValueError, match="batch size 100 must be a positive multiple of "
                                       "data.lanes=16"):
    src.batches(100)
  with pytest.raises(ValueError, match="data.lanes=16 must be a multiple of the process "
                                       "count 3"):
    src.batches(96, process_count=3)


# -- the trainer's view: registry, config checks -----------------------------------------------

def data_cfg(**kw):
  from configs import criteo as criteo_config  # pylint: disable=import-outside-toplevel
  c = criteo_config.get_config().data
  c.update(**kw)
  return c


def test_registry_detects_converted_datasets(criteo_ds, synth_data):  # noqa: F811
  train, ev = registry.make_sources(data_cfg(train=criteo_ds, eval=synth_data.criteo["dev"]))
  assert isinstance(train, ParquetSource) and isinstance(ev, CriteoSource)
  assert train.shuffle_buffer == 4096 and train.spec == ev.spec
  with pytest.raises(columnar.DatasetError, match="no dataset.json"):
    registry.make_sources(data_cfg(train=synth_data.criteo["dev"], format="parquet"))
  train, _ = registry.make_sources(data_cfg(train=synth_data.criteo["dev"], format="text",
                                            eval=synth_data.criteo["dev"]))
  assert isinstance(train, CriteoSource)


def test_dataset_refuses_another_config(criteo_ds):
  with pytest.raises(columnar.DatasetError, match=r"converted from data.kind='criteo', but "
                                                  r"the config has data.kind='avazu'"):
    ParquetSource(criteo_ds, data_cfg=config_dict.ConfigDict({"kind": "avazu"}))


def test_converted_options_are_checked(tmp_path, synth_data):  # noqa: F811
  cfg = data_cfg(train=synth_data.criteo["dev"], eval=synth_data.criteo["dev"])
  convert.convert_config(cfg, str(tmp_path), splits=("train",), row_group_rows=100)
  other = data_cfg(train=str(tmp_path / "train"), eval=synth_data.criteo["dev"],
                   int_buckets=True)
  with pytest.raises(columnar.DatasetError, match=r"converted with data.int_buckets=False, "
                                                  r"but the config has data.int_buckets=True"):
    registry.make_sources(other)
  same = data_cfg(train=str(tmp_path / "train"), eval=synth_data.criteo["dev"],
                  shuffle_buffer=7, batch_size=32)      # run options may differ
  assert registry.make_sources(same)[0].num_rows() == 400


# -- damaged datasets: one clear error naming the file -------------------------------------------

@pytest.fixture
def damaged(tmp_path, criteo_ds):
  out = str(tmp_path / "ds")
  shutil.copytree(criteo_ds, out)
  with open(os.path.join(out, columnar.META_NAME)) as f:
    return out, json.load(f)


def _write_meta(out, meta):
  with open(os.path.join(out, columnar.META_NAME), "w") as f:
    json.dump(meta, f)


def test_truncated_file(damaged):
  out, meta = damaged
  part = os.path.join(out, "part-00001.parquet")
  with open(part, "r+b") as f:
    f.truncate(os.path.getsize(part) // 2)
  with pytest.raises(columnar.DatasetError, match=r"part-00001.parquet: \d+ bytes, "
                                                  r"dataset.json says \d+ \(truncated"):
    ParquetSource(out)
  meta["files"][1]["bytes"] = os.path.getsize(part)   # metadata "agrees": still refused
  _write_meta(out, meta)
  with pytest.raises(columnar.DatasetError, match="part-00001.parquet: not a readable Parquet"):
    ParquetSource(out)


def test_missing_and_unlisted_files(damaged):
  out, meta = damaged
  os.rename(os.path.join(out, "part-00002.parquet"), os.path.join(out, "extra.parquet"))
  with pytest.raises(columnar.DatasetError, match="part-00002.parquet: listed in dataset.json "
                                                  "but missing"):
    ParquetSource(out)
  meta["files"].pop(2)
  meta["rows"] -= 400
  _write_meta(out, meta)
  with pytest.raises(columnar.DatasetError, match="extra.parquet is not listed in dataset.json"):
    ParquetSource(out)


def test_metadata_that_disagrees_with_the_files(damaged):
  out, meta = damaged
  meta["files"][0]["row_groups"][0] = 24
  _write_meta(out, meta)
  with pytest.raises(columnar.DatasetError, match=r"part-00000.parquet: row groups of \[25, "):
    ParquetSource(out)
  meta["files"][0]["row_groups"][0] = 25
  meta["rows"] = 1601
  _write_meta(out, meta)
  with pytest.raises(columnar.DatasetError, match="rows 1601 != the sum of its files"):
    ParquetSource(out)


def test_schema_that_does_not_match(damaged):
  out, meta = damaged
  meta["leaves"] = [x for x in meta["leaves"] if x["path"] != "ids/C7"]
  _write_meta(out, meta)
  with pytest.raises(columnar.DatasetError, match=r"part-00000.parquet: schema differs from "
                                                  r"dataset.json: \['ids/C7: int64 not "):
    ParquetSource(out)


def test_not_a_dataset(tmp_path):
  (tmp_path / columnar.META_NAME).write_text("{not json")
  with pytest.raises(columnar.DatasetError, match="dataset.json: not valid JSON"):
    ParquetSource(str(tmp_path))


def test_bad_row_lines_are_exact_across_parser_blocks(synth_data):  # noqa: F811
  """pyarrow parses a block in 1 MB pieces: bad-row line numbers must not shift across them."""
  with open(synth_data.criteo["train"], "rb") as f:
    lines = f.read().split(b"\n")[:-1] * 4                     # ~1.6 MB: two or more pieces
  bad = lines[0].rsplit(b"\t", 1)[0]                           # 39 fields
  for at in (len(lines) - 7, len(lines) // 2, 3):              # later inserts first
    lines.insert(at, bad)
  data = b"\n".join(lines) + b"\n"
  assert len(data) > 1 << 20
  leaves, n, reports = CriteoSource(synth_data.criteo["train"]).parse_block(data)
  assert n == len(lines) and len(leaves["domain"]) == len(lines) - 3
  assert [i for i, _ in reports] == [i for i, x in enumerate(lines) if x == bad]
