"""gem_jax.hostmem: the host-malloc re-exec (huge pages, jemalloc on request) sets its
variables once and respects an opt-out;
the simulated CPU device count is added only when XLA_FLAGS states none; freed heap goes
back to the OS."""
import os
import subprocess
import sys

import pytest

from gem_jax import hostmem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = """
import os, sys
sys.path.insert(0, {root!r})
from gem_jax import hostmem
print("start", os.getpid(), flush=True)
hostmem.use_host_malloc()
print("tunables", os.environ.get("GLIBC_TUNABLES", ""), hostmem.huge_pages_requested())
print("malloc", hostmem.allocator(), os.environ.get("MALLOC_CONF", "").strip())
"""
_MALLOC_VARS = ("GLIBC_TUNABLES", "LD_PRELOAD", "MALLOC_CONF", hostmem.MALLOC)


def _run(tmp_path, env_tunables=None, malloc="glibc"):
  path = tmp_path / "s.py"
  path.write_text(SCRIPT.format(root=ROOT))
  env = {k: v for k, v in os.environ.items() if k not in _MALLOC_VARS}
  if malloc is not None:
    env[hostmem.MALLOC] = malloc
  if env_tunables is not None:
    env["GLIBC_TUNABLES"] = env_tunables
  out = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True,
                       timeout=60, check=True).stdout.split("\n")
  return [l.strip() for l in out if l]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc tunables are Linux-only")
def test_reexec_once_same_pid(tmp_path):
  lines = _run(tmp_path, "glibc.malloc.arena_max=2")
  starts = [l for l in lines if l.startswith("start")]
  assert len(starts) == 2 and len({s.split()[1] for s in starts}) == 1  # execv keeps the pid
  assert lines[-2] == "tunables glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1 True"
  assert lines[-1] == "malloc glibc"


def test_opt_out_is_respected(tmp_path):
  lines = _run(tmp_path, "glibc.malloc.hugetlb=0")
  assert len([l for l in lines if l.startswith("start")]) == 1
  assert lines[-2] == "tunables glibc.malloc.hugetlb=0 False"


@pytest.mark.skipif(hostmem.jemalloc_library() is None,
                    reason="libjemalloc.so.2 not installed (Debian/Ubuntu: libjemalloc2)")
def test_jemalloc_preloaded_where_found(tmp_path):
  """The default (auto) re-executes once under jemalloc, its freed pages kept;
  GEM_JAX_MALLOC=glibc keeps glibc's malloc."""
  lines = _run(tmp_path, malloc=None)
  starts = [l for l in lines if l.startswith("start")]
  assert len(starts) == 2 and len({s.split()[1] for s in starts}) == 1
  assert lines[-2] == "tunables glibc.malloc.hugetlb=1 False"   # glibc's tunable, unused
  assert lines[-1] == "malloc jemalloc dirty_decay_ms:-1"
  lines = _run(tmp_path, malloc="glibc")
  assert lines[-2:] == ["tunables glibc.malloc.hugetlb=1 True", "malloc glibc"]


JE = "libjemalloc.so.2"
HUGE = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
AUTO, JEM = {"GEM_JAX_MALLOC": "auto"}, {"GEM_JAX_MALLOC": "jemalloc"}
DECAY = {"MALLOC_CONF": "dirty_decay_ms:-1"}


@pytest.mark.parametrize("environ, huge, jemalloc, changes", [
    ({}, True, JE, {**HUGE, "LD_PRELOAD": JE, **DECAY}),          # default: auto
    (AUTO, True, JE, {**HUGE, "LD_PRELOAD": JE, **DECAY}),
    ({**AUTO, **HUGE, "LD_PRELOAD": JE, **DECAY}, True, JE, {}),  # re-exec'd
    ({}, True, None, HUGE),                                          # none found: glibc
    (AUTO, False, JE, {"LD_PRELOAD": JE, **DECAY}),               # 4 KiB pages
    ({"GEM_JAX_MALLOC": "glibc"}, True, JE, HUGE),
    ({"GEM_JAX_MALLOC": "glibc"}, False, JE, {}),
    ({**AUTO, "LD_PRELOAD": "/opt/libmine.so"}, True, JE, HUGE),     # the caller's preload kept
    ({**JEM, "LD_PRELOAD": "/opt/libmine.so"}, True, JE,
     {**HUGE, "LD_PRELOAD": JE + " /opt/libmine.so", **DECAY}),
    ({**JEM, "MALLOC_CONF": "narenas:4"}, True, JE,
     {**HUGE, "LD_PRELOAD": JE, "MALLOC_CONF": "narenas:4,dirty_decay_ms:-1"}),
    ({**JEM, "MALLOC_CONF": "dirty_decay_ms:5000"}, True, JE,   # the caller's value
     {**HUGE, "LD_PRELOAD": JE}),
    ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, True, None,
     {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}),
])
def test_host_malloc_env(environ, huge, jemalloc, changes):
  assert hostmem.host_malloc_env(environ, huge, jemalloc) == changes


