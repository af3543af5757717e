"""Timestamped event logs -> user sequences (MovieLens ratings.csv format).

Input: `ratings.csv` rows `userId,movieId,rating,timestamp` (header line
`userId,...` skipped), gzip or plain, one or many files read in the given order;
optionally `movies.csv` (`movieId,title,genres`, genres `|`-separated).

**Ordering assumption (checked):** each user's rows are contiguous (the file is
grouped by user, as MovieLens ships it: sorted by userId, then movieId). Rows
within a user may be in any order; the reader holds one user's rows at a time
(at most `max_user_events`), sorts them by (timestamp, line) and emits one
example per event. A user id that reappears after another user raises
ValueError naming the line; a user with more than `max_user_events` rows raises
too. Memory: one user's events plus the genre table of movies.csv (a small side
table, loaded whole) plus the set of finished user ids.

Each example is one rating event e of user u at time t:
* label `like` = rating >= like_threshold (4.0);
* ids: `user`, `item` (movieId), `genre` (multi-hot bag of the item's genres,
  ids in sorted genre-name order; '(no genres listed)' and unknown movies give
  an empty bag);
* sequence stream `history`: u's events with timestamp strictly before t (so
  an example never sees itself, a later event or one of the same second), most
  recent first, at most `max_len`: item ids in `hist_item`, action =
  round(2 * rating) (1..10, 0 = padding), surface 0, dt = t - t_event seconds;
* dense: [log1p(history length) / 10, log1p(hours since the previous event) / 10];
* single domain.
Time-based split: examples with t < split_timestamp are 'train', the others
'eval' (histories of eval examples include train-period events). With
`split_timestamp=None` it is the first hour boundary with at least
`split_quantile` of the valid events before it (one extra streaming pass).

Records are `(path, line, example | BadRow)`; the stream position is the line
position of the current user's first row plus the records already taken from
that user, so resuming re-reads one user.
Bad rows: wrong field count, non-integer ids/timestamps, a rating that is not a
number in [0, 10].

`MovieLensSource.vectorised_leaves()` is the converter's vectorised path: the ratings
read with pyarrow's CSV reader, users, sorting and histories in numpy, the same
examples as the records above; files with any bad row, ungrouped users or a user
over `max_user_events` go through the records (and their errors) instead.
"""
from __future__ import annotations

import collections
import csv
import io
import math
from typing import Sequence

import numpy as np

import pyarrow as pa
import pyarrow.compute as pc
from pyarrow import csv as pa_csv

from gem_jax.data import text
from gem_jax.data.badrows import BadRow
from gem_jax.data.files import LineStream, expand_paths, open_binary
from gem_jax.data.source import StreamingSource, base_batch, valid_rows
from gem_jax.data.spec import DataSpec, SequenceStreamSpec, SparseFeatureSpec

NUM_ACTIONS = 11
NO_GENRE = "(no genres listed)"


def movielens_spec(max_len: int, n_genres: int, max_genres: int,
                   vocab_size: int = 1 << 20) -> DataSpec:
  sparse = (SparseFeatureSpec("user", vocab_size), SparseFeatureSpec("item", vocab_size),
            SparseFeatureSpec("genre", max(n_genres, 1), bag=max_genres),
            SparseFeatureSpec("hist_item", vocab_size))
  stream = SequenceStreamSpec("history", max_len, ("hist_item",), num_actions=NUM_ACTIONS,
                              num_surfaces=1)
  return DataSpec(n_dense=2, sparse=sparse, sequences=(stream,), tasks=("like",))


