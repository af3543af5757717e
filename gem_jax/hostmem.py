"""Host memory: setup that must precede `import jax` (glibc malloc tunables, simulated CPU
devices), and giving freed heap back to the OS.

glibc reads its tunables (GLIBC_TUNABLES) at process start, so `use_malloc_tunables`
re-executes the script once with them set; a tunable the caller's environment already
names is left as it is (its value wins: an opt-out or a different choice).

Transparent huge pages for host memory.

Random row reads into a table of hundreds of MB miss the TLB on nearly every access
with 4 KiB pages. glibc >= 2.35 advises huge pages for its large allocations when
started with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (machines whose THP mode is
'madvise' need that advice; with 'always' it changes nothing). Tunables are read at
process start, so `use_huge_pages` re-executes the script once with the variable set.
Measured (docs/PERFORMANCE.md): dlrm_peer step 50 -> 41 ms; the embedding benchmark's
10^7 / 10^5 row step ratio 1.40 -> 1.23. No effect on GPU/TPU tables, which live in HBM.

Call it first thing in a script's `__main__`, before importing jax. It does nothing
when GLIBC_TUNABLES already names the tunable (any value: `...hugetlb=0` opts out).

Other tunables (e.g. `glibc.malloc.arena_max=2`, tried in the soak runs of
docs/RELIABILITY.md) are set the same way, or from the environment.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys

TUNABLE = "glibc.malloc.hugetlb"
ARENA_MAX = "glibc.malloc.arena_max"


def use_malloc_tunables(tunables: dict[str, int]) -> None:
  """Re-executes the running script with GLIBC_TUNABLES += the `tunables` it does not name
  yet (nothing to add: no re-exec; not Linux: nothing)."""
  current = os.environ.get("GLIBC_TUNABLES", "")
  named = {t.split("=")[0] for t in current.split(":") if t}
  new = [f"{k}={v}" for k, v in tunables.items() if k not in named]
  if not new or not sys.platform.startswith("linux"):
    return
  os.environ["GLIBC_TUNABLES"] = ":".join([current] * bool(current) + new)
  sys.stdout.flush()
  sys.stderr.flush()
  os.execv(sys.executable, [sys.executable] + sys.argv)


def use_huge_pages(enabled: bool = True) -> None:
  """Re-executes the running script with GLIBC_TUNABLES += glibc.malloc.hugetlb=1."""
  if enabled:
    use_malloc_tunables({TUNABLE: 1})


def huge_pages_requested() -> bool:
  return TUNABLE + "=1" in os.environ.get("GLIBC_TUNABLES", "")


def anon_huge_pages_mb(pid: int | str = "self") -> float:
  """AnonHugePages of process `pid` (MB), from /proc/PID/smaps_rollup; 0 if unknown."""
  try:
    with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as f:
      for line in f:
        if line.startswith("AnonHugePages:"):
          return int(line.split()[1]) / 1024
  except OSError:
    pass
  return 0.0


def mapping_rss_kb(pid: int | str = "self") -> dict[str, int]:
  """Resident kB of each memory mapping of process `pid` (/proc/PID/smaps), keyed
  'START-END NAME' (NAME: a file path, '[heap]' (brk: malloc's main arena), '[stack]', ...,
  or 'anon': anonymous mmaps: malloc's other arenas and large blocks, Python's object
  arenas, thread stacks, XLA's buffers); {} if unreadable."""
  out, key = {}, None
  try:
    with open(f"/proc/{pid}/smaps", encoding="utf-8", errors="replace") as f:
      for line in f:
        head = line.split(maxsplit=5)
        if "-" in head[0] and ":" not in head[0]:            # a mapping's first line
          key = f"{head[0]} {head[5].strip() if len(head) > 5 else 'anon'}"
          out[key] = 0
        elif head[0] == "Rss:" and key is not None:
          out[key] = int(head[1])
  except OSError:
    return {}
  return out


def rss_growth_by_mapping(before: dict[str, int], after: dict[str, int],
                          top: int = 5) -> dict[str, float]:
  """MB of RSS gained between two `mapping_rss_kb` snapshots: per kind ('[heap]', 'anon',
  'files', other names) and the `top` mappings that grew most (keyed as in the snapshot)."""
  def kind(k):
    name = k.split(" ", 1)[1]
    return "files" if name.startswith("/") else name
  grow = {k: after.get(k, 0) - before.get(k, 0) for k in set(before) | set(after)}
  out: dict[str, float] = {}
  for k, v in grow.items():
    out[f"kind {kind(k)}"] = out.get(f"kind {kind(k)}", 0.0) + v / 1024
  for k in sorted(grow, key=grow.get, reverse=True)[:top]:
    out[k] = grow[k] / 1024
  return {k: round(v, 1) for k, v in out.items()}


def simulate_cpu_devices(n: int = 8) -> None:
  """XLA_FLAGS += --xla_force_host_platform_device_count=n, unless it already sets a count.

  Only the CPU platform reads it (harmless on GPU/TPU); it must precede `import jax`.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def _libc_function(name: str, argtypes: list, restype):
  """glibc's function `name` with its signature set, or None (another libc, not Linux)."""
  if not sys.platform.startswith("linux"):
    return None
  try:
    fn = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
  except (OSError, AttributeError):
    return None
  fn.argtypes, fn.restype = argtypes, restype
  return fn


@functools.cache
def _libc_malloc_trim():
  return _libc_function("malloc_trim", [ctypes.c_size_t], ctypes.c_int)


def release_free_heap() -> bool:
  """Returns the free pages of every malloc arena to the OS (glibc `malloc_trim(0)`).

  glibc keeps memory freed inside its heaps (not at their top) mapped, so a process
  that allocates and frees large host buffers from several threads ratchets up its
  RSS: the asynchronous checkpoint writer copies the state to host buffers on every
  save, from a thread pool. Measured (docs/RELIABILITY.md, soak): one call after each
  finished save took the soak's RSS slope from 188 to 102 MB/h and a bare save loop's
  growth to ~0 (what glibc still retains in its arenas after that, ~20 MB/h, goes away
  under jemalloc: docs/RELIABILITY.md). Cost (measured on a 1 GB heap of 100 KB blocks):
  6 ms with nothing to give back, 80 ms giving back 460 MB. False (nothing done) where
  glibc is absent.
  """
  trim = _libc_malloc_trim()
  if trim is None:
    return False
  trim(0)
  return True


class _Mallinfo2(ctypes.Structure):
  _fields_ = [(name, ctypes.c_size_t) for name in (
      "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
      "fordblks", "keepcost")]


@functools.cache
def _own_allocator() -> str:
  return allocator()


@functools.cache
def _libc_mallinfo2():
  return _libc_function("mallinfo2", [], _Mallinfo2)  # glibc >= 2.33


def allocator_of(maps: str) -> str:
  """The malloc serving a process, from its /proc/PID/maps text: 'jemalloc' or 'tcmalloc'
  when that library is mapped (LD_PRELOAD puts it ahead of glibc's malloc), else 'glibc'."""
  for name in ("jemalloc", "tcmalloc"):
    if f"lib{name}" in maps:
      return name
  return "glibc"


def allocator(pid: int | str = "self") -> str:
  """`allocator_of` this process (or `pid`); 'unknown' without /proc."""
  try:
    with open(f"/proc/{pid}/maps", encoding="ascii", errors="replace") as f:
      return allocator_of(f.read())
  except OSError:
    return "unknown"


def host_memory_mb() -> dict[str, float]:
  """This process's host memory (MB): what the OS holds and what malloc has handed out.

  host_rss_mb: resident set (/proc/self/statm); host_heap_used_mb: bytes malloc has
  allocated and not yet freed (glibc mallinfo2: uordblks + hblkhd, all arenas);
  host_heap_free_mb: freed bytes glibc keeps inside its heaps (fordblks). RSS growing
  with heap_used flat is retention (fragmentation, `release_free_heap` helps); heap_used
  growing is live allocations. Keys absent where the source is (not Linux, not glibc;
  another malloc preloaded, e.g. jemalloc: glibc's figures would describe its unused heap).
  """
  out = {}
  try:
    with open("/proc/self/statm", encoding="ascii") as f:
      out["host_rss_mb"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
  except (OSError, ValueError, IndexError):
    pass
  info = _libc_mallinfo2()
  if info is not None and _own_allocator() == "glibc":
    m = info()
    out["host_heap_used_mb"] = (m.uordblks + m.hblkhd) / 2**20
    out["host_heap_free_mb"] = m.fordblks / 2**20
  return out
