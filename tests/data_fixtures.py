"""Synthetic files in every raw format gem_jax.data reads, with the values they hold.

`synth_data` (session fixture) writes them once under a tmp dir and returns a
`Fixtures`: per format the file paths and the truth (the rows as written, in
file order), so tests can assert exact parsed values, bad-row counts and
`file:line` reports. Every value is drawn from a seeded rng; nothing comes from
the real samples (only the public column layouts and category names are shared).

Clean files carry a planted signal (the label depends on a few features through
a logistic model), so a model trained on them can beat chance. The `bad` files
are clean rows with damaged lines at known line numbers (`Bad.lines`), one huge
line, and a truncated last line without a newline.

Import the fixture into a test module with `from data_fixtures import synth_data`.
"""
from __future__ import annotations

import dataclasses
import gzip
import os
import re

import numpy as np
import pytest


def sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def hexes(rng, n: int) -> list[str]:
  """n distinct 8-hex-digit (32-bit) hashes."""
  vals = rng.choice(1 << 32, size=n, replace=False)
  return [f"{int(v):08x}" for v in vals]


@dataclasses.dataclass
class Bad:
  """A damaged file: `rows` are its good rows (in order), `lines` {1-based line: reason regex}."""
  path: str
  rows: list = dataclasses.field(repr=False)
  lines: dict = dataclasses.field(repr=False)


def write_lines(path: str, lines: list[str | bytes], *, eol: bytes = b"\n",
                final_eol: bool = True, gz: bool = False) -> str:
  data = eol.join(x if isinstance(x, bytes) else x.encode() for x in lines)
  if final_eol:
    data += eol
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "wb") as f:
    f.write(gzip.compress(data, mtime=0) if gz else data)
  return path


def damage(good: list[str], bad: list[tuple[int, bytes | str, str]], truncated_last: str):
  """Lines of `good` with `bad` (0-based index into the result, line, reason) inserted,
  and a last line `truncated_last` without newline. -> (lines, {line_no: reason})."""
  lines, reasons = list(good), {}
  for i, line, reason in sorted(bad):
    lines.insert(i, line)
    reasons[i + 1] = reason
  lines.append(truncated_last)
  reasons[len(lines)] = "expected .* fields"
  return lines, reasons


# -- Criteo ----------------------------------------------------------------------------
# label \t I1..I13 \t C1..C26; empty = missing; I2 takes -1; C = 8 hex digits.
CRITEO_VOCAB = (40, 60, 500, 200, 8, 10, 300, 30, 3, 400, 100, 600, 80, 20, 300, 400, 10,
                100, 50, 4, 500, 12, 15, 300, 40, 200)
CRITEO_MISSING_C = {11: 0.3, 18: 0.4, 19: 0.4, 21: 0.7, 24: 0.4, 25: 0.4}   # 0-based C index


@dataclasses.dataclass
class CriteoRow:
  label: int
  ints: list          # 13 of int | None
  cats: list          # 26 of 8-hex str | None

  def line(self) -> str:
    return "\t".join([str(self.label)] + ["" if x is None else str(x) for x in self.ints]
                     + ["" if c is None else c for c in self.cats])


class CriteoGen:
  """Criteo rows with clicks planted on C1, C2 and I1 (one vocab, several splits)."""

  def __init__(self, seed: int = 0):
    rng = np.random.default_rng(seed)
    self.vocab = [hexes(rng, v) for v in CRITEO_VOCAB]
    self.w_c1 = rng.normal(0, 1.5, CRITEO_VOCAB[0])
    self.w_c2 = rng.normal(0, 1.0, CRITEO_VOCAB[1])

  def rows(self, n: int, seed: int) -> list[CriteoRow]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
      ints = []
      for j in range(13):
        r = rng.random()
        if r < 0.15:
          ints.append(None)
        elif j == 1 and r < 0.25:
          ints.append(-1)
        else:
          ints.append(int(rng.geometric(0.02 if j % 3 else 0.2)) - 1
                      if j != 4 else int(rng.integers(0, 2_000_000)))
      k = [int(rng.integers(len(v))) for v in self.vocab]
      cats = [None if rng.random() < CRITEO_MISSING_C.get(j, 0.02) else self.vocab[j][k[j]]
              for j in range(26)]
      i1 = ints[0] if ints[0] is not None else 0
      logit = self.w_c1[k[0]] + self.w_c2[k[1]] + 1.2 * (np.log1p(i1) - 1.0) - 1.0
      cats[0], cats[1] = self.vocab[0][k[0]], self.vocab[1][k[1]]   # the signal: never missing
      out.append(CriteoRow(int(rng.random() < sigmoid(logit)), ints, cats))
    return out


