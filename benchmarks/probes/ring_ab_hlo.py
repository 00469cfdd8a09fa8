"""A/B of the ring's compiled schedule on 2 GPUs: where the backward's last
f32 accumulator send sits. Prints one JSON line per (program, b).

  PYTHONPATH=. AB_B=8192,65536 python3 benchmarks/probes/ring_ab_hlo.py

(BENCHMARKS.md "The backward's last accumulator send"; its logs are in
benchmarks/results/ring_2xh200_2026-11-30b/ab_hlo/.)"""
import json, os, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import PartitionSpec as P, NamedSharding
import infcl_jax
from benchmarks import ring_hlo, ring_steps
print("infcl_jax from", infcl_jax.__file__, "XLA_FLAGS", os.environ.get("XLA_FLAGS"), flush=True)
D = int(os.environ.get("AB_D", "768"))
gpus = jax.devices()[:2]
mesh = jax.sharding.Mesh(np.array(gpus), ("data",))
for b in [int(v) for v in os.environ.get("AB_B", "8192,65536").split(",")]:
  progs = {}
  loss = lambda x, y, t: infcl_jax.contrastive_loss(x, y, t, axis_name="data", strategy="ring")
  progs["test"] = jax.jit(jax.shard_map(jax.value_and_grad(loss, argnums=(0, 1, 2)), mesh=mesh,
      in_specs=(P("data"), P("data"), P()), out_specs=(P(), (P("data"), P("data"), P()))))
  m2 = ring_steps.make_mesh(2)
  progs["train_step"] = ring_steps.train_step("ring", m2, "auto", None)
  for name, fn in progs.items():
    mm = mesh if name == "test" else m2
    ax = "data" if name == "test" else ring_steps.AXIS
    x = jax.ShapeDtypeStruct((2 * b, D), jnp.bfloat16, sharding=NamedSharding(mm, P(ax)))
    t = jax.ShapeDtypeStruct((), jnp.float32, sharding=NamedSharding(mm, P()))
    try:
      hlo = fn.lower(x, x, t).compile().as_text()
    except Exception as e:
      print(json.dumps(dict(prog=name, b=b, error=str(e)[:300])), flush=True); continue
    found = ring_hlo.analyze(hlo)
    acc = [dict(size=r["size"], between_direct=dict(r.get("between_direct", {})), between_nested=dict(r.get("between_nested", {})), colls=r.get("colls_between")) for r in found if r["size"].startswith(f"f32[{b},{D}]")]
    nsync = sum(1 for r in found if r["kind"] == "sync" or r["is_sync"])
    print(json.dumps(dict(prog=name, b=b, acc=acc, n_sync=nsync, n=len(found)), default=str), flush=True)
