"""Criteo reader on the shared Kaggle sample: counts, parsed values, order, resume."""
import csv
import gzip
import json
import math
import os

import numpy as np
import pytest

from gem_jax.data import pipeline
from gem_jax.data.criteo import CAT_NAMES, CriteoSource, criteo_spec, int_bucket
from gem_jax.data.spec import validate_batch


@pytest.fixture(scope="module")
def train_path(real_data_dir):
  return os.path.join(real_data_dir, "criteo_kaggle_8k_train.tsv")


@pytest.fixture(scope="module")
def dev_path(real_data_dir):
  return os.path.join(real_data_dir, "criteo_kaggle_8k_dev.tsv")


def read_tsv(path):
  with open(path, newline="") as f:
    return list(csv.reader(f, delimiter="\t"))


def masked(batches, key="labels"):
  return np.concatenate([b[key][b["label_mask"][:, 0] > 0] for b in batches])


@pytest.fixture(scope="module")
def train_pass(train_path):
  return list(CriteoSource(train_path).batches(1000, repeat=False))


def test_counts_match_file(train_pass, train_path):
  rows = read_tsv(train_path)
  assert sum(int(b["label_mask"].sum()) for b in train_pass) == len(rows)
  assert int(masked(train_pass).sum()) == sum(r[0] == "1" for r in rows)
  assert len(train_pass) == math.ceil(len(rows) / 1000)


def test_parsed_values_match_file(train_pass, train_path):
  rows = read_tsv(train_path)[:1000]
  b = train_pass[0]
  want_dense = [[math.log1p(max(int(x), 0)) if x else 0.0 for x in r[1:14]] for r in rows]
  np.testing.assert_allclose(b["dense"], want_dense, rtol=1e-6)
  for j in (0, 2, 11, 25):              # some with missing values (C12, C26 have empties)
    want = [int(r[14 + j], 16) if r[14 + j] else -1 for r in rows]
    np.testing.assert_array_equal(b["ids"][CAT_NAMES[j]][:, 0], want)
  assert (b["ids"]["C12"] == -1).any()
  np.testing.assert_array_equal(b["labels"][:, 0], [float(r[0]) for r in rows])
  assert b["ids"]["C1"].dtype == np.int64 and b["dense"].dtype == np.float32


def test_batch_follows_spec(train_pass):
  for b in (train_pass[0], train_pass[-1]):
    validate_batch(criteo_spec(), b, "criteo")
  last = train_pass[-1]
  assert last["label_mask"][:, 0].tolist() == [1] * 200 + [0] * 800
  assert (last["ids"]["C1"][200:] == -1).all() and (last["dense"][200:] == 0).all()


def test_int_buckets(dev_path):
  b = next(CriteoSource(dev_path, int_buckets=True).batches(50))
  rows = read_tsv(dev_path)[:50]
  want = [int_bucket(int(r[1]) if r[1] else None) for r in rows]
  np.testing.assert_array_equal(b["ids"]["B1"][:, 0], want)
  assert [int_bucket(x) for x in (None, -3, 0, 2, 3, 10 ** 9)] == [0, 1, 2, 4, 6, 255]


def test_glob_and_gzip_files(tmp_path, train_path, dev_path):
  with open(dev_path, "rb") as f:
    (tmp_path / "part-1.tsv.gz").write_bytes(gzip.compress(f.read()))
  with open(train_path, "rb") as f:
    (tmp_path / "part-0.tsv").write_bytes(f.read())
  bs = list(CriteoSource(str(tmp_path / "part-*")).batches(2048, repeat=False))
  n_train, n_dev = len(read_tsv(train_path)), len(read_tsv(dev_path))
  assert sum(int(b["label_mask"].sum()) for b in bs) == n_train + n_dev
  want_last = int(read_tsv(dev_path)[-1][14], 16)
  got = np.concatenate([b["ids"]["C1"][b["label_mask"][:, 0] > 0, 0] for b in bs])
  assert got[-1] == want_last


def test_same_order_for_seed_and_exact_resume(train_path):
  src = CriteoSource(train_path, shuffle_buffer=1000)
  ref = [b["ids"]["C3"][:, 0].copy() for b in pipeline.take(src.batches(256, seed=11), 32)]
  again = [b["ids"]["C3"][:, 0] for b in pipeline.take(src.batches(256, seed=11), 32)]
  for a, b in zip(ref, again):
    np.testing.assert_array_equal(a, b)
  it = src.batches(256, seed=11)
  pipeline.take(it, 29)                                     # crosses the epoch end (7200 rows)
  state = json.loads(json.dumps(it.state()))
  with pipeline.Prefetcher(src.batches(256, seed=11, state=state)) as pf:
    for want in ref[29:]:
      np.testing.assert_array_equal(next(pf)["ids"]["C3"][:, 0], want)