@pytest.mark.parametrize("environ, message", [
    ({"GEM_JAX_MALLOC": "tcmalloc"}, "GEM_JAX_MALLOC='tcmalloc': expected auto, jemalloc or glibc"),
    ({"GEM_JAX_MALLOC": "jemalloc"}, "GEM_JAX_MALLOC=jemalloc: the dynamic loader finds no "
                                      "libjemalloc.so.2")])
def test_host_malloc_env_errors(environ, message):
  with pytest.raises(SystemExit, match=message):
    hostmem.host_malloc_env(environ, True, None)


@pytest.mark.parametrize("before, after", [
    (None, "--xla_force_host_platform_device_count=8"),
    ("--xla_cpu_foo=1", "--xla_cpu_foo=1 --xla_force_host_platform_device_count=8"),
    ("--xla_force_host_platform_device_count=2", "--xla_force_host_platform_device_count=2")])
def test_simulated_cpu_devices_keep_a_stated_count(monkeypatch, before, after):
  from gem_jax import hostmem  # pylint: disable=import-outside-toplevel
  if before is None:
    monkeypatch.delenv("XLA_FLAGS", raising=False)
  else:
    monkeypatch.setenv("XLA_FLAGS", before)
  hostmem.simulate_cpu_devices(8)
  assert os.environ["XLA_FLAGS"] == after


HOLES = """
import sys
sys.path.insert(0, {root!r})
from gem_jax import hostmem

def anon_mb():
  with open("/proc/self/status") as f:
    return next(int(l.split()[1]) for l in f if l.startswith("RssAnon")) / 1024

blocks = [bytearray(100_000) for _ in range(4000)]  # 400 MB below malloc's mmap threshold
for i in range(0, len(blocks), 2):                   # every other one freed: holes, no top
  blocks[i] = None
held = anon_mb()
print(held, hostmem.release_free_heap(), anon_mb())
"""


@pytest.mark.parametrize("malloc", ["glibc", "jemalloc"])
def test_release_free_heap_returns_freed_holes(tmp_path, malloc):
  """200 MB freed inside the heap stay resident until release_free_heap gives them back,
  under glibc's malloc and under jemalloc as use_host_malloc sets it up."""
  if malloc == "glibc" and hostmem._libc_malloc_trim() is None:
    pytest.skip("needs glibc's malloc_trim")
  if malloc == "jemalloc" and hostmem.jemalloc_library() is None:
    pytest.skip("libjemalloc.so.2 not installed (Debian/Ubuntu: libjemalloc2)")
  path = tmp_path / "holes.py"
  path.write_text(HOLES.format(root=ROOT))
  env = {k: v for k, v in os.environ.items() if k not in _MALLOC_VARS + ("MALLOC_ARENA_MAX",)}
  env.update(hostmem.host_malloc_env({hostmem.MALLOC: malloc}, False,
                                     hostmem.jemalloc_library()))
  out = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True,
                       timeout=60, check=True).stdout.split()
  held, released, after = float(out[0]), out[1], float(out[2])
  assert released == "True"
  assert held > 350, held                 # the freed halves were still resident
  assert held - after > 150, (held, after)  # most of the 200 MB of holes went back


HEAP = """
import json, sys
sys.path.insert(0, {root!r})
from gem_jax import hostmem
start = hostmem.host_memory_mb()
blocks = [bytearray(100_000) for _ in range(2000)]   # 200 MB in use
held = hostmem.host_memory_mb()
for i in range(0, len(blocks), 2):                    # half freed, as holes
  blocks[i] = None
freed = hostmem.host_memory_mb()
print(json.dumps([start, held, freed]))
"""


