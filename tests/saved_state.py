"""Reading a trainer checkpoint's `state` item back as numpy arrays (tests only)."""
import os

import jax
import numpy as np
import orbax.checkpoint as ocp


def saved_state(workdir, step) -> dict:
  """The `state` item of checkpoint `step`, as {key path: numpy array} on the host."""
  path = os.path.join(workdir, "checkpoints", str(step), "state")
  ckptr = ocp.PyTreeCheckpointer()
  tree = ckptr.metadata(path).item_metadata.tree
  args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
  out = ckptr.restore(path, args=ocp.args.PyTreeRestore(restore_args=args))
  return {jax.tree_util.keystr(k): np.asarray(v)
          for k, v in jax.tree_util.tree_flatten_with_path(out)[0]}
