"""Host memory: setup that must precede `import jax` (the host malloc, simulated CPU
devices), and giving freed heap back to the OS.

The loader reads LD_PRELOAD and glibc its tunables (GLIBC_TUNABLES) at process start, so
`use_host_malloc` re-executes the script once with them set; what the caller's environment
already names is left as it is (its value wins: an opt-out or a different choice).

The malloc: GEM_JAX_MALLOC=auto (the default) preloads jemalloc where the dynamic loader finds
libjemalloc.so.2 (Debian/Ubuntu: libjemalloc2) and keeps glibc's malloc where not; =jemalloc
insists (an error without it), =glibc keeps glibc's. Why (docs/RELIABILITY.md, "Soak run";
docs/PERFORMANCE.md, "Embedding engine", item 4):
  * RSS. A long run saves checkpoints from a thread pool and evaluates every few minutes;
    glibc's per-thread arenas keep freed pages of those bursts and RSS creeps up (19.6 MB/h
    over 130 minutes, the heap in use flat). Under jemalloc it stays flat.
  * Page faults. XLA's CPU runtime allocates a step's temporaries (gathered rows, gradients,
    the ids' sort buffers) anew each step. glibc unmaps blocks above 32 MB when freed, and
    jemalloc returns freed pages to the OS gradually (its dirty-page decay, and at once for
    blocks above 8 MB): the next step faults them in again, 4 KiB at a time. Measured
    (docs/PERFORMANCE.md), the embedding benchmark's hashed step: under jemalloc's defaults
    2x glibc's time on the simulated 1 x 8 mesh (4x the page faults) and 1.1-1.7x on one
    device at 10^7 rows; with MALLOC_CONF=dirty_decay_ms:-1 (freed pages kept until
    `release_free_heap`, which the checkpoint writer calls after each save) as fast as
    glibc or faster, with glibc's page-fault count.
So jemalloc runs with MALLOC_CONF=dirty_decay_ms:-1 (unless MALLOC_CONF names it) and
without transparent huge pages; glibc with huge pages for its large blocks
(GLIBC_TUNABLES=glibc.malloc.hugetlb=1, glibc >= 2.35, on machines whose THP mode is
'madvise'): 2 MiB faults instead of 4 KiB ones, at the cost of the RSS creep above (huge
pages that khugepaged fills again once partly freed). GLIBC_TUNABLES=glibc.malloc.hugetlb=0
turns them off; MALLOC_CONF=thp:always asks jemalloc for them (measured: RSS +29 MB/h).
Backing only the tables with huge pages (madvise MADV_HUGEPAGE + MADV_COLLAPSE on their
buffers) was measured and dropped: no gain (the temporaries' faults were the cost).

Call `use_host_malloc` first thing in a script's `__main__`, before importing jax. The trainer
logs `malloc_summary()` at start: the malloc serving it, as a warning where the default
ended on glibc.
Other glibc tunables (e.g. `glibc.malloc.arena_max=2`, tried in the soak runs of
docs/RELIABILITY.md) are set with `use_malloc_tunables`, or from the environment.
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


MALLOC = "GEM_JAX_MALLOC"     # auto (default): jemalloc where found | jemalloc | glibc
JEMALLOC_THP = "thp:always"
JEMALLOC_CONF = "dirty_decay_ms:-1"   # freed pages kept for reuse until release_free_heap


def jemalloc_library() -> str | None:
  """jemalloc's soname where the dynamic loader finds it (e.g. 'libjemalloc.so.2'), else None."""
  if not sys.platform.startswith("linux"):
    return None
  return ctypes.util.find_library("jemalloc")


def _tunables(environ) -> dict[str, str]:
  return dict(t.split("=", 1) if "=" in t else (t, "")
              for t in environ.get("GLIBC_TUNABLES", "").split(":") if t)


def host_malloc_env(environ, huge_pages: bool, jemalloc: str | None) -> dict[str, str]:
  """The variables `use_host_malloc` sets (those that change), given the environment and
  jemalloc's soname (None: not installed). Raises SystemExit on a bad GEM_JAX_MALLOC.
    Example: {}, huge pages, 'libjemalloc.so.2' -> {GLIBC_TUNABLES: 'glibc.malloc.hugetlb=1',
    LD_PRELOAD: 'libjemalloc.so.2', MALLOC_CONF: 'dirty_decay_ms:-1'}; run again with
    those set: {}. The same without jemalloc: {GLIBC_TUNABLES: 'glibc.malloc.hugetlb=1'}."""
  choice = environ.get(MALLOC, "auto")
  if choice not in ("auto", "jemalloc", "glibc"):
    raise SystemExit(f"{MALLOC}={choice!r}: expected auto, jemalloc or glibc")
  out, tunables = {}, _tunables(environ)
  if huge_pages and TUNABLE not in tunables:
    current = environ.get("GLIBC_TUNABLES", "")
    out["GLIBC_TUNABLES"] = ":".join([current] * bool(current) + [f"{TUNABLE}=1"])
  preload = environ.get("LD_PRELOAD", "")
  if choice == "jemalloc" and jemalloc is None:
    raise SystemExit(f"{MALLOC}=jemalloc: the dynamic loader finds no libjemalloc.so.2 "
                     "(Debian/Ubuntu: apt install libjemalloc2)")
  if choice != "glibc" and jemalloc and "jemalloc" not in preload and (
      choice == "jemalloc" or not preload):
    out["LD_PRELOAD"] = " ".join([jemalloc] + [preload] * bool(preload))
  conf = environ.get("MALLOC_CONF", "")
  if (out.get("LD_PRELOAD") or "jemalloc" in preload) and "dirty_decay_ms" not in conf:
    out["MALLOC_CONF"] = ",".join([conf] * bool(conf) + [JEMALLOC_CONF])
  return out