def load_genres(path: str) -> tuple[dict[int, list[int]], list[str]]:
  """movieId -> genre ids, and the sorted genre names (ids index into them)."""
  with open_binary(path) as f:
    rows = list(csv.reader(io.TextIOWrapper(f, encoding="utf-8", newline="")))
  if not rows or rows[0][:1] != ["movieId"]:
    raise ValueError(f"{path}: expected a movies.csv header 'movieId,title,genres'")
  raw = {}
  for n, r in enumerate(rows[1:], start=2):
    if len(r) != 3:
      raise ValueError(f"{path}:{n}: expected 3 fields, got {len(r)}")
    raw[int(r[0])] = [g for g in r[2].split("|") if g and g != NO_GENRE]
  names = sorted({g for gs in raw.values() for g in gs})
  index = {g: i for i, g in enumerate(names)}
  return {m: [index[g] for g in gs] for m, gs in raw.items()}, names


def parse_rating(line: bytes):
  """-> (user, item, rating, timestamp)."""
  f = text.split_fields(line, b",", 4)
  user, item = text.parse_int(f[0], "userId"), text.parse_int(f[1], "movieId")
  rating = text.parse_float(f[2], "rating")
  if not 0.0 <= rating <= 10.0:
    raise BadRow(f"rating: {rating} not in [0, 10]")
  return user, item, rating, text.parse_int(f[3], "timestamp")


def _is_header(line: bytes) -> bool:
  return line.startswith(b"userId")


