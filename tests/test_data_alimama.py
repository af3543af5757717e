"""Alimama DMR-format reader on the shared sample: counts, sequence layout, profile ids."""
import csv
import os

import numpy as np
import pytest

from gem_jax.data.alimama import AlimamaSource, alimama_spec
from gem_jax.data.spec import validate_batch


@pytest.fixture(scope="module")
def data(real_data_dir):
  path = os.path.join(real_data_dir, "alimama_display_dmr_500.csv")
  with open(path, newline="") as f:
    rows = [[float(x) if "." in x else int(x) for x in r] for r in csv.reader(f)]
  return rows, list(AlimamaSource(path).batches(128, repeat=False))


def test_counts_and_labels(data):
  rows, bs = data
  m = np.concatenate([b["label_mask"][:, 0] for b in bs]) > 0
  labels = np.concatenate([b["labels"][:, 0] for b in bs])[m]
  assert m.sum() == len(rows) == 500
  np.testing.assert_array_equal(labels, [r[266] for r in rows])
  np.testing.assert_array_equal(np.concatenate([b["domain"] for b in bs])[m],
                                [r[265] for r in rows])


def test_sequences_most_recent_first(data):
  rows, bs = data
  b = bs[0]
  validate_batch(alimama_spec(), b, "alimama")
  seq = b["seq"]["behavior"]
  for i, r in enumerate(rows[:128]):
    valid = [j for j in range(50) if r[150 + j] == 1]
    n = len(valid)
    assert seq["len"][i] == n
    want_cate = [r[50 + j] for j in reversed(valid)] + [-1] * (50 - n)
    np.testing.assert_array_equal(b["ids"]["his_cate"][i], want_cate)
    np.testing.assert_array_equal(b["ids"]["his_brand"][i, :n], [r[100 + j] for j in reversed(valid)])
    np.testing.assert_array_equal(seq["action"][i, :n], [r[j] for j in reversed(valid)])
    assert (seq["action"][i, n:] == 0).all()
  assert (seq["len"] < 50).any()                        # some histories are padded
  np.testing.assert_array_equal(b["ids"]["uid"][:, 0], [r[250] for r in rows[:128]])
  np.testing.assert_array_equal(b["ids"]["brand"][:, 0], [r[263] for r in rows[:128]])
  np.testing.assert_allclose(b["dense"][:, 0], [r[264] for r in rows[:128]], rtol=1e-6)
