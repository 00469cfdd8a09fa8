"""One process of the 2-process ring test (see test_multiprocess.py).

Usage: python tests/multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT

Each process owns 4 CPU devices; ``jax.distributed.initialize`` joins them
into one 8-device system with gloo collectives, exactly as one process per
host (or per GPU) would on a cluster. Every process builds the same global
inputs from a fixed seed, runs ``sharded_contrastive_loss`` over all 8
devices, gathers the gradients and checks them against the float64
reference. Exit status 0 means every check passed.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402  (after sys.path)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402


def main(process_id, num_processes, port):
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"localhost:{port}",
                             num_processes=num_processes,
                             process_id=process_id,
                             initialization_timeout=120)
  from infcl_jax import BlockSizes, sharded_contrastive_loss
  from tests import np_reference

  assert jax.process_count() == num_processes, jax.process_count()
  assert jax.local_device_count() == 4, jax.local_devices()
  n = jax.device_count()
  assert n == 4 * num_processes, jax.devices()
  mesh = Mesh(np.array(jax.devices()), ("data",))
  tiles = BlockSizes(block_q=4, block_k=8)

  cases = [("ring", "both", 5, 5, 0.5), ("ring", "image_to_text", 3, 5, None),
           ("gather", "both", 3, 3, None)]
  for strategy, direction, bx, by, bias in cases:
    rng = np.random.default_rng(0)  # The same global batch in every process.
    x_np = rng.standard_normal((n * bx, 16)).astype(np.float32)
    y_np = rng.standard_normal((n * by, 16)).astype(np.float32)
    sharding = NamedSharding(mesh, P("data"))
    x = jax.make_array_from_callback(x_np.shape, sharding, lambda i: x_np[i])
    y = jax.make_array_from_callback(y_np.shape, sharding, lambda i: y_np[i])
    t = jnp.float32(4.0)
    b = jnp.float32(0.0 if bias is None else bias)

    def loss(x, y, t, b):
      return sharded_contrastive_loss(
          x, y, t, mesh=mesh, logit_bias=None if bias is None else b,
          direction=direction, strategy=strategy, block_sizes=tiles)

    val, (dx, dy, dt, db) = jax.jit(
        jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x, y, t, b)
    dx = multihost_utils.process_allgather(dx, tiled=True)
    dy = multihost_utils.process_allgather(dy, tiled=True)
    ref = np_reference.clip_loss_and_grads(
        x_np, y_np, 4.0, 0.0 if bias is None else bias, direction)
    got = [float(val), np.asarray(dx), np.asarray(dy), float(dt)]
    for name, a, r in zip(("loss", "dx", "dy", "dscale"), got, ref):
      err = np.max(np.abs(np.asarray(a, np.float64) - r))
      scale = max(np.max(np.abs(r)), 1e-3)
      if not err <= 5e-5 * scale:
        print(f"FAIL p{process_id} {strategy} {direction} {name}: "
              f"max err {err:.3e} vs max |ref| {scale:.3e}", flush=True)
        return 1
    print(f"ok p{process_id} {strategy} {direction} loss={float(val):.6f}",
          flush=True)
  jax.distributed.shutdown()
  return 0


if __name__ == "__main__":
  sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])))
