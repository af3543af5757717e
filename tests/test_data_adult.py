"""UCI adult two-task reader: exact values on synthetic files, counts on the real ones.

The synthetic files and their truth come from tests/data_fixtures.py.
"""
import json
import math
import os

import numpy as np
import pytest
from data_fixtures import check_bad_rows, synth_data, valid_leaves  # noqa: F401

from gem_jax.data import pipeline
from gem_jax.data.adult import COLUMNS, DENSE, SPARSE, AdultSource, adult_spec
from gem_jax.data.spec import validate_batch
from gem_jax.data.text import string_id


@pytest.fixture(scope="module")
def fx(synth_data):  # noqa: F811
  return synth_data.adult


def assert_rows(got, rows):
  """Valid rows against the written rows (15 values each, label without '.')."""
  np.testing.assert_array_equal(got["/labels"], [[r[14] == ">50K", r[5] == "Never-married"]
                                                 for r in rows])
  np.testing.assert_array_equal(got["/label_mask"], np.ones((len(rows), 2)))
  want = [[fn(r[COLUMNS.index(c)]) for c, fn in DENSE.items()] for r in rows]
  np.testing.assert_allclose(got["/dense"], want, rtol=1e-6)
  for n in SPARSE:
    j = COLUMNS.index(n)
    w = [-1 if r[j] == "?" else string_id(r[j].encode()) for r in rows]
    np.testing.assert_array_equal(got[f"/ids/{n}"][:, 0], w, err_msg=n)


@pytest.mark.parametrize("split", ["train", "test"])
def test_values(fx, split):
  it = AdultSource(fx[split]).batches(128, repeat=False)
  bs = list(it)
  for b in bs:
    validate_batch(adult_spec(), b, "adult")
  got = valid_leaves(bs)
  assert_rows(got, fx[f"{split}_rows"])
  assert (got["/ids/occupation"] == -1).any() and (got["/ids/native_country"] == -1).any()
  assert len(np.unique(got["/ids/sex"])) == 2
  st = it.state()["bad_rows"]
  if split == "train":                                # no final newline: the last row counts
    assert st == {"rows": 500, "bad": 0, "reports": []}
  else:                                               # UCI's '|1x3 Cross validator' first line
    assert st["rows"] == 251 and st["bad"] == 1
    assert st["reports"] == [f"{fx['test']}:1: expected 15 fields separated by b',', got 1"]


def test_bad_rows_exact(fx):
  bad = fx["bad"]
  it = AdultSource(bad.path, bad_row_limit=0.1).batches(64, repeat=False)
  assert_rows(valid_leaves(it), bad.rows)
  check_bad_rows(it, bad)


def test_resume(fx):
  src = AdultSource(fx["train"], shuffle_buffer=200)
  get = lambda bs: np.concatenate([b["dense"][:, 2] for b in bs])
  ref = get(pipeline.take(src.batches(64, seed=0), 12))
  want = [r[4] / 16 for r in fx["train_rows"]]
  assert sorted(ref[:500].tolist()) == pytest.approx(sorted(want))
  it = src.batches(64, seed=0)
  head = get(pipeline.take(it, 5))
  tail = get(pipeline.take(src.batches(64, seed=0, state=json.loads(json.dumps(it.state()))), 7))
  np.testing.assert_array_equal(np.concatenate([head, tail]), ref)


# -- the real UCI files: what only they can show ---------------------------------------------
@pytest.mark.parametrize("split,rows,rich,never", [("train", 32561, 7841, 10683),
                                                   ("test", 16281, 3846, None)])
def test_real_counts_and_no_bad_rows(real_data_dir, split, rows, rich, never):
  it = AdultSource(os.path.join(real_data_dir, f"uci_adult_{split}.csv")).batches(
      8192, repeat=False)
  got = valid_leaves(it)
  assert it.state()["bad_rows"] == {"rows": rows, "bad": 0, "reports": []}
  assert int(got["/labels"][:, 0].sum()) == rich
  if never is not None:
    assert int(got["/labels"][:, 1].sum()) == never
  assert math.isclose(float(got["/dense"][:, 0].min()), 0.17, rel_tol=1e-6)    # youngest: 17