def use_host_malloc(huge_pages: bool = True) -> None:
  """Re-executes the running script once with its host malloc set up (module doc): jemalloc
  where found, else glibc's with huge pages for its large blocks (unless `huge_pages` is
  False). Nothing to change: no re-exec; not Linux: nothing."""
  if not sys.platform.startswith("linux"):
    return
  wanted = os.environ.get(MALLOC, "auto") != "glibc"   # no library lookup where not wanted
  changes = host_malloc_env(os.environ, huge_pages, jemalloc_library() if wanted else None)
  if changes:
    os.environ.update(changes)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable] + sys.argv)


def huge_pages_requested() -> bool:
  """Were huge pages asked of the malloc serving this process (`use_host_malloc`)?"""
  if allocator() == "jemalloc":
    return JEMALLOC_THP in os.environ.get("MALLOC_CONF", "")
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


def _c_function(library: str | None, name: str, argtypes: list, restype):
  """C function `name` of `library` (None: the process's global symbols, where a preloaded
  malloc's come first) with its signature set, or None (not found, not Linux)."""
  if not sys.platform.startswith("linux"):
    return None
  try:
    fn = getattr(ctypes.CDLL(library), name)
  except (OSError, AttributeError):
    return None
  fn.argtypes, fn.restype = argtypes, restype
  return fn


def _libc_function(name: str, argtypes: list, restype):
  """glibc's function `name` with its signature set, or None (another libc, not Linux)."""
  return _c_function(ctypes.util.find_library("c") or "libc.so.6", name, argtypes, restype)


@functools.cache
def _libc_malloc_trim():
  return _libc_function("malloc_trim", [ctypes.c_size_t], ctypes.c_int)


@functools.cache
def _jemalloc_mallctl():
  """jemalloc's mallctl where jemalloc serves this process (preloaded), else None."""
  if _own_allocator() != "jemalloc":
    return None
  return _c_function(None, "mallctl", [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int)


def release_free_heap() -> bool:
  """Returns the malloc's freed pages to the OS: glibc `malloc_trim(0)`, jemalloc
  `mallctl("arena.<all>.purge")`. True where done.

  glibc keeps memory freed inside its heaps (not at their top) mapped, and jemalloc, as
  `use_host_malloc` sets it up, all its freed pages (so that the next step reuses them
  without page faults). A process that allocates and frees large host buffers from several
  threads then ratchets up its RSS: the asynchronous checkpoint writer copies the state to
  host buffers on every save, from a thread pool, and calls this after each. Measured
  (docs/RELIABILITY.md, soak): under glibc one call after each finished save took the soak's
  RSS slope from 188 to 102 MB/h and a bare save loop's growth to ~0; what glibc still
  retains in its arenas after that (~20 MB/h) jemalloc does not. Cost (glibc, measured on a
  1 GB heap of 100 KB blocks): 6 ms with nothing to give back, 80 ms giving back 460 MB.
  False (nothing done) under another malloc or libc.
  """
  mallctl = _jemalloc_mallctl()
  if mallctl is not None:
    return mallctl(b"arena.4096.purge", None, None, None, 0) == 0  # 4096: MALLCTL_ARENAS_ALL
  trim = _libc_malloc_trim()
  if trim is None or _own_allocator() != "glibc":
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


def malloc_summary(serving: str | None = None, environ=None) -> tuple[str, bool]:
  """(one line naming the host malloc serving this process, whether it is a warning). A
  warning where glibc serves a Linux process that asked for jemalloc by default
  (GEM_JAX_MALLOC=auto) and found none: glibc's arenas make a long run's RSS creep.
  `serving`: `allocator()` (default: this process's); `environ`: os.environ.
    Example: 'glibc', {}, no jemalloc installed -> ('host malloc: glibc (libjemalloc.so.2
    not found; ...)', True)."""
  serving = serving or _own_allocator()
  environ = os.environ if environ is None else environ
  if serving == "jemalloc":
    return f"host malloc: jemalloc (MALLOC_CONF={environ.get('MALLOC_CONF', '')})", False
  huge = " with huge pages" if TUNABLE + "=1" in environ.get("GLIBC_TUNABLES", "") else ""
  if serving == "glibc" and environ.get(MALLOC, "auto") == "auto" and (
      sys.platform.startswith("linux")):
    lib = jemalloc_library()
    why = ("libjemalloc.so.2 not found; Debian/Ubuntu: apt install libjemalloc2" if lib is None
           else f"{lib} is installed but not preloaded: the scripts re-execute under it "
                "(hostmem.use_host_malloc), a program of your own can set LD_PRELOAD")
    return (f"host malloc: glibc{huge} ({why}; under glibc a long run's host RSS creeps, "
            "~20 MB/h measured: docs/RELIABILITY.md, soak; GEM_JAX_MALLOC=glibc chooses "
            "glibc)"), True
  return f"host malloc: {serving}{huge}", False


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