def split_timestamp_at(paths: Sequence[str], quantile: float) -> int:
  """First hour boundary T with >= `quantile` of the parseable events before it."""
  hours = collections.Counter()
  for _, _, line in LineStream(paths, _is_header):
    try:
      hours[parse_rating(line)[3] // 3600] += 1
    except BadRow:
      continue
  total, seen = sum(hours.values()), 0
  if not total:
    raise ValueError(f"{paths}: no readable ratings")
  for h in sorted(hours):
    seen += hours[h]
    if seen >= quantile * total:
      return (h + 1) * 3600
  raise AssertionError("unreachable")


def quantile_hour(timestamps: np.ndarray, quantile: float) -> int:
  """`split_timestamp_at` of an array of event times (seconds)."""
  hours, counts = np.unique(np.asarray(timestamps) // 3600, return_counts=True)
  if not len(hours):
    raise ValueError("no readable ratings")
  cum = np.cumsum(counts)
  return int(hours[np.argmax(cum >= quantile * cum[-1])] + 1) * 3600


class UserEventStream:
  """Records of one split, one user at a time (see module docstring)."""

  def __init__(self, source: "MovieLensSource"):
    self.src = source
    self.lines = LineStream(source.paths, _is_header)
    self._pending = None                  # (pos, record) read ahead: the next user's first row
    self._group_pos = self.lines.tell()
    self._buf: list = []
    self._k = 0
    self._finished_users: set[int] = set()

  def tell(self) -> dict:
    return {"group": dict(self._group_pos), "k": self._k}

  def seek(self, pos: dict) -> None:
    self.lines.seek(pos["group"])
    self._pending, self._finished_users = None, set()
    self._group_pos, self._buf, self._k = dict(pos["group"]), [], 0
    skip = int(pos["k"])
    if skip:
      self._fill()
      self._k = skip

  def close(self) -> None:
    self.lines.close()

  def _read(self):
    if self._pending is not None:
      out, self._pending = self._pending, None
      return out
    pos = self.lines.tell()
    rec = next(self.lines, None)
    return None if rec is None else (pos, rec)

  def _fill(self) -> None:
    """Loads the records of the next user (and the bad rows read with them)."""
    self._buf, self._k = [], 0
    first = self._read()
    if first is None:
      return
    self._group_pos = first[0]
    user, events, bad = None, [], []
    item = first
    while item is not None:
      pos, (path, line, raw) = item
      try:
        u, i, r, t = parse_rating(raw)
      except BadRow as e:
        bad.append((path, line, e))
        item = self._read()
        continue
      if user is None:
        if u in self._finished_users:
          raise ValueError(
              f"{path}:{line}: user {u} appears again after other users; the ratings "
              "must be grouped by user (e.g. sorted by userId, as MovieLens ships them)")
        user = u
      elif u != user:
        self._pending = item
        break
      events.append((t, line, i, r, path))
      if len(events) > self.src.max_user_events:
        raise ValueError(f"{path}:{line}: user {u} has more than max_user_events="
                         f"{self.src.max_user_events} rows")
      item = self._read()
    if user is not None:
      self._finished_users.add(user)
    self._buf = bad + self.src.user_examples(user, events)

  def __iter__(self):
    return self

  def __next__(self):
    while self._k >= len(self._buf):
      self._fill()
      if not self._buf and self._pending is None and self._peek_eof():
        raise StopIteration
    rec = self._buf[self._k]
    self._k += 1
    return rec

  def _peek_eof(self) -> bool:
    nxt = self._read()
    if nxt is None:
      return True
    self._pending = nxt
    return False


class MovieLensSource(StreamingSource):
  """One split of MovieLens-format ratings as sequence examples (see module docstring).

  Args:
    ratings: ratings file(s); comma-separated string or list, globs allowed.
    movies: movies.csv for genres, or '' for none.
    split: 'train' or 'eval'.
    split_timestamp: unix seconds; None -> from `split_quantile`.
    max_len: history length kept (most recent events).
    max_genres: genre bag size.
    like_threshold: rating >= this is a positive.
    max_user_events: the most rows one user may have (memory bound).
    vocab_size: spec vocab hint for user/item ids.
    **kw: StreamingSource options (shuffle_buffer, bad_row_limit, bad_row_min_rows).
  """

  def __init__(self, ratings: str | Sequence[str], movies: str = "", *, split: str = "train",
               split_timestamp: int | None = None, split_quantile: float = 0.8,
               max_len: int = 50, max_genres: int = 10, like_threshold: float = 4.0,
               max_user_events: int = 1_000_000, vocab_size: int = 1 << 20, **kw):
    if split not in ("train", "eval"):
      raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    self.paths = expand_paths(ratings, what="MovieLens ratings")
    self.genres, self.genre_names = load_genres(
        expand_paths(movies, "MovieLens movies")[0]) if movies else ({}, [])
    super().__init__(movielens_spec(max_len, len(self.genre_names), max_genres, vocab_size),
                     **kw)
    self.split, self.max_len, self.max_genres = split, max_len, max_genres
    self.like_threshold, self.max_user_events = like_threshold, max_user_events
    if split_timestamp is None:   # vectorised when the files are clean, else streamed
      got = self._read_ratings()
      self.split_timestamp = (quantile_hour(got[3], split_quantile) if got is not None
                              else split_timestamp_at(self.paths, split_quantile))
    else:
      self.split_timestamp = int(split_timestamp)

  @classmethod
  def from_config(cls, cfg, split: str) -> "MovieLensSource":
    train = split == "train"
    ts = cfg.get("split_timestamp", 0)
    return cls(cfg.train if train else cfg.eval, cfg.get("movies", ""), split=split,
               split_timestamp=ts or None, split_quantile=cfg.get("split_quantile", 0.8),
               max_len=cfg.get("max_len", 50), max_genres=cfg.get("max_genres", 10),
               like_threshold=cfg.get("like_threshold", 4.0),
               vocab_size=cfg.get("vocab_size", 1 << 20),
               shuffle_buffer=cfg.get("shuffle_buffer", 0) if train else 0,
               bad_row_limit=cfg.get("bad_row_limit", 0.01))

  @property
  def shared_vocab(self) -> dict[str, str]:
    """History items share the candidate item's table."""
    return {"hist_item": "item"}

  def describe(self) -> str:
    return f"MovieLensSource[{self.split}]({', '.join(self.paths)})"

  def num_rows(self) -> int:
    """Examples of this split (readable ratings on its side of the split time): one
    streaming pass over the ratings, counted once and cached."""
    if getattr(self, "_num_rows", None) is None:
      n, want_eval = 0, self.split == "eval"
      for _, _, line in LineStream(self.paths, _is_header):
        try:
          n += (parse_rating(line)[3] >= self.split_timestamp) == want_eval
        except BadRow:
          continue
      self._num_rows = n
    return self._num_rows

  def open_stream(self, epoch: int, seed: int) -> UserEventStream:
    del epoch, seed   # file order is data order here (users must stay contiguous)
    return UserEventStream(self)

  def user_examples(self, user: int, events: list) -> list:
    """Records of this split for one user's events [(t, line, item, rating, path)]."""
    events.sort(key=lambda e: (e[0], e[1]))
    out, h = [], 0                           # events[:h] are strictly before the current one
    want_eval = self.split == "eval"
    for t, line, item, rating, path in events:
      while events[h][0] < t:
        h += 1
      if (t >= self.split_timestamp) != want_eval:
        continue
      hist = events[max(0, h - self.max_len):h][::-1]          # most recent first
      out.append((path, line, (
          float(rating >= self.like_threshold), user, item,
          self.genres.get(item, [])[:self.max_genres],
          [e[2] for e in hist], [int(round(2 * e[3])) for e in hist],
          [float(t - e[0]) for e in hist])))
    return out

  def _read_ratings(self):
    """(user, item, rating, t, line) of every row of every file, numpy; None where a row
    is not clean (the records path then reports it)."""
    cols = {"userId": pa.int64(), "movieId": pa.int64(), "rating": pa.string(),
            "timestamp": pa.int64()}
    parts = []
    for path in self.paths:
      with open_binary(path) as f:
        data = f.read()
      first = data.split(b"\n", 1)[0].rstrip(b"\r")
      skip = 1 if _is_header(first) else 0
      body = data.split(b"\n", 1)[1] if skip and b"\n" in data else (b"" if skip else data)
      if body.translate(None, b"0123456789.-+eE,\r\n") or (
          b"\r" in body and body.count(b"\r") != body.count(b"\r\n")):
        return None
      bad = []
      try:
        t = pa_csv.read_csv(
            pa.py_buffer(body),
            read_options=pa_csv.ReadOptions(column_names=list(cols), use_threads=True),
            parse_options=pa_csv.ParseOptions(quote_char=False, ignore_empty_lines=False,
                                              invalid_row_handler=lambda r: bad.append(1)
                                              or "skip"),
            convert_options=pa_csv.ConvertOptions(column_types=cols, null_values=[""],
                                                  strings_can_be_null=True))
      except pa.ArrowInvalid:
        return None
      if bad or any(t.column(c).null_count for c in cols):
        return None
      rating = t.column("rating")
      if not pc.all(pc.match_substring_regex(rating, r"^" + text._FLOAT.pattern.decode()
                                             + r"$")).as_py():
        return None
      r = pc.cast(rating, pa.float64()).to_numpy()
      ints = [t.column(c).to_numpy() for c in ("userId", "movieId", "timestamp")]
      if ((r < 0) | (r > 10)).any() or any((np.abs(x) >= 10 ** 18).any() for x in ints):
        return None
      parts.append((*ints[:2], r, ints[2], np.arange(len(r), dtype=np.int64) + 1 + skip))
    return [np.concatenate(x) for x in zip(*parts)] if parts else None

  def vectorised_leaves(self):
    """This split's examples as leaves (gem_jax/data/columnar.py) in record order, or None
    when the ratings need the records path (see the module docstring)."""
    got = self._read_ratings()
    if got is None:
      return None
    user, item, rating, t, line = got
    n = len(user)
    change = np.flatnonzero(np.diff(user)) + 1
    starts = np.concatenate([[0], change])                            # runs of one user
    if np.unique(user[starts]).size != len(starts):
      return None                                                     # ungrouped: an error
    run_len = np.diff(np.concatenate([starts, [n]]))
    if len(run_len) and run_len.max() > self.max_user_events:
      return None
    run = np.repeat(np.arange(len(starts)), run_len)
    order = np.lexsort((line, t, run))                                # by user, then (t, line)
    user, item, rating, t, run = user[order], item[order], rating[order], t[order], run[order]
    first = np.concatenate([[0], np.cumsum(run_len)[:-1]])[run]       # run start of each event
    i = np.arange(n)
    new_t = (i == first) | np.concatenate([[True], t[1:] != t[:-1]])
    same_t = np.maximum.accumulate(np.where(new_t, i, 0))             # first event at this t
    keep = (t >= self.split_timestamp) == (self.split == "eval")
    idx = np.flatnonzero(keep)
    L, G = self.max_len, self.max_genres
    pos = same_t[idx, None] - 1 - np.arange(L)[None, :]               # (m, L) most recent first
    valid = pos >= first[idx, None]
    pos = np.where(valid, pos, 0)
    lens = valid.sum(axis=1).astype(np.int32)
    dt = np.where(valid, (t[idx, None] - t[pos]).astype(np.float64), 0.0)
    gap_h = np.where(lens > 0, dt[:, 0] / 3600, 0.0)
    uniq_items, inv = np.unique(item[idx], return_inverse=True)
    table = np.full((len(uniq_items), G), -1, np.int64)
    for j, m in enumerate(uniq_items.tolist()):
      gs = self.genres.get(m, [])[:G]
      table[j, :len(gs)] = gs
    m = len(idx)
    return {
        "dense": np.stack([np.log1p(lens.astype(np.float64)) / 10, np.log1p(gap_h) / 10],
                          -1).astype(np.float32),
        "domain": np.zeros(m, np.int32),
        "labels": (rating[idx] >= self.like_threshold).astype(np.float32)[:, None],
        "label_mask": np.ones((m, 1), np.float32),
        "ids/user": user[idx, None], "ids/item": item[idx, None],
        "ids/genre": table[inv.reshape(-1)],
        "ids/hist_item": np.where(valid, item[pos], -1),
        "seq/history/len": lens,
        "seq/history/action": np.where(valid, np.rint(2 * rating[pos]), 0).astype(np.int32),
        "seq/history/surface": np.zeros((m, L), np.int32),
        "seq/history/dt": dt.astype(np.float32),
    }

  def decode(self, record):
    payload = record[2]
    if isinstance(payload, BadRow):
      raise payload
    return payload

  def where(self, record) -> str:
    return f"{record[0]}:{record[1]}"

  def collate(self, examples: list) -> dict:
    b, L, G = len(examples), self.max_len, self.max_genres
    out = base_batch(b, 2, 1)
    user = np.full((b, 1), -1, np.int64)
    item = np.full((b, 1), -1, np.int64)
    genre = np.full((b, G), -1, np.int64)
    hist = np.full((b, L), -1, np.int64)
    action = np.zeros((b, L), np.int32)
    dt = np.zeros((b, L), np.float32)
    lens = np.zeros((b,), np.int32)
    idx, ex = valid_rows(examples)
    for i, (label, u, it, gs, hi, ac, d) in zip(idx, ex):
      n = len(hi)
      out["labels"][i, 0], out["label_mask"][i, 0] = label, 1.0
      user[i, 0], item[i, 0], lens[i] = u, it, n
      genre[i, :len(gs)] = gs
      hist[i, :n], action[i, :n], dt[i, :n] = hi, ac, d
      gap_h = d[0] / 3600 if n else 0.0
      out["dense"][i] = (math.log1p(n) / 10, math.log1p(gap_h) / 10)
    out["ids"] = {"user": user, "item": item, "genre": genre, "hist_item": hist}
    out["seq"] = {"history": {"len": lens, "action": action,
                              "surface": np.zeros((b, L), np.int32), "dt": dt}}
    return out
