"""Pipeline tests on a toy line format: shuffle, resume, process sharding, prefetch."""
import gzip
import json

import jax
import numpy as np
import pytest

from gem_jax.data import pipeline
from gem_jax.data.badrows import BadRow, BadRowLimitError, NoDataError
from gem_jax.data.source import LineSource, base_batch, valid_rows
from gem_jax.data.spec import DataSpec


class ToySource(LineSource):
  """Lines 'label,value'; value must be an integer."""

  def __init__(self, paths, **kw):
    super().__init__(paths, DataSpec(n_dense=1, sparse=()), **kw)

  def parse(self, line):
    parts = line.split(b",")
    if len(parts) != 2:
      raise BadRow(f"expected 2 fields, got {len(parts)}")
    try:
      return int(parts[0]), int(parts[1])
    except ValueError as e:
      raise BadRow(f"non-numeric: {e}") from None

  def collate(self, examples):
    out = base_batch(len(examples), 1, 1)
    idx, ex = valid_rows(examples)
    if len(idx):
      out["labels"][idx, 0] = [e[0] for e in ex]
      out["dense"][idx, 0] = [e[1] for e in ex]
      out["label_mask"][idx, 0] = 1
    return out


def write(path, values, gz=False):
  data = "".join(f"{v % 2},{v}\n" for v in values).encode()
  if gz:
    data = gzip.compress(data)
  path.write_bytes(data)
  return str(path)


@pytest.fixture
def files(tmp_path):
  """Three files (one gzip) holding values 0..99 in order."""
  return [write(tmp_path / "a.txt", range(0, 40)),
          write(tmp_path / "b.txt.gz", range(40, 75), gz=True),
          write(tmp_path / "c.txt", range(75, 100))]


def values(batches):
  """The valid values of a list of batches, in order."""
  out = []
  for b in batches:
    m = b["label_mask"][:, 0] > 0
    out += b["dense"][m, 0].astype(int).tolist()
  return out


def test_one_pass_in_file_order_with_padding(files):
  src = ToySource(",".join(files))
  bs = list(src.batches(16, repeat=False))
  assert len(bs) == 7                                   # ceil(100 / 16)
  assert values(bs) == list(range(100))
  assert bs[-1]["label_mask"][:, 0].tolist() == [1] * 4 + [0] * 12
  assert all(b["dense"].shape == (16, 1) for b in bs)


def test_shuffle_is_a_seeded_permutation(files):
  src = ToySource(files, shuffle_buffer=32)
  a = values(src.batches(10, seed=3, repeat=False))
  b = values(src.batches(10, seed=3, repeat=False))
  c = values(src.batches(10, seed=4, repeat=False))
  assert a == b
  assert a != c
  assert sorted(a) == list(range(100)) and a != list(range(100))


def test_epochs_differ_and_each_is_complete(files):
  src = ToySource(files, shuffle_buffer=16)
  vals = values(pipeline.take(src.batches(20, seed=1), 10))   # two epochs of 100
  assert sorted(vals[:100]) == list(range(100))
  assert sorted(vals[100:]) == list(range(100))
  assert vals[:100] != vals[100:]


@pytest.mark.parametrize("shuffle_buffer,repeat", [(0, False), (16, True), (7, False)])
def test_resume_continues_exactly(files, shuffle_buffer, repeat):
  src = ToySource(files, shuffle_buffer=shuffle_buffer)
  full = values(pipeline.take(src.batches(12, seed=5, repeat=repeat), 20))
  for cut in (1, 3, 8, 9):
    it = src.batches(12, seed=5, repeat=repeat)
    head = values(pipeline.take(it, cut))
    state = json.loads(json.dumps(it.state()))      # must survive JSON
    tail = values(pipeline.take(src.batches(12, seed=5, repeat=repeat, state=state), 20 - cut))
    assert head + tail == full, cut


def test_resume_with_other_seed_is_refused(files):
  src = ToySource(files, shuffle_buffer=8)
  it = src.batches(10, seed=1)
  next(it)
  with pytest.raises(ValueError, match="seed"):
    src.batches(10, seed=2, state=it.state())


def test_processes_split_each_global_batch(files):
  src = ToySource(files, shuffle_buffer=16)
  whole = pipeline.take(src.batches(8, seed=2, repeat=False), 100)
  parts = [pipeline.take(src.batches(8, process_index=p, process_count=2, seed=2,
                                     repeat=False), 100) for p in range(2)]
  assert len(parts[0]) == len(parts[1]) == len(whole) == 13
  for w, a, b in zip(whole, *parts):
    np.testing.assert_array_equal(w["dense"], np.concatenate([a["dense"], b["dense"]]))
    np.testing.assert_array_equal(w["label_mask"],
                                  np.concatenate([a["label_mask"], b["label_mask"]]))
  with pytest.raises(ValueError, match="multiple"):
    src.batches(7, process_count=2)


def test_prefetcher_state_is_after_handed_out_batch(files):
  src = ToySource(files, shuffle_buffer=16)
  full = values(pipeline.take(src.batches(10, seed=7), 12))
  with pipeline.Prefetcher(src.batches(10, seed=7), size=3) as pf:
    head = values(pipeline.take(pf, 4))
    state = pf.state()
  assert state["shuffle"]["taken"] + 16 * state["shuffle"]["block"] == 40
  with pipeline.Prefetcher(src.batches(10, seed=7, state=state), size=2) as pf:
    tail = values(pipeline.take(pf, 8))
  assert head + tail == full


def test_prefetcher_ends_and_raises(files, tmp_path):
  src = ToySource(files)
  with pipeline.Prefetcher(src.batches(30, repeat=False)) as pf:
    assert len(list(pf)) == 4
    with pytest.raises(StopIteration):
      next(pf)
  bad = write(tmp_path / "bad.txt", [])
  (tmp_path / "bad.txt").write_bytes(b"x\n" * 50)
  with pipeline.Prefetcher(ToySource(bad).batches(10)) as pf:
    with pytest.raises(BadRowLimitError, match=r"rows are bad \(100.00%\)"):
      list(pf)                      # raised at the end of the first pass


def test_header_only_input_is_no_data_not_a_hang(tmp_path):
  class Headered(ToySource):
    is_header = staticmethod(lambda line: line.startswith(b"label"))

  p = tmp_path / "h.csv"
  p.write_bytes(b"label,value\n")
  with pytest.raises(NoDataError):
    next(Headered(str(p)).batches(4, repeat=True))


def test_global_batch_on_mesh(files, mesh8):
  src = ToySource(files)
  local = next(src.batches(16))
  g = pipeline.global_batch(local, pipeline.batch_sharding(mesh8))
  assert g["dense"].shape == (16, 1)
  assert len(g["dense"].sharding.device_set) == 8
  np.testing.assert_array_equal(np.asarray(g["dense"]), local["dense"])
  np.testing.assert_array_equal(np.asarray(g["labels"]), local["labels"])
  assert isinstance(g["label_mask"], jax.Array)
