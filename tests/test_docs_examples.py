"""The runnable examples in docs/ run as written."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _first_python_block(path: str) -> str:
  with open(path, encoding="utf-8") as f:
    m = re.search(r"```python\n(.*?)```", f.read(), re.S)
  assert m, f"{path}: no python block"
  return m.group(1)


def test_embedding_md_example_runs(tmp_path):
  script = tmp_path / "example.py"
  script.write_text(_first_python_block(os.path.join(ROOT, "docs", "embedding.md")))
  env = {**os.environ, "PYTHONPATH": ROOT}
  env.pop("XLA_FLAGS", None)   # the example sets its own device count
  p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                     timeout=600, env=env, check=False)
  assert p.returncode == 0, p.stderr[-3000:]
  last = p.stdout.strip().splitlines()[-1]          # "<loss> (100000, 16)"
  loss, shape = last.split(" ", 1)
  assert float(loss) > 0 and shape == "(100000, 16)"
  assert "embedding plan: mesh replica=2 x shard=4" in p.stdout
