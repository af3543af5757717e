"""Avazu reader: exact values on synthetic CSV, counts on the real sample.

The synthetic files and their truth come from tests/data_fixtures.py.
"""
import datetime
import json
import os

import numpy as np
import pytest
from data_fixtures import check_bad_rows, synth_data, valid_leaves  # noqa: F401

import pyarrow as pa

from gem_jax.data import blocks, pipeline, text
from gem_jax.data.badrows import BadRow
from gem_jax.data.avazu import COLUMNS, HEX_COLUMNS, ID_COLUMNS, AvazuSource, avazu_spec
from gem_jax.data.spec import validate_batch


@pytest.fixture(scope="module")
def fx(synth_data):  # noqa: F811
  return synth_data.avazu


def zigzag(v):
  return 2 * v if v >= 0 else -2 * v - 1


def assert_rows(got, rows):
  """Every leaf of the valid rows against the rows as written (lists of 24 strings)."""
  np.testing.assert_array_equal(got["/labels"][:, 0], [int(r[1]) for r in rows])
  np.testing.assert_array_equal(got["/domain"], [int(r[5] == "85f751fd") for r in rows])
  hod = np.array([int(r[2][6:]) for r in rows])
  dow = [datetime.date(2000 + int(r[2][:2]), int(r[2][2:4]), int(r[2][4:6])).weekday()
         for r in rows]
  np.testing.assert_array_equal(got["/ids/hour_of_day"][:, 0], hod)
  np.testing.assert_array_equal(got["/ids/day_of_week"][:, 0], dow)
  np.testing.assert_allclose(got["/dense"], np.stack([np.sin(2 * np.pi * hod / 24),
                                                      np.cos(2 * np.pi * hod / 24)], -1),
                             atol=1e-7)
  for c in ID_COLUMNS:
    j = COLUMNS.index(c)
    w = [int(r[j], 16) if c in HEX_COLUMNS else zigzag(int(r[j])) for r in rows]
    np.testing.assert_array_equal(got[f"/ids/{c}"][:, 0], w, err_msg=c)


def test_train_with_header(fx):
  bs = list(AvazuSource(fx["train"]).batches(512, repeat=False))
  assert len(bs) == 3 and int(bs[-1]["label_mask"].sum()) == 1200 - 1024
  got = valid_leaves(bs)
  assert_rows(got, fx["train_rows"])
  assert len(set(got["/ids/day_of_week"][:, 0].tolist())) == 7
  assert len(set(got["/ids/hour_of_day"][:, 0].tolist())) == 24
  assert 1 in got["/ids/C20"][:, 0] and 0 < got["/domain"].mean() < 1   # C20 -1 -> 1; both domains
  for b in bs:
    validate_batch(avazu_spec(), b, "avazu")


def test_headerless_dev_split(fx):
  it = AvazuSource(fx["dev"]).batches(100, repeat=False)
  assert_rows(valid_leaves(it), fx["dev_rows"])
  assert it.state()["bad_rows"]["rows"] == 300


def test_bad_rows_exact(fx):
  bad = fx["bad"]
  it = AvazuSource(bad.path, bad_row_limit=0.1).batches(64, repeat=False)
  assert_rows(valid_leaves(it), bad.rows)
  check_bad_rows(it, bad)


def test_hex_ids_at_the_int64_edge(fx, tmp_path):
  """16-digit hex ids >= 2^63 do not fit the int64 raw id: a bad row naming the field and
  value (they used to lose their top bit and merge with another id); 2^63 - 1 is exact."""
  assert text.parse_hex(b"7fffffffffffffff", "f") == 2**63 - 1
  with pytest.raises(BadRow, match=r"f: hex id 8000000000000000 is >= 2\^63"):
    text.parse_hex(b"8000000000000000", "f")
  ids, _ = blocks.hex_column(pa.array([b"7fffffffffffffff", b"1", b""], pa.binary()))
  assert ids.tolist() == [2**63 - 1, 1, -1]
  assert blocks.hex_column(pa.array([b"8000000000000000", b"1"], pa.binary())) is None
  good, top = list(fx["dev_rows"][0]), list(fx["dev_rows"][1])
  top[COLUMNS.index("site_id")] = "ffffffffffffffff"
  path = tmp_path / "dev.csv"
  path.write_text("\n".join(",".join(r) for r in (good, top)) + "\n")
  it = AvazuSource(str(path), bad_row_limit=0.6).batches(4, repeat=False)
  assert_rows(valid_leaves(it), [good])
  st = it.state()["bad_rows"]
  assert (st["bad"], st["rows"]) == (1, 2)
  assert st["reports"] == [f"{path}:2: site_id: hex id ffffffffffffffff is >= 2^63 "
                           "(raw ids are int64)"]


def test_order_and_resume(fx):
  src = AvazuSource(fx["train"], shuffle_buffer=400)
  get = lambda bs: np.concatenate([b["ids"]["device_ip"][:, 0] for b in bs])
  ref = get(pipeline.take(src.batches(256, seed=3), 8))
  np.testing.assert_array_equal(get(pipeline.take(src.batches(256, seed=3), 8)), ref)
  ips = [int(r[12], 16) for r in fx["train_rows"]]
  assert sorted(ref[:1200].tolist()) == sorted(ips) and ref[:1200].tolist() != ips
  it = src.batches(256, seed=3)
  head = get(pipeline.take(it, 3))
  state = json.loads(json.dumps(it.state()))
  tail = get(pipeline.take(src.batches(256, seed=3, state=state), 5))   # crosses the epoch end
  np.testing.assert_array_equal(np.concatenate([head, tail]), ref)


# -- the real Kaggle sample: what only it can show ----------------------------------------
@pytest.mark.parametrize("split,rows,clicks", [("train", 8087, 1397), ("dev", 480, 86)])
def test_real_sample_counts_and_no_bad_rows(real_data_dir, split, rows, clicks):
  it = AvazuSource(os.path.join(real_data_dir, f"avazu_9k_{split}.csv")).batches(1024,
                                                                                repeat=False)
  got = valid_leaves(it)
  assert it.state()["bad_rows"] == {"rows": rows, "bad": 0, "reports": []}
  assert len(got["/labels"]) == rows and int(got["/labels"].sum()) == clicks
  assert set(got["/ids/hour_of_day"][:, 0].tolist()) == {0}    # one hour: 14102100
  assert set(got["/ids/day_of_week"][:, 0].tolist()) == {1}    # 2014-10-21, a Tuesday
  assert 0 < got["/domain"].mean() < 1
