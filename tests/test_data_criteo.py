"""Criteo reader: exact values on synthetic TSV, counts on the real sample.

The synthetic files and their truth come from tests/data_fixtures.py.
"""
import csv
import json
import math
import os

import numpy as np
import pytest
from data_fixtures import check_bad_rows, synth_data, valid_leaves  # noqa: F401

from gem_jax.data import pipeline
from gem_jax.data.criteo import CAT_NAMES, CriteoSource, criteo_spec, int_bucket
from gem_jax.data.spec import validate_batch


@pytest.fixture(scope="module")
def fx(synth_data):  # noqa: F811
  return synth_data.criteo


def want(rows):
  """The batch leaves the rows should give: labels, dense, ids (B, 26)."""
  dense = [[math.log1p(max(x, 0)) if x is not None else 0.0 for x in r.ints] for r in rows]
  ids = [[int(c, 16) if c else -1 for c in r.cats] for r in rows]
  return (np.array([r.label for r in rows], np.float32), np.array(dense, np.float32),
          np.array(ids, np.int64))


def assert_rows(got, rows):
  labels, dense, ids = want(rows)
  np.testing.assert_array_equal(got["/labels"][:, 0], labels)
  np.testing.assert_allclose(got["/dense"], dense, rtol=1e-6)
  for j, n in enumerate(CAT_NAMES):
    np.testing.assert_array_equal(got[f"/ids/{n}"][:, 0], ids[:, j], err_msg=n)


@pytest.fixture(scope="module")
def train_pass(fx):
  return list(CriteoSource(fx["train"]).batches(1000, repeat=False))


def test_parsed_values_and_padding(train_pass, fx):
  assert len(train_pass) == 2
  assert_rows(valid_leaves(train_pass), fx["train_rows"])
  b, last = train_pass
  assert b["ids"]["C1"].dtype == np.int64 and b["dense"].dtype == np.float32
  assert b["ids"]["C5"][3, 0] == int(fx["train_rows"][3].cats[4], 16)    # upper-case hex
  assert (b["dense"][5] == 0).all() and (b["ids"]["C26"][6] == -1).all()  # all missing
  assert b["dense"][7, 4] == np.float32(math.log1p(10 ** 17))
  assert (b["dense"][:, 1] == 0).sum() > 100                            # -1 and missing -> 0
  assert last["label_mask"][:, 0].tolist() == [1] * 600 + [0] * 400
  assert (last["ids"]["C1"][600:] == -1).all() and (last["dense"][600:] == 0).all()
  for x in train_pass:
    validate_batch(criteo_spec(), x, "criteo")


def test_int_buckets(fx):
  b = next(CriteoSource(fx["dev"], int_buckets=True).batches(400))
  validate_batch(criteo_spec(int_buckets=True), b, "criteo")
  for j in range(13):
    np.testing.assert_array_equal(b["ids"][f"B{j + 1}"][:, 0],
                                  [int_bucket(r.ints[j]) for r in fx["dev_rows"]])
  assert {0, 1, 2}.issubset(set(b["ids"]["B2"][:, 0].tolist()))         # missing, -1, 0
  assert [int_bucket(x) for x in (None, -3, 0, 2, 3, 10 ** 9)] == [0, 1, 2, 4, 6, 255]


def test_gzip_crlf_and_glob(fx):
  ref = valid_leaves(CriteoSource(fx["dev"]).batches(128, repeat=False))
  assert_rows(ref, fx["dev_rows"])
  for p in (fx["dev_gz"], fx["dev_crlf"]):
    got = valid_leaves(CriteoSource(p).batches(128, repeat=False))
    for k in ref:
      np.testing.assert_array_equal(got[k], ref[k], err_msg=f"{p} {k}")
  days = os.path.join(os.path.dirname(fx["dev"]), "day-*.gz")
  got = valid_leaves(CriteoSource(days).batches(512, repeat=False))
  assert_rows(got, fx["day_rows"])                                     # day-0 then day-1


def test_bad_rows_exact(fx):
  bad = fx["bad"]
  it = CriteoSource(bad.path, bad_row_limit=0.1).batches(64, repeat=False)
  assert_rows(valid_leaves(it), bad.rows)
  check_bad_rows(it, bad)


def test_same_order_for_seed_and_exact_resume(fx):
  src = CriteoSource(fx["train"], shuffle_buffer=500)
  ref = [b["ids"]["C3"][:, 0].copy() for b in pipeline.take(src.batches(256, seed=11), 10)]
  again = [b["ids"]["C3"][:, 0] for b in pipeline.take(src.batches(256, seed=11), 10)]
  for a, b in zip(ref, again):
    np.testing.assert_array_equal(a, b)
  first = np.concatenate(ref)[:1600]                                   # one epoch, shuffled
  assert sorted(first.tolist()) == sorted(want(fx["train_rows"])[2][:, 2].tolist())
  assert not np.array_equal(first, want(fx["train_rows"])[2][:, 2])
  it = src.batches(256, seed=11)
  pipeline.take(it, 7)                                      # crosses the epoch end (1600 rows)
  state = json.loads(json.dumps(it.state()))
  with pipeline.Prefetcher(src.batches(256, seed=11, state=state)) as pf:
    for w in ref[7:]:
      np.testing.assert_array_equal(next(pf)["ids"]["C3"][:, 0], w)


# -- the real Kaggle sample: what only it can show ----------------------------------------
@pytest.mark.parametrize("split,rows,positives", [("train", 7200, 1549), ("dev", 409, 93)])
def test_real_sample_counts_and_no_bad_rows(real_data_dir, split, rows, positives):
  path = os.path.join(real_data_dir, f"criteo_kaggle_8k_{split}.tsv")
  it = CriteoSource(path).batches(1024, repeat=False)
  got = valid_leaves(it)
  assert it.state()["bad_rows"] == {"rows": rows, "bad": 0, "reports": []}
  assert len(got["/labels"]) == rows and int(got["/labels"].sum()) == positives
  with open(path, newline="") as f:
    head = list(csv.reader(f, delimiter="\t"))[:500]
  for j in (0, 11, 25):                                # C12 and C26 have empty fields
    np.testing.assert_array_equal(got[f"/ids/{CAT_NAMES[j]}"][:500, 0],
                                  [int(r[14 + j], 16) if r[14 + j] else -1 for r in head])
  assert (got["/ids/C12"] == -1).any()
