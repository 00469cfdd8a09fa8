"""Group ids and labels of any integer dtype, against float64 references on
the ids as given.

Ids beyond int32 (int64, uint64, uint32 past 2**31) keep their relation:
concrete ones are renumbered on the host over both towers, so 2**32 + 5 and
5 stay two groups (a cast to int32 merged them). Ids that cannot be
renumbered where the loss sees them (traced inside the user's jit under x64,
or one device's shard inside shard_map) are one error, never a silent
merge. int64 labels are exact, and one outside int32 never wraps onto a
valid key.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from infcl_jax import contrastive_loss
from infcl_jax import sharded_contrastive_loss
from infcl_jax import sigmoid_loss
from tests import group_reference as gr
from tests import np_reference
from tests.helpers import assert_rel_close, loss_floor, rand_emb, seed_of

BIG = 2**32


def _grads(fn, x, y, t, b):
  return jax.value_and_grad(fn, argnums=(0, 1, 2, 3))(x, y, jnp.float32(t),
                                                      jnp.float32(b))


def _check(got, ref, x, y, t, b=0.0, what=""):
  val, grads = got
  assert abs(float(val) - ref[0]) <= 1e-5 * abs(ref[0]) + loss_floor(
      x, y, t, b), (what, float(val), ref[0])
  for name, g, r in zip(("dx", "dy", "dscale", "dbias"), grads, ref[1:]):
    assert_rel_close(g, r, 5e-5, atol=1e-6, what=f"{what} {name}")


def _as_objects(ids):
  """Ids as Python ints: the reference compares them exactly, whatever
  their dtypes."""
  return np.array([int(v) for v in np.asarray(ids)], dtype=object)


def _related_paired(rng, n, base, dtype):
  """Paired ids beyond int32: a few groups whose ids differ by multiples
  of 2**32 (one group each after a cast to int32 would wrap them)."""
  g = rng.integers(0, max(2, n // 3), n)
  return (base + g * BIG).astype(dtype)


@pytest.mark.parametrize("mode", ["mask", "positives"])
def test_int64_ids_past_int32_softmax(mode):
  rng = np.random.default_rng(seed_of("int64 softmax", mode))
  n, d, t = 21, 8, 9.0
  x, y = rand_emb(rng, n, d, jnp.float32), rand_emb(rng, n, d, jnp.float32)
  g = _related_paired(rng, n, 5, np.int64)
  assert len(np.unique(g.astype(np.int32))) < len(np.unique(g))  # A cast merges.
  got = _grads(lambda a, b, s, c: contrastive_loss(
      a, b, s, logit_bias=c, groups=g, group_mode=mode, backend="xla"),
               x, y, t, 0.0)
  ref = gr.clip_loss_and_grads(x, y, t, 0.0, _as_objects(g), _as_objects(g),
                               mode=mode)
  _check(got, ref, x, y, t, what=mode)


def test_issue_example_two_groups_stay_two():
  """Ids 2**32 + 5 and 5 are two groups: the loss is that of all-distinct
  ids (bitwise: both give the same int32 ids), not that of one merged group."""
  rng = np.random.default_rng(seed_of("issue example"))
  x, y = rand_emb(rng, 8, 16, jnp.float32), rand_emb(rng, 8, 16, jnp.float32)
  g64 = np.array([BIG + 5, 5, 1, 2, 3, 4, 6, 7], np.int64)
  merged = np.array([5, 5, 1, 2, 3, 4, 6, 7], np.int32)
  distinct = np.arange(8, dtype=np.int32)
  loss = float(contrastive_loss(x, y, 10.0, groups=g64, backend="xla"))
  assert loss == float(contrastive_loss(x, y, 10.0, groups=distinct,
                                        backend="xla"))
  assert loss != float(contrastive_loss(x, y, 10.0, groups=merged,
                                        backend="xla"))


@pytest.mark.parametrize("kind", ["int64_pair", "uint64_with_int64",
                                  "uint32_with_int32"])
def test_one_numbering_across_towers(kind):
  """(image_groups, text_groups) of a one-way loss with their own dtypes:
  equal ids relate across the towers, distinct ones never meet (a uint32
  past 2**31 cast to int32 would equal a negative int32 id)."""
  rng = np.random.default_rng(seed_of("across towers", kind))
  n_q, n_k, d, t = 13, 19, 8, 7.0
  x, y = rand_emb(rng, n_q, d, jnp.float32), rand_emb(rng, n_k, d, jnp.float32)
  pick = rng.integers(0, 4, n_q)
  if kind == "int64_pair":
    vals = np.array([-3 * BIG, 7, 7 + BIG, 2**62], np.int64)
    gq, gk = vals[pick], np.concatenate([vals[pick], rng.choice(vals, n_k - n_q)])
  elif kind == "uint64_with_int64":
    # NumPy compares uint64 with int64 through float64: the ids are far apart.
    gq = np.array([2**64 - 1, 2**63, 11, 12], np.uint64)[pick]
    gk = np.concatenate([np.array([-1, -2**63, 11, 12], np.int64)[pick],
                         np.full(n_k - n_q, 12, np.int64)])
  else:
    gq = np.array([2**32 - 1, 2**31, 3, 4], np.uint32)[pick]
    gk = np.concatenate([np.array([-1, -2**31, 3, 4], np.int32)[pick],
                         np.full(n_k - n_q, 4, np.int32)])
  got = _grads(lambda a, b, s, c: contrastive_loss(
      a, b, s, logit_bias=c, direction="image_to_text", groups=(gq, gk),
      backend="xla"), x, y, t, 0.0)
  ref = gr.clip_loss_and_grads(x, y, t, 0.0, _as_objects(gq), _as_objects(gk),
                               direction="image_to_text")
  _check(got, ref, x, y, t, what=kind)


def test_int64_ids_past_int32_sigmoid():
  rng = np.random.default_rng(seed_of("int64 sigmoid"))
  n, d, t, b = 17, 8, 8.0, -4.0
  x, y = rand_emb(rng, n, d, jnp.float32), rand_emb(rng, n, d, jnp.float32)
  g = _related_paired(rng, n, -BIG, np.int64)
  got = _grads(lambda a, c, s, e: sigmoid_loss(a, c, s, e, groups=g,
                                               backend="xla"), x, y, t, b)
  ref = gr.sigmoid_loss_and_grads(x, y, t, b, _as_objects(g))
  _check(got, ref, x, y, t, b, what="sigmoid")


def test_x64_concrete_and_traced_ids():
  """Under x64: a concrete int64 jax.Array is renumbered like NumPy ids;
  traced int64 ids are one ValueError (their values cannot be read), while
  traced int32 ids work."""
  rng = np.random.default_rng(seed_of("x64 ids"))
  x, y = rand_emb(rng, 12, 8, jnp.float32), rand_emb(rng, 12, 8, jnp.float32)
  g = _related_paired(rng, 12, 1, np.int64)
  want = float(contrastive_loss(x, y, 6.0, groups=g, backend="xla"))
  with jax.enable_x64(True):
    g_jax = jnp.asarray(g)
    assert g_jax.dtype == jnp.int64
    assert float(contrastive_loss(x, y, 6.0, groups=g_jax,
                                  backend="xla")) == want
    with pytest.raises(ValueError, match=r"groups \(int64\).*traced inside "
                       r"jit.*could merge groups"):
      jax.jit(lambda v: contrastive_loss(x, y, 6.0, groups=v))(g_jax)
    dense = np.unique(g, return_inverse=True)[1].astype(np.int32)
    # Inside another jit XLA may fuse differently: float32 rounding apart.
    assert float(jax.jit(lambda v: contrastive_loss(
        x, y, 6.0, groups=v, backend="xla"))(jnp.asarray(dense))) == (
            pytest.approx(want, rel=1e-6))


def _mesh(n=4):
  return Mesh(np.array(jax.devices()[:n]), ("d",))


def test_global_ids_past_int32_are_renumbered_globally():
  """sharded_contrastive_loss sees the global ids: renumbered once for the
  whole batch, equal ids on different devices stay related."""
  rng = np.random.default_rng(seed_of("sharded ids"))
  n, d, t = 24, 8, 7.0
  x, y = rand_emb(rng, n, d, jnp.float32), rand_emb(rng, n, d, jnp.float32)
  g = _related_paired(rng, n, 3 * BIG, np.int64)
  got = _grads(lambda a, b, s, c: sharded_contrastive_loss(
      a, b, s, logit_bias=c, mesh=_mesh(), axis_name="d", groups=g,
      backend="xla"), x, y, t, 0.0)
  ref = gr.clip_loss_and_grads(x, y, t, 0.0, _as_objects(g), _as_objects(g))
  _check(got, ref, x, y, t, what="sharded")


def test_shard_ids_past_int32_are_one_error():
  """Inside shard_map (axis_name) the ids are this device's shard: ids of
  a wider dtype cannot be renumbered there (device 0's 2**32 + 5 and device
  1's 5 must stay apart): one ValueError naming axis_name."""
  mesh = _mesh()
  rng = np.random.default_rng(seed_of("shard ids"))
  x, y = rand_emb(rng, 16, 8, jnp.float32), rand_emb(rng, 16, 8, jnp.float32)

  def local(a, b, v):
    return contrastive_loss(a, b, 5.0, axis_name="d", groups=v)

  with jax.enable_x64(True):
    g = jnp.asarray(np.arange(16) + BIG)
    with pytest.raises(ValueError, match=r"groups \(int64\) with axis_name"):
      jax.shard_map(local, mesh=mesh, in_specs=(P("d"), P("d"), P("d")),
                    out_specs=P())(x, y, g)


def test_int64_labels():
  """int64 labels: concrete in-range ones equal int32 ones; out of range a
  ValueError; traced ones under x64 past int32 give a NaN loss (2**32 + 3
  is not key 3) and in-range ones the int32 result."""
  rng = np.random.default_rng(seed_of("int64 labels"))
  n_q, n_k, t = 11, 15, 6.0
  x, y = rand_emb(rng, n_q, 8, jnp.float32), rand_emb(rng, n_k, 8, jnp.float32)
  lab = rng.integers(0, n_k, n_q)

  def loss(v):
    return contrastive_loss(x, y, t, direction="image_to_text", labels=v,
                            backend="xla")
  want = float(loss(lab.astype(np.int32)))
  ref = np_reference.clip_loss_and_grads(x, y, t, direction="image_to_text",
                                         labels=lab)[0]
  assert abs(want - ref) <= 1e-5 * ref
  assert float(loss(lab.astype(np.int64))) == want
  far = lab.astype(np.int64)
  far[0] = BIG + 3
  with pytest.raises(ValueError, match="labels must index the 15 rows"):
    loss(far)
  with jax.enable_x64(True):
    assert float(jax.jit(loss)(jnp.asarray(lab, jnp.int64))) == want
    assert np.isnan(float(jax.jit(loss)(jnp.asarray(far))))