@pytest.mark.skipif(hostmem._libc_mallinfo2() is None, reason="needs glibc >= 2.33 mallinfo2")
def test_host_memory_tells_live_heap_from_retained(tmp_path):
  """host_heap_used_mb follows live allocations; freed holes move to host_heap_free_mb and
  stay in the RSS (the retention release_free_heap addresses)."""
  import json  # pylint: disable=import-outside-toplevel
  path = tmp_path / "heap.py"
  path.write_text(HEAP.format(root=ROOT))
  env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "MALLOC_ARENA_MAX")}
  start, held, freed = json.loads(subprocess.run(
      [sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=60,
      check=True).stdout)
  assert set(start) == {"host_rss_mb", "host_heap_used_mb", "host_heap_free_mb"}
  assert 190 < held["host_heap_used_mb"] - start["host_heap_used_mb"] < 215, (start, held)
  assert 90 < held["host_heap_used_mb"] - freed["host_heap_used_mb"] < 110, (held, freed)
  assert freed["host_heap_free_mb"] - held["host_heap_free_mb"] > 90, (held, freed)
  assert held["host_rss_mb"] - freed["host_rss_mb"] < 20, (held, freed)  # not given back


ARENAS = """
import ctypes, os, sys, threading
sys.path.insert(0, {root!r})
from gem_jax import hostmem
hostmem.use_malloc_tunables({{hostmem.ARENA_MAX: 2}})
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.fopen.restype = ctypes.c_void_p
libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
barrier = threading.Barrier(8)   # all 8 threads hold their arena at once
def work():
  libc.malloc(1000)
  barrier.wait()
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
fp = libc.fopen({out!r}.encode(), b"w")
libc.malloc_info(0, fp)
libc.fclose(fp)
print("tunables", os.environ.get("GLIBC_TUNABLES", ""))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc tunables are Linux-only")
@pytest.mark.parametrize("given, tunables, most", [
    (None, "glibc.malloc.arena_max=2", 2),                     # the requested cap
    ("glibc.malloc.arena_max=6", "glibc.malloc.arena_max=6", 6)])  # a stated value wins
def test_malloc_tunables_cap_the_arenas(tmp_path, given, tunables, most):
  """8 live threads that each malloc once get their own arenas unless capped (glibc gives a
  new thread a new arena up to 8 x cores): `malloc_info` lists one <heap> per arena."""
  out = tmp_path / "info.xml"
  path = tmp_path / "a.py"
  path.write_text(ARENAS.format(root=ROOT, out=str(out)))
  env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "MALLOC_ARENA_MAX")}
  if given:
    env["GLIBC_TUNABLES"] = given
  lines = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout.split("\n")
  assert f"tunables {tunables}" in lines
  heaps = out.read_text().count("<heap nr=")
  assert 1 <= heaps <= most, heaps
  if given is None:          # the same threads without the cap: more arenas (the cause)
    env["GLIBC_TUNABLES"] = "glibc.malloc.arena_max=64"
    subprocess.run([sys.executable, str(path)], env=env, timeout=60, check=True,
                   capture_output=True)
    assert out.read_text().count("<heap nr=") > most


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs /proc/PID/smaps")
def test_rss_growth_by_mapping_finds_the_mapping_that_grew():
  """64 MB written into a fresh anonymous block (malloc mmaps blocks this large) show up as
  growth of kind 'anon', and of one mapping among the top ones."""
  import numpy as np
  before = hostmem.mapping_rss_kb()
  block = np.ones(64 << 20, np.uint8)                       # every page written
  after = hostmem.mapping_rss_kb()
  grew = hostmem.rss_growth_by_mapping(before, after, top=3)
  assert 60 < grew["kind anon"] < 80, grew
  assert max(v for k, v in grew.items() if not k.startswith("kind")) > 60, grew
  assert block.sum() == 64 << 20


def test_allocator_from_the_mapped_libraries():
  """A preloaded malloc shows in the maps; without one the process runs glibc's."""
  glibc = "7f00-7f10 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
  assert hostmem.allocator_of(glibc) == "glibc"
  assert hostmem.allocator_of(
      glibc + "7e00-7e10 r-xp 0 08:01 2 /usr/lib/x86_64-linux-gnu/libjemalloc.so.2\n") == "jemalloc"
  assert hostmem.allocator_of(glibc + "7d00 r-xp 0 0 3 /opt/lib/libtcmalloc_minimal.so.4\n") \
      == "tcmalloc"
  if os.path.exists("/proc/self/maps") and "LD_PRELOAD" not in os.environ:
    assert hostmem.allocator() == "glibc"
  assert hostmem.allocator(pid=2**30) == "unknown"   # no such process


@pytest.mark.parametrize("serving, env, installed, warn, text", [
    ("jemalloc", {"MALLOC_CONF": "dirty_decay_ms:-1"}, True, False, "jemalloc (MALLOC_CONF=dirty"),
    ("glibc", {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, False, True,
     "libjemalloc.so.2 not found"),
    ("glibc", {hostmem.MALLOC: "auto"}, False, True, "apt install libjemalloc2"),
    ("glibc", {}, True, True, "libjemalloc.so.2 is installed but not preloaded"),
    ("glibc", {hostmem.MALLOC: "glibc"}, True, False, "host malloc: glibc"),
    ("tcmalloc", {"LD_PRELOAD": "libtcmalloc.so"}, False, False, "host malloc: tcmalloc"),
])
def test_malloc_summary_warns_only_where_jemalloc_was_wanted_and_missing(
    serving, env, installed, warn, text, monkeypatch):
  """The trainer's first log lines name the malloc; a warning where the default (auto)
  runs on glibc, saying whether jemalloc is missing or only not preloaded."""
  monkeypatch.setattr(sys, "platform", "linux")
  monkeypatch.setattr(hostmem, "jemalloc_library",
                      lambda: "libjemalloc.so.2" if installed else None)
  line, warned = hostmem.malloc_summary(serving, env)
  assert warned == warn and text in line
  assert ("huge pages" in line) == ("hugetlb=1" in env.get("GLIBC_TUNABLES", ""))
