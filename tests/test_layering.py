"""The import graph of gem_jax/ and scripts/: the README's layering and no import circle.

  vma -> data, embedding, hostmem -> parallel -> layers -> models -> flops -> train
  -> transfer, bench -> scripts

A module may import from its own package and from packages below it, never from
one above (nor from a package of its own level: data and embedding, transfer and
bench stay apart). Every `import` counts, function-level ones too (they hide
circles that only bite at call time). Parsed with `ast`; nothing is imported.
"""
import ast
import collections
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Package (or top-level module) -> level. gem_jax/vma.py (shard_map typing helpers, used by
# embedding) and gem_jax/hostmem.py import nothing of gem_jax (they sit at the bottom);
# gem_jax/flops.py counts the models' FLOPs from
# their configs and layer shapes (it reads models/ and layers/: just above models;
# no model imports it).
LEVELS = {"vma": -1, "data": 0, "embedding": 0, "hostmem": 0, "parallel": 1, "layers": 2,
          "models": 3, "flops": 4, "train": 5, "transfer": 6, "bench": 6, "serving": 6, "scripts": 7}

# (importer package, imported package) pairs allowed against the rule, with the reason.
EXCEPTIONS: dict[tuple[str, str], str] = {}

# Import circles allowed (frozenset of modules -> the reason); none today.
ALLOWED_CIRCLES: dict[frozenset, str] = {}


def _modules() -> dict[str, str]:
  """Module name -> path, for gem_jax/** and scripts/*.py."""
  out = {}
  for base in ("gem_jax", "scripts"):
    for d, _, files in os.walk(os.path.join(ROOT, base)):
      for f in files:
        if f.endswith(".py"):
          path = os.path.join(d, f)
          name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
          out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
  return out


def _graph(mods: dict[str, str]) -> dict[str, set[str]]:
  """Module -> the gem_jax modules it imports (a name imported from a package resolves to
  its submodule when there is one, else to the package)."""
  def resolve(name):
    while name and name not in mods:
      name = name.rpartition(".")[0]
    return name

  edges = collections.defaultdict(set)
  for m, path in mods.items():
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods
                   else node.module for a in node.names]
      else:
        continue
      for t in targets:
        if t.split(".")[0] == "gem_jax" and resolve(t) and resolve(t) != m:
          edges[m].add(resolve(t))
  return edges


def _package(module: str) -> str:
  parts = module.split(".")
  return parts[0] if parts[0] == "scripts" else parts[1] if len(parts) > 1 else parts[0]


def test_every_package_has_a_level():
  mods = _modules()
  missing = {_package(m) for m in mods if m != "gem_jax"} - set(LEVELS)
  assert not missing, f"place these in LEVELS: {sorted(missing)}"


def test_no_module_imports_from_a_package_above_or_beside_it():
  mods = _modules()
  bad = []
  for a, targets in sorted(_graph(mods).items()):
    for b in sorted(targets):
      pa, pb = _package(a), _package(b)
      if b == "gem_jax" or pa == pb or (pa, pb) in EXCEPTIONS:
        continue
      if LEVELS[pb] >= LEVELS[pa]:
        bad.append(f"{a} imports {b} ({pa} level {LEVELS[pa]}, {pb} level {LEVELS[pb]})")
  assert not bad, "\n".join(bad)


def test_no_import_circle():
  """No strongly connected component of more than one module (Tarjan)."""
  edges = _graph(_modules())
  index, low, on, stack, circles = {}, {}, set(), [], []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in sorted(edges.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1 and frozenset(comp) not in ALLOWED_CIRCLES:
        circles.append(sorted(comp))

  for v in sorted(set(edges) | {w for ws in edges.values() for w in ws}):
    if v not in index:
      visit(v)
  assert not circles, f"import circles: {circles}"


def test_the_graph_sees_function_level_imports():
  """The parser finds imports inside functions (setup.py's lazy model import, peer.py's)."""
  edges = _graph(_modules())
  assert "gem_jax.train.setup" in edges["gem_jax.bench.peer"]
  assert "gem_jax.models.linear" in edges["gem_jax.train.setup"]
