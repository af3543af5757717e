"""Avazu reader on the shared sample: header handling, counts, domains, parsed values."""
import csv
import datetime
import json
import os

import numpy as np
import pytest

from gem_jax.data import pipeline
from gem_jax.data.avazu import AvazuSource, avazu_spec
from gem_jax.data.spec import validate_batch


def read_csv(path):
  with open(path, newline="") as f:
    rows = list(csv.reader(f))
  return rows[1:] if rows[0][0] == "id" else rows


@pytest.fixture(scope="module")
def paths(real_data_dir):
  return {s: os.path.join(real_data_dir, f"avazu_9k_{s}.csv") for s in ("train", "dev")}


@pytest.fixture(scope="module")
def train_pass(paths):
  return list(AvazuSource(paths["train"]).batches(1024, repeat=False))


def valid(batches, get):
  return np.concatenate([get(b)[b["label_mask"][:, 0] > 0] for b in batches])


def test_counts_and_domains_match_file(train_pass, paths):
  rows = read_csv(paths["train"])
  assert sum(int(b["label_mask"].sum()) for b in train_pass) == len(rows)
  labels = valid(train_pass, lambda b: b["labels"][:, 0])
  domain = valid(train_pass, lambda b: b["domain"])
  want_app = np.array([r[5] == "85f751fd" for r in rows])
  want_click = np.array([r[1] == "1" for r in rows])
  assert labels.sum() == want_click.sum()
  np.testing.assert_array_equal(domain, want_app.astype(np.int32))
  assert labels[domain == 1].sum() == want_click[want_app].sum()


def test_headerless_dev_split(paths):
  bs = list(AvazuSource(paths["dev"]).batches(100, repeat=False))
  rows = read_csv(paths["dev"])
  assert sum(int(b["label_mask"].sum()) for b in bs) == len(rows)
  np.testing.assert_array_equal(bs[0]["ids"]["device_ip"][:, 0],
                                [int(r[12], 16) for r in rows[:100]])


def test_parsed_values(train_pass, paths):
  rows = read_csv(paths["train"])[:1024]
  b = train_pass[0]
  validate_batch(avazu_spec(), b, "avazu")
  hod = [int(r[2][6:8]) for r in rows]
  dow = [datetime.date(2000 + int(r[2][:2]), int(r[2][2:4]), int(r[2][4:6])).weekday()
         for r in rows]
  np.testing.assert_array_equal(b["ids"]["hour_of_day"][:, 0], hod)
  np.testing.assert_array_equal(b["ids"]["day_of_week"][:, 0], dow)
  np.testing.assert_allclose(b["dense"][:, 1], np.cos(2 * np.pi * np.array(hod) / 24), atol=1e-7)
  np.testing.assert_array_equal(b["ids"]["site_id"][:, 0], [int(r[5], 16) for r in rows])
  zz = lambda v: 2 * v if v >= 0 else -2 * v - 1
  np.testing.assert_array_equal(b["ids"]["C20"][:, 0], [zz(int(r[22])) for r in rows])
  assert (b["ids"]["C20"][:, 0] == 1).any()            # C20 == -1 occurs and maps to 1


def test_order_and_resume(paths):
  src = AvazuSource(paths["train"], shuffle_buffer=2048)
  get = lambda bs: np.concatenate([b["ids"]["device_ip"][:, 0] for b in bs])
  ref = get(pipeline.take(src.batches(512, seed=3), 20))
  np.testing.assert_array_equal(get(pipeline.take(src.batches(512, seed=3), 20)), ref)
  it = src.batches(512, seed=3)
  head = get(pipeline.take(it, 7))
  state = json.loads(json.dumps(it.state()))
  tail = get(pipeline.take(src.batches(512, seed=3, state=state), 13))
  np.testing.assert_array_equal(np.concatenate([head, tail]), ref)
