"""Serves an exported artifact (scripts/export.py) over HTTP with the standard library only.

  python examples/serve_http.py --artifact artifacts/tiny --port 8080
  curl -s localhost:8080/predict -d '{"dense": [[0.1, -0.3]], "ids": {"user": [[17]], ...}}'
  -> {"probs": [[0.21, 0.05]], "tasks": ["click", "conversion"], "rows": 1}

POST /predict takes one JSON batch in the loader's fields (gem_jax/serving/loader.py:
dense, ids (raw ids, the reader's: e.g. int(hex, 16) for a Criteo categorical), weights,
seq, domain) and answers the probabilities per task; a malformed request gets a 400
with the loader's message (which names the field). GET /manifest returns the feature
spec. `--self_test` starts the server on a free port, sends it a request of random rows
in the manifest's shapes and one with a bad field, and prints both answers.
"""
import argparse
import http.server
import json
import os
import sys
import threading
import urllib.error
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import gem_jax.serving  # noqa: E402
from gem_jax.serving.bench import random_batch  # noqa: E402


def handler(predict):
  """A BaseHTTPRequestHandler class scoring with `predict` (a loaded artifact)."""
  lock = threading.Lock()   # one request on the device at a time

  class Handler(http.server.BaseHTTPRequestHandler):
    def _send(self, code: int, body: dict) -> None:
      data = json.dumps(body).encode()
      self.send_response(code)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(data)))
      self.end_headers()
      self.wfile.write(data)

    def do_GET(self):  # noqa: N802 - http.server's name
      if self.path != "/manifest":
        return self._send(404, {"error": f"unknown path {self.path}"})
      m = predict.manifest
      return self._send(200, {k: m[k] for k in ("spec", "features", "inputs", "batch_sizes")})

    def do_POST(self):  # noqa: N802
      if self.path != "/predict":
        return self._send(404, {"error": f"unknown path {self.path}"})
      try:
        batch = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        with lock:
          probs = predict(batch)
      except (ValueError, TypeError, KeyError) as e:
        return self._send(400, {"error": str(e)})
      return self._send(200, {"probs": probs.tolist(), "tasks": list(predict.tasks),
                              "rows": len(probs)})

    def log_message(self, fmt, *args):  # quiet
      del fmt, args

  return Handler


def as_json(tree):
  """numpy leaves -> lists (the JSON a client would send)."""
  if isinstance(tree, dict):
    return {k: as_json(v) for k, v in tree.items()}
  return tree.tolist()


def post(url: str, body: dict) -> tuple[int, dict]:
  req = urllib.request.Request(url, json.dumps(body).encode(),
                               {"Content-Type": "application/json"})
  try:
    with urllib.request.urlopen(req, timeout=60) as r:
      return r.status, json.loads(r.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--artifact", required=True)
  p.add_argument("--host", default="127.0.0.1")
  p.add_argument("--port", type=int, default=8080)
  p.add_argument("--self_test", action="store_true", help="serve, send two requests, stop")
  args = p.parse_args(argv)
  predict = gem_jax.serving.load(args.artifact)
  server = http.server.ThreadingHTTPServer(
      (args.host, 0 if args.self_test else args.port), handler(predict))
  if not args.self_test:
    print(f"serving {args.artifact} on http://{args.host}:{server.server_port}/predict",
          flush=True)
    server.serve_forever()
    return
  threading.Thread(target=server.serve_forever, daemon=True).start()
  url = f"http://{args.host}:{server.server_port}/predict"
  req = as_json(random_batch(predict.manifest, rows=3))
  code, body = post(url, req)
  print("ok", code, json.dumps(body))
  bad = dict(req, dense=[[0.0]] * 3)                       # wrong width
  code, body = post(url, bad)
  print("bad", code, json.dumps(body))
  server.shutdown()


if __name__ == "__main__":
  main()
