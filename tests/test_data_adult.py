"""UCI adult two-task reader on the shared files: counts of both labels, parsed values."""
import csv
import json
import math
import os

import numpy as np
import pytest

from gem_jax.data import pipeline
from gem_jax.data.adult import AdultSource, adult_spec
from gem_jax.data.spec import validate_batch


def read(path):
  with open(path, newline="") as f:
    return [[t.strip() for t in r] for r in csv.reader(f) if r]


@pytest.fixture(scope="module", params=["train", "test"])
def split(request, real_data_dir):
  path = os.path.join(real_data_dir, f"uci_adult_{request.param}.csv")
  return path, list(AdultSource(path).batches(4096, repeat=False))


def test_counts_match_file(split):
  path, bs = split
  rows = read(path)
  m = np.concatenate([b["label_mask"][:, 0] for b in bs]) > 0
  labels = np.concatenate([b["labels"] for b in bs])[m]
  assert m.sum() == len(rows)
  assert labels[:, 0].sum() == sum(r[14].startswith(">50K") for r in rows)
  assert labels[:, 1].sum() == sum(r[5] == "Never-married" for r in rows)
  np.testing.assert_array_equal(np.concatenate([b["label_mask"] for b in bs])[:, 1], m)


def test_parsed_values(split):
  path, bs = split
  rows = read(path)[:4096]
  b = bs[0]
  validate_batch(adult_spec(), b, "adult")
  np.testing.assert_allclose(b["dense"][:, 0], [int(r[0]) / 100 for r in rows], rtol=1e-6)
  np.testing.assert_allclose(b["dense"][:, 3], [math.log1p(int(r[10])) / 12 for r in rows],
                             rtol=1e-6)
  missing = np.array([r[6] == "?" for r in rows])
  assert missing.any()
  np.testing.assert_array_equal(b["ids"]["occupation"][:, 0] == -1, missing)
  sexes = {r[9] for r in rows}
  assert len(np.unique(b["ids"]["sex"][:, 0])) == len(sexes) == 2


def test_resume(real_data_dir):
  src = AdultSource(os.path.join(real_data_dir, "uci_adult_train.csv"), shuffle_buffer=5000)
  get = lambda bs: np.concatenate([b["dense"][:, 2] for b in bs])
  ref = get(pipeline.take(src.batches(1000, seed=0), 40))
  it = src.batches(1000, seed=0)
  head = get(pipeline.take(it, 33))
  tail = get(pipeline.take(src.batches(1000, seed=0, state=json.loads(json.dumps(it.state()))), 7))
  np.testing.assert_array_equal(np.concatenate([head, tail]), ref)