def write_criteo(root: str) -> dict:
  gen = CriteoGen(0)
  d = os.path.join(root, "criteo")
  train, dev = gen.rows(1600, 1), gen.rows(400, 2)
  train[3].cats[4] = gen.vocab[4][0].upper()                   # hex digits in upper case
  train[5].ints = [None] * 13                                  # every integer missing
  train[6].cats[2:] = [None] * 24                              # most categoricals missing
  train[7].ints[4] = 10 ** 17                                  # 18 digits: still an integer
  out = {"train_rows": train, "dev_rows": dev,
         "train": write_lines(f"{d}/train.tsv", [r.line() for r in train]),
         "dev": write_lines(f"{d}/dev.tsv", [r.line() for r in dev]),
         "dev_gz": write_lines(f"{d}/dev.tsv.gz", [r.line() for r in dev], gz=True),
         "dev_crlf": write_lines(f"{d}/dev_crlf.tsv", [r.line() for r in dev], eol=b"\r\n"),
         "day_rows": gen.rows(3000, 4)}         # test_data_train_criteo trains on these
  out["days"] = [write_lines(f"{d}/day-{i}.tsv.gz",
                             [r.line() for r in out["day_rows"][1500 * i:][:1500]], gz=True)
                 for i in range(2)]
  good_rows = gen.rows(200, 3)
  good = [r.line() for r in good_rows]
  f = good[0].split("\t")
  row = lambda **kv: "\t".join(kv.get(f"f{i}", t) for i, t in enumerate(f))
  bad = [(10, "\t".join(f[:39]), "expected 40 fields .* got 39$"),
         (20, good[0] + "\t0", "expected 40 fields .* got 41$"),
         (30, row(f0="2"), "label: expected 0 or 1, got b'2'"),
         (40, row(f1="abc"), "I1: non-integer b'abc'"),
         (50, row(f3="1.5"), "I3: non-integer b'1.5'"),
         (60, row(f5=" 7"), "I5: non-integer b' 7'"),
         (70, row(f14="abcdef1"), "C1: malformed categorical b'abcdef1'"),
         (80, row(f20="zzzzzzzz"), "C7: malformed categorical b'zzzzzzzz'"),
         (90, row(f39="0123456789"), "C26: malformed categorical b'0123456789'"),
         (100, b"1\t" + b"\xff\xfe" * 500_000, "expected 40 fields .* got 2$"),  # a 1 MB line
         (110, good[0].replace("\t", ","), "expected 40 fields .* got 1$")]
  lines, reasons = damage(good, bad, good[0][:len(good[0]) // 2])
  out["bad"] = Bad(write_lines(f"{d}/bad.tsv", lines, final_eol=False), good_rows, reasons)
  return out


# -- Avazu -----------------------------------------------------------------------------
AVAZU_HEADER = ("id,click,hour,C1,banner_pos,site_id,site_domain,site_category,app_id,"
                "app_domain,app_category,device_id,device_ip,device_model,device_type,"
                "device_conn_type,C14,C15,C16,C17,C18,C19,C20,C21")
APP_SITE = "85f751fd"


class AvazuGen:
  """Avazu rows over 10 days x 24 hours; clicks planted on hour, banner_pos and app traffic."""

  def __init__(self, seed: int = 10):
    rng = np.random.default_rng(seed)
    self.v = {c: hexes(rng, n) for c, n in (
        ("site_id", 30), ("site_domain", 30), ("site_category", 12), ("app_id", 40),
        ("app_domain", 20), ("app_category", 15), ("device_id", 300), ("device_ip", 2000),
        ("device_model", 200))}
    self.v["site_id"][0] = APP_SITE
    self.w_banner = rng.normal(0, 0.8, 8)

  def rows(self, n: int, seed: int) -> list[list[str]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
      day, hh = int(rng.integers(21, 31)), int(rng.integers(24))
      app = rng.random() < 0.3
      pick = lambda c: self.v[c][int(rng.integers(1 if c == "site_id" else 0, len(self.v[c])))]
      banner = int(rng.integers(8))
      logit = (-1.5 + 1.2 * np.sin(2 * np.pi * hh / 24) + self.w_banner[banner]
               + (0.8 if app else 0.0))
      r = [str(int(rng.integers(10 ** 18, 2 ** 64, dtype=np.uint64))),
           str(int(rng.random() < sigmoid(logit))),
           f"1410{day:02d}{hh:02d}", str(rng.choice([1001, 1002, 1005, 1007, 1010])),
           str(banner), APP_SITE if app else pick("site_id")]
      r += [pick(c) for c in ("site_domain", "site_category", "app_id", "app_domain",
                              "app_category", "device_id", "device_ip", "device_model")]
      r += [str(rng.choice([0, 1, 4, 5])), str(rng.choice([0, 2, 3, 5]))]
      r += [str(int(rng.integers(375, 24100))), str(rng.choice([216, 300, 320, 728])),
            str(rng.choice([36, 50, 90, 250, 480])), str(int(rng.integers(100, 2800))),
            str(int(rng.integers(4))), str(int(rng.integers(30, 1900))),
            "-1" if rng.random() < 0.45 else str(int(rng.integers(100000, 100300))),
            str(int(rng.integers(1, 260)))]
      out.append(r)
    return out


def write_avazu(root: str) -> dict:
  gen = AvazuGen()
  d = os.path.join(root, "avazu")
  train, dev = gen.rows(1200, 11), gen.rows(300, 12)
  out = {"train_rows": train, "dev_rows": dev,
         "train": write_lines(f"{d}/train.csv", [AVAZU_HEADER] + [",".join(r) for r in train]),
         "dev": write_lines(f"{d}/dev.csv", [",".join(r) for r in dev])}
  good = gen.rows(200, 13)
  row = lambda k, v: ",".join(v if j == k else t for j, t in enumerate(good[0]))
  bad = [(10, ",".join(good[0][:1] + good[0][2:]), "expected 24 fields .* got 23$"),  # Kaggle test
         (20, row(0, "abc"), "id: expected a decimal id, got b'abc'"),
         (30, row(1, "2"), "click: expected 0 or 1, got b'2'"),
         (40, row(2, "14102124"), "hour: hour 24 > 23"),
         (50, row(2, "14023000"), "hour: not a date"),
         (60, row(2, "1410210"), "hour: expected YYMMDDHH, got b'1410210'"),
         (70, row(5, "zz51fd"), "site_id: malformed categorical b'zz51fd'"),
         (80, row(16, "1.5"), "C14: non-integer b'1.5'"),
         (90, row(22, ""), "C20: non-integer b''"),
         (100, ",".join(good[0]) + ",", "expected 24 fields .* got 25$")]
  lines, reasons = damage([AVAZU_HEADER] + [",".join(r) for r in good], bad,
                          ",".join(good[0])[:40])
  out["bad"] = Bad(write_lines(f"{d}/bad.csv", lines, final_eol=False), good, reasons)
  return out


# -- MovieLens -------------------------------------------------------------------------
GENRES = ("Action", "Adventure", "Animation", "Children", "Comedy", "Crime", "Drama",
          "Fantasy", "Horror", "Romance", "Sci-Fi", "Thriller")
NO_GENRE = "(no genres listed)"


def write_movielens(root: str) -> dict:
  """movies.csv (quoted titles, '|' genres) and ratings.csv grouped by user, by movieId."""
  rng = np.random.default_rng(20)
  d = os.path.join(root, "movielens")
  movie_ids = sorted(int(m) for m in rng.choice(np.arange(1, 5000), 80, replace=False))
  movies, lines = {}, ["movieId,title,genres"]
  for n, m in enumerate(movie_ids):
    gs = sorted(rng.choice(GENRES, int(rng.integers(1, 5)), replace=False).tolist())
    title = f"Synthetic Film {n} ({1950 + n % 60})"
    if n % 7 == 1:
      title = f'"Film {n}, The ({1990 + n % 20})"'                     # comma: quoted
    elif n % 13 == 2:
      title = f'"The ""Quoted"" Film {n} (2001)"'                      # quotes doubled
    if n == 5:
      gs = [NO_GENRE]
    movies[m] = [] if n == 5 else gs
    lines.append(f"{m},{title},{'|'.join(gs)}")
  movies_path = write_lines(f"{d}/movies.csv", lines)
  names = sorted({g for gs in movies.values() for g in gs})
  # Ratings: 40 users; a user likes a movie more when it has their favourite genre.
  rated = movie_ids + [99991, 99992]                    # two movies missing from movies.csv
  rows = []
  for u in range(1, 41):
    fav = GENRES[int(rng.integers(len(GENRES)))]
    n = int(rng.integers(3, 45)) if u != 7 else 1
    items = sorted(int(i) for i in rng.choice(rated, n, replace=False))
    t0 = int(rng.integers(1_100_000_000, 1_450_000_000))
    times = t0 + np.cumsum(rng.integers(0, 3 * 86400, n))
    times = rng.permutation(times)                      # rows are by movieId, not by time
    for i, t in zip(items, times):
      score = 2.6 + 1.6 * (fav in movies.get(i, [])) + rng.normal(0, 0.9)
      rows.append((u, i, float(np.clip(np.round(score * 2) / 2, 0.5, 5.0)), int(t)))
  ties = [k for k in range(1, len(rows)) if rows[k][0] == rows[k - 1][0]][:3]
  for k in ties:                                        # same-second events
    rows[k] = rows[k][:3] + (rows[k - 1][3],)
  ratings = ["userId,movieId,rating,timestamp"] + [f"{u},{i},{r:.1f},{t}" for u, i, r, t in rows]
  out = {"movies": movies_path, "movies_truth": movies, "genre_names": names, "rows": rows,
         "ratings": write_lines(f"{d}/ratings.csv", ratings),
         "ratings_crlf": write_lines(f"{d}/ratings_crlf.csv", ratings, eol=b"\r\n"),
         "movies_crlf": write_lines(f"{d}/movies_crlf.csv", lines, eol=b"\r\n")}
  bad = [(5, "1,10,4.0", "expected 4 fields"),
         (15, "x,10,4.0,1200000000", "userId: non-integer b'x'"),
         (25, "2,10,abc,1200000000", "rating: non-numeric b'abc'"),
         (35, "2,10,11.0,1200000000", r"rating: 11.0 not in \[0, 10\]"),
         (45, "2,10,4.0,12e8", "timestamp: non-integer b'12e8'")]
  head = [k for k in range(len(rows)) if rows[k][0] <= 8]
  good = [rows[k] for k in head]
  blines, reasons = damage(ratings[:len(good) + 1], bad, "5,99991,4.")
  out["bad"] = Bad(write_lines(f"{d}/bad_ratings.csv", blines, final_eol=False), good, reasons)
  return out


# -- Alimama (DMR) ---------------------------------------------------------------------
L = 50


def write_alimama(root: str) -> dict:
  """267-column DMR rows: right-aligned 50-event histories; clicks planted on history match."""
  rng = np.random.default_rng(30)
  d = os.path.join(root, "alimama")
  rows = []
  for k in range(300):
    n = (0, 50)[k] if k < 2 else int(rng.integers(1, 51))
    cate, brand = int(rng.integers(1, 80)), int(rng.integers(1, 5000))
    his_c = [0] * (L - n) + [int(rng.integers(1, 80)) for _ in range(n)]
    if n and rng.random() < 0.5:
      his_c[L - 1 - int(rng.integers(n))] = cate
    his_b = [0] * (L - n) + [int(rng.integers(1, 5000)) for _ in range(n)]
    btag = [0] * (L - n) + [int(rng.choice([1, 2, 3, 4], p=[0.9, 0.04, 0.03, 0.03]))
                            for _ in range(n)]
    mask = [0] * (L - n) + [1] * n
    match = [int(m and c == cate) for m, c in zip(mask, his_c)]
    user = [int(rng.integers(1, 1_100_000)), int(rng.integers(13)), int(rng.integers(13)),
            int(rng.integers(1, 3)), int(rng.integers(7)), int(rng.integers(4)),
            int(rng.integers(1, 4)), int(rng.integers(2)), int(rng.integers(5))]
    ad = [int(rng.integers(1, 850_000)), cate, int(rng.integers(1, 420_000)),
          int(rng.integers(1, 250_000)), brand]
    price = float(rng.random()) if k != 2 else 1.0
    logit = 1.5 * (sum(match) > 0) - 0.6
    label = int(rng.random() < sigmoid(logit))
    rows.append(btag + his_c + his_b + mask + match + user + ad
                + [price, int(rng.integers(2)), label])
  fmt = lambda r: ",".join(repr(x) if isinstance(x, float) else str(x) for x in r)
  out = {"rows": rows, "train": write_lines(f"{d}/train.csv", [fmt(r) for r in rows])}
  good = rows[:100]
  def row(j, v):
    r = list(good[1])                                   # the full 50-event history
    r[j] = v
    return ",".join(str(x) for x in r)
  bad = [(10, ",".join(str(x) for x in good[1][:266]), "expected 267 fields .* got 266$"),
         (20, row(150 + 10, 2), "mask: values must be 0 or 1"),
         (30, row(49, 5), "btag: unmasked behaviour types"),
         (40, row(49, 0), "btag: unmasked behaviour types"),
         (50, row(260, "1.5"), "cate_id: non-integer b'1.5'"),
         (60, row(264, "nan"), "price: non-numeric b'nan'"),
         (70, row(265, 2), "pid: expected 0 or 1, got 2"),
         (80, row(266, "x"), "target: expected 0 or 1, got b'x'"),
         (90, row(70, "-"), "column 70: non-integer b'-'")]
  lines, reasons = damage([fmt(r) for r in good], bad, fmt(good[0])[:300])
  out["bad"] = Bad(write_lines(f"{d}/bad.csv", lines, final_eol=False), good, reasons)
  return out


# -- UCI adult -------------------------------------------------------------------------
WORKCLASS = ("Private", "Self-emp-not-inc", "Self-emp-inc", "Federal-gov", "Local-gov",
             "State-gov", "Without-pay")
EDUCATION = (("HS-grad", 9), ("Some-college", 10), ("Bachelors", 13), ("Masters", 14),
             ("11th", 7), ("Assoc-voc", 11), ("Doctorate", 16), ("5th-6th", 3))
MARITAL = ("Married-civ-spouse", "Never-married", "Divorced", "Separated", "Widowed")
OCCUPATION = ("Tech-support", "Craft-repair", "Sales", "Exec-managerial", "Prof-specialty",
              "Machine-op-inspct", "Adm-clerical", "Farming-fishing")
RELATIONSHIP = ("Husband", "Wife", "Own-child", "Not-in-family", "Unmarried")
RACE = ("White", "Black", "Asian-Pac-Islander", "Amer-Indian-Eskimo", "Other")
COUNTRY = ("United-States", "Mexico", "Philippines", "Germany", "India", "Canada")


def adult_rows(rng, n: int) -> list[list]:
  """Rows as 15 values (ints and strings); income planted on education_num, age and hours."""
  out = []
  for _ in range(n):
    age = int(rng.integers(17, 91))
    edu, edu_num = EDUCATION[int(rng.integers(len(EDUCATION)))]
    marital = MARITAL[int(rng.integers(len(MARITAL)))] if age > 24 or rng.random() < 0.2 \
        else "Never-married"
    hours = int(rng.integers(1, 100))
    gain = 0 if rng.random() < 0.9 else int(rng.integers(1, 99999))
    loss = 0 if rng.random() < 0.95 else int(rng.integers(1, 4357))
    logit = 0.55 * (edu_num - 10) + 0.04 * (min(age, 60) - 38) + 0.03 * (hours - 40) \
        + (1.5 if gain > 5000 else 0) - 1.2
    miss = lambda v: "?" if rng.random() < 0.06 else v
    out.append([age, miss(WORKCLASS[int(rng.integers(len(WORKCLASS)))]),
                int(rng.integers(12285, 1_484_705)), edu, edu_num, marital,
                miss(OCCUPATION[int(rng.integers(len(OCCUPATION)))]),
                RELATIONSHIP[int(rng.integers(len(RELATIONSHIP)))],
                RACE[int(rng.integers(len(RACE)))], ("Male", "Female")[int(rng.random() < 0.33)],
                gain, loss, hours, miss(COUNTRY[int(rng.integers(len(COUNTRY)))]),
                ">50K" if rng.random() < sigmoid(logit) else "<=50K"])
  return out


def adult_line(r: list, test: bool = False) -> str:
  return ", ".join(str(x) for x in r[:14]) + ", " + r[14] + ("." if test else "")


def write_adult(root: str) -> dict:
  """train (no final newline), test (UCI's '|1x3 Cross validator' first line, labels with '.')."""
  rng = np.random.default_rng(40)
  d = os.path.join(root, "adult")
  train, test = adult_rows(rng, 500), adult_rows(rng, 250)
  out = {"train_rows": train, "test_rows": test,
         "train": write_lines(f"{d}/train.csv", [adult_line(r) for r in train], final_eol=False),
         "test": write_lines(f"{d}/test.csv", ["|1x3 Cross validator"]
                             + [adult_line(r, True) for r in test])}
  good = adult_rows(rng, 150)
  line = lambda j, v: ", ".join(v if i == j else t for i, t in
                                enumerate(adult_line(good[0]).split(", ")))
  bad = [(10, line(0, "abc"), "age: non-integer b'abc'"),
         (20, line(10, "-5"), "capital_gain: negative value -5"),
         (30, line(14, "maybe"), "income: expected <=50K or >50K, got b'maybe'"),
         (40, adult_line(good[0]).rsplit(", ", 1)[0], "expected 15 fields"),
         (50, line(1, "Priv\xe9").encode("latin-1"), "undecodable bytes at column"),
         (60, line(2, "12.5"), "fnlwgt: non-integer b'12.5'"),
         (70, line(12, "?"), "hours_per_week: non-integer b'\\?'")]
  lines, reasons = damage([adult_line(r) for r in good], bad, adult_line(good[0])[:30])
  out["bad"] = Bad(write_lines(f"{d}/bad.csv", lines, final_eol=False), good, reasons)
  return out


def flat(tree, prefix=""):
  if isinstance(tree, dict):
    out = {}
    for k, v in tree.items():
      out.update(flat(v, f"{prefix}/{k}"))
    return out
  return {prefix: tree}


def valid_leaves(batches) -> dict:
  """Every batch leaf's valid rows (label_mask of task 0), concatenated over batches."""
  rows = {}
  for b in batches:
    m = b["label_mask"][:, 0] > 0
    for k, v in flat(b).items():
      rows.setdefault(k, []).append(np.asarray(v)[m])
  return {k: np.concatenate(v) for k, v in rows.items()}


def check_bad_rows(it, bad: Bad) -> None:
  """After a full pass of `it` over `bad.path`: exact counts and `file:line: reason` reports."""
  st = it.state()["bad_rows"]
  assert (st["bad"], st["rows"]) == (len(bad.lines), len(bad.lines) + len(bad.rows))
  want = sorted(bad.lines)[:len(st["reports"])]
  assert len(st["reports"]) == 5
  for report, line in zip(st["reports"], want):
    where, reason = report.split(": ", 1)
    assert where == f"{bad.path}:{line}", report
    assert re.match(bad.lines[line], reason), (report, bad.lines[line])


@dataclasses.dataclass
class Fixtures:
  root: str
  criteo: dict
  avazu: dict
  movielens: dict
  alimama: dict
  adult: dict

  def __repr__(self):
    return f"Fixtures({self.root!r})"


def write_all(root: str) -> Fixtures:
  return Fixtures(root, write_criteo(root), write_avazu(root), write_movielens(root),
                  write_alimama(root), write_adult(root))


_WRITTEN: dict = {}


@pytest.fixture(scope="session")
def synth_data(tmp_path_factory) -> Fixtures:
  """Synthetic files of every format (see module docstring), written once per session.

  Each test module that imports this fixture gets its own copy of it, hence the
  module-level cache: the files are still written only once.
  """
  if "fx" not in _WRITTEN:
    _WRITTEN["fx"] = write_all(str(tmp_path_factory.mktemp("synth_data")))
  return _WRITTEN["fx"]
