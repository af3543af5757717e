"""A plain-Python model of the managed-collision policy (gem_jax/embedding/managed.py).

Dicts and lists only (the window hash is the one shared piece): windows of K rows,
hits, a miss whose own expired entry is still in its window taking that row back, the
other misses in ascending (fingerprint, id) order taking free rows by (empty, expired,
live by eviction priority, row), the rest counted as collisions.
"""
import numpy as np

from gem_jax.embedding import distinct_ids, managed


def window(x: int, windows: int) -> int:
  hi, lo = managed.split_ids(np.array([x], np.int64), "f", "t")[0]
  return int(managed.window_of(np.array([hi]), np.array([lo]), windows, xp=np)[0])


def miss_order(x: int) -> tuple[int, int]:
  """The order of a window's misses: (the id's 32-bit fingerprint, the id)."""
  hi, lo = managed.split_ids(np.array([x], np.int64), "f", "t")[0]
  return int(distinct_ids.fingerprint(np.array([hi]), np.array([lo]), xp=np)[0]), x


class RefMap:
  def __init__(self, rows: int, probe: int, eviction: str = "lru", ttl: int = 0):
    self.rows, self.K, self.eviction, self.ttl = rows, probe, eviction, ttl
    self.slot = {}   # row -> {'id', 'last', 'count'}

  def live(self, e, step) -> bool:
    return e is not None and (not self.ttl or step - e["last"] < self.ttl)

  def step(self, ids, step: int):
    """ids: raw ids of the global batch (-1 padding) -> ({id: row or None}, counters)."""
    occ = {}
    for x in ids:
      if x != -1:
        occ[int(x)] = occ.get(int(x), 0) + 1
    windows = self.rows // self.K
    by_win = {}
    for x in occ:
      by_win.setdefault(window(x, windows), []).append(x)
    out, self.inserted = {}, set()
    c = dict(ids=len(occ), hits=0, inserts=0, evictions=0, expired=0, collisions=0)
    for w, xs in by_win.items():
      rows = range(w * self.K, (w + 1) * self.K)
      taken, misses = set(), []
      for x in sorted(xs, key=miss_order):
        r = next((r for r in rows if self.live(self.slot.get(r), step)
                  and self.slot[r]["id"] == x), None)
        if r is None:
          misses.append(x)
        else:
          taken.add(r)
          out[x] = r
          self.slot[r]["last"] = step
          self.slot[r]["count"] += occ[x]
          c["hits"] += 1

      def prio(r):
        e = self.slot.get(r)
        if e is None:
          return (0, 0, 0, r - w * self.K)
        cls = 2 if self.live(e, step) else 1
        p = (e["last"], 0) if self.eviction == "lru" else (e["count"], e["last"])
        return (cls, *p, r - w * self.K)

      for x in list(misses):   # an expired id comes back to its own row (re-initialised)
        r = next((r for r in rows if self.slot.get(r) is not None
                  and self.slot[r]["id"] == x), None)
        if r is not None:
          misses.remove(x)
          taken.add(r)
          self.slot[r] = {"id": x, "last": step, "count": occ[x]}
          self.inserted.add(x)
          out[x] = r
          c["inserts"] += 1
          c["expired"] += 1
      free = sorted((r for r in rows if r not in taken), key=prio)
      for i, x in enumerate(misses):
        if i >= len(free):
          out[x] = None
          c["collisions"] += 1
          continue
        r = free[i]
        e = self.slot.get(r)
        if e is not None:
          c["evictions" if self.live(e, step) else "expired"] += 1
        self.slot[r] = {"id": x, "last": step, "count": occ[x]}
        self.inserted.add(x)
        out[x] = r
        c["inserts"] += 1
    c["used"] = len(self.slot)
    return out, c

  def arrays(self):
    """(ids (rows,) -1 = empty, last (rows,), count (rows,))."""
    ids = np.full(self.rows, -1, np.int64)
    last = np.zeros(self.rows, np.int64)
    count = np.zeros(self.rows, np.int64)
    for r, e in self.slot.items():
      ids[r], last[r], count[r] = e["id"], e["last"], e["count"]
    return ids, last, count
