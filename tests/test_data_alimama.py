"""Alimama DMR reader: exact sequences on synthetic rows, counts on the real sample.

The synthetic files and their truth come from tests/data_fixtures.py.
"""
import os

import numpy as np
import pytest
from data_fixtures import check_bad_rows, synth_data, valid_leaves  # noqa: F401

from gem_jax.data.alimama import ONE_HOT, AlimamaSource, alimama_spec
from gem_jax.data.spec import validate_batch


@pytest.fixture(scope="module")
def fx(synth_data):  # noqa: F811
  return synth_data.alimama


def assert_rows(got, rows):
  """Valid rows against the written rows (267 values each)."""
  np.testing.assert_array_equal(got["/labels"][:, 0], [r[266] for r in rows])
  np.testing.assert_array_equal(got["/domain"], [r[265] for r in rows])
  np.testing.assert_array_equal(got["/dense"][:, 0], np.float32([r[264] for r in rows]))
  for j, n in enumerate(ONE_HOT):
    np.testing.assert_array_equal(got[f"/ids/{n}"][:, 0], [r[250 + j] for r in rows], err_msg=n)
  seq = {k[len("/seq/behavior/"):]: v for k, v in got.items() if k.startswith("/seq/")}
  for i, r in enumerate(rows):
    valid = [j for j in range(50) if r[150 + j] == 1][::-1]          # most recent first
    n = len(valid)
    assert seq["len"][i] == n
    pad = [-1] * (50 - n)
    np.testing.assert_array_equal(got["/ids/his_cate"][i], [r[50 + j] for j in valid] + pad)
    np.testing.assert_array_equal(got["/ids/his_brand"][i], [r[100 + j] for j in valid] + pad)
    np.testing.assert_array_equal(seq["action"][i], [r[j] for j in valid] + [0] * (50 - n))
  assert (seq["surface"] == 0).all() and (seq["dt"] == 0).all()


def test_values_and_sequences(fx):
  bs = list(AlimamaSource(fx["train"]).batches(128, repeat=False))
  assert [int(b["label_mask"].sum()) for b in bs] == [128, 128, 44]
  for b in bs:
    validate_batch(alimama_spec(), b, "alimama")
  got = valid_leaves(bs)
  assert_rows(got, fx["rows"])
  assert got["/seq/behavior/len"][:2].tolist() == [0, 50]             # empty and full history
  assert got["/dense"][2, 0] == 1.0


def test_bad_rows_exact(fx):
  bad = fx["bad"]
  it = AlimamaSource(bad.path, bad_row_limit=0.1).batches(64, repeat=False)
  assert_rows(valid_leaves(it), bad.rows)
  check_bad_rows(it, bad)


def test_shared_vocab():
  src_vocab = AlimamaSource.shared_vocab.fget(None)
  spec = alimama_spec(1000)
  for f, shared in src_vocab.items():
    assert spec.feature(f).vocab == spec.feature(shared).vocab == 1000


# -- the real sample: what only it can show -------------------------------------------------
def test_real_sample_counts_and_no_bad_rows(real_data_dir):
  it = AlimamaSource(os.path.join(real_data_dir, "alimama_display_dmr_500.csv")).batches(
      128, repeat=False)
  got = valid_leaves(it)
  assert it.state()["bad_rows"] == {"rows": 500, "bad": 0, "reports": []}
  assert int(got["/labels"].sum()) == 210
  assert len(set(got["/ids/uid"][:, 0].tolist())) == 230
  lens = got["/seq/behavior/len"]
  assert lens.min() >= 1 and (lens < 50).any()                  # mask[49] = 1 in every row
  assert set(got["/domain"].tolist()) == {0, 1}
