"""Bad input gives a clear error naming the argument and shapes."""
import jax.numpy as jnp
import numpy as np
import pytest

from infcl_jax import BlockSizes, contrastive_loss

X = jnp.ones((4, 8), jnp.float32)


@pytest.mark.parametrize("x,y,kw,exc,words", [
    (jnp.ones((4, 8, 1)), X, {}, ValueError, ["image_emb", "rank 2", "(4, 8, 1)"]),
    (X, jnp.ones((8,)), {}, ValueError, ["text_emb", "rank 2", "(8,)"]),
    (X, jnp.ones((4, 9)), {}, ValueError, ["feature dimension", "(4, 8)", "(4, 9)"]),
    (X, jnp.ones((5, 8)), {}, ValueError, ["direction='both'", "4", "5"]),
    (X, jnp.ones((3, 8)), {"direction": "image_to_text"}, ValueError,
     ["image_to_text", "at least as many"]),
    (jnp.ones((3, 8)), X, {"direction": "text_to_image"}, ValueError,
     ["text_to_image", "at least as many"]),
    (jnp.ones((4, 8), jnp.int32), X, {}, TypeError, ["image_emb", "int32"]),
    (X, X, {"direction": "sideways"}, ValueError, ["direction", "sideways"]),
    (X, X, {"backend": "cuda"}, ValueError, ["backend", "cuda"]),
    (jnp.ones((0, 8)), jnp.ones((0, 8)), {}, ValueError, ["image_emb", "non-empty"]),
])
def test_bad_inputs(x, y, kw, exc, words):
  with pytest.raises(exc) as e:
    contrastive_loss(x, y, 1.0, **kw)
  for w in words:
    assert w in str(e.value), (w, str(e.value))


def test_non_scalar_scale_and_bias():
  with pytest.raises(ValueError, match=r"logit_scale must be a scalar.*\(2,\)"):
    contrastive_loss(X, X, jnp.ones((2,)))
  with pytest.raises(ValueError, match=r"logit_bias must be a scalar.*\(1,\)"):
    contrastive_loss(X, X, 1.0, logit_bias=np.ones((1,)))
  with pytest.raises(TypeError, match="logit_scale"):
    contrastive_loss(X, X, jnp.asarray(1 + 2j))


def test_bad_block_sizes():
  with pytest.raises(ValueError, match="block_q"):
    BlockSizes(block_q=0, block_k=8)


def test_axis_name_outside_shard_map_is_an_error():
  with pytest.raises(ValueError,
                     match=r"axis_name='data' is not bound.*outside shard_map"):
    contrastive_loss(X, X, 1.0, axis_name="data")


@pytest.mark.parametrize("loss", ["softmax", "sigmoid"])
def test_block_sizes_as_a_dict_names_the_argument_and_the_type(loss):
  from infcl_jax import sigmoid_loss  # pylint: disable=import-outside-toplevel
  call = ((lambda bs: contrastive_loss(X, X, 1.0, block_sizes=bs))
          if loss == "softmax" else
          (lambda bs: sigmoid_loss(X, X, 1.0, -1.0, block_sizes=bs)))
  with pytest.raises(TypeError) as e:
    call({"block_q": 4})
  msg = str(e.value)
  assert msg == ("block_sizes must be None or an infcl_jax.BlockSizes, got "
                 "dict: use infcl_jax.BlockSizes(**{'block_q': 4})"), msg
  with pytest.raises(TypeError, match="got tuple$"):
    call((4, 4))


@pytest.mark.parametrize("name", ["xla", "pallas", "mosaic"])
def test_seam_guards_are_the_same_for_every_backend(name):
  """One home (backends/base.py): no statistic asked for, no gradient term,
  and a diagonal that a non-square block pair cannot have."""
  from infcl_jax.backends import registry  # pylint: disable=import-outside-toplevel
  be = registry.get(name, "softmax", platform="cpu")
  x, y = jnp.ones((5, 3), jnp.bfloat16), jnp.ones((7, 3), jnp.bfloat16)
  assert be.lse(x, y, 1.0, 0.0, rows=False, cols=False) == (None, None)
  dx, dy, dsc, dbi = be.lse_grad(x, y, 1.0, 0.0, None, None, 0.5, 0.5)
  assert dx.shape == (5, 3) and dy.shape == (7, 3)
  assert not (np.any(np.asarray(dx)) or np.any(np.asarray(dy)))
  assert float(dsc) == 0.0 and float(dbi) == 0.0
  for op in (lambda: be.sigmoid_sum(x, y, 1.0, 0.0, has_diagonal=True),
             lambda: be.sigmoid_grad(x, y, 1.0, 0.0, 1.0, has_diagonal=True)):
    with pytest.raises(ValueError, match=r"has_diagonal=True needs square "
                       r"block pairs.*5 rows.*7 rows"):
      op()


@pytest.mark.parametrize("loss", ["softmax", "sigmoid"])
def test_mesh_none_is_one_line(loss):
  from infcl_jax import sharded_contrastive_loss, sharded_sigmoid_loss  # pylint: disable=import-outside-toplevel
  call = ((lambda: sharded_contrastive_loss(X, X, 1.0, mesh=None))
          if loss == "softmax" else
          (lambda: sharded_sigmoid_loss(X, X, 1.0, -1.0, mesh=None)))
  with pytest.raises(TypeError) as e:
    call()
  msg = str(e.value)
  assert msg.startswith("mesh must be a jax.sharding.Mesh") and msg.endswith(
      "got NoneType") and "\n" not in msg, msg


def test_the_dtype_error_names_what_is_accepted():
  with pytest.raises(TypeError) as e:
    contrastive_loss(X, jnp.ones((4, 8), jnp.int8), 1.0)
  assert str(e.value) == (
      "text_emb must be float16, bfloat16, float32 or float64 (computed in "
      "float32), got dtype int8 (shape (4, 8))"), str(e.value)


def test_docstrings_say_what_the_code_does():
  """The public losses' docs: every registered backend named, the sigmoid
  loss's without ``labels`` (it takes none), the gradient convention's page
  and section that exist, and the float32 defaults of backends.precision."""
  import pathlib  # pylint: disable=import-outside-toplevel
  import re  # pylint: disable=import-outside-toplevel
  from infcl_jax import sigmoid_loss  # pylint: disable=import-outside-toplevel
  from infcl_jax.backends import precision, registry  # pylint: disable=import-outside-toplevel
  docs = {"contrastive_loss": contrastive_loss.__doc__,
          "sigmoid_loss": sigmoid_loss.__doc__}
  assert "labels" not in docs["sigmoid_loss"]
  losses_md = (pathlib.Path(__file__).resolve().parents[1] / "docs" /
               "losses.md").read_text()
  for name, doc in docs.items():
    for backend in registry.names():
      assert f'"{backend}"' in doc, (name, backend)
    flat = " ".join(doc.split())
    section, page, anchor = re.search(
        r'See "([^"]+)" in the docs: \S+/blob/main/(docs/\w+\.md)#([\w-]+)',
        flat).groups()
    assert page == "docs/losses.md" and f"\n## {section}\n" in losses_md
    assert anchor == section.lower().replace(" ", "-")
    assert (f'"default" from D = {precision.TF32_MIN_DEPTH} on and "high" '
            'below, "highest" on "xla"') in flat, name
  # The defaults the text describes (triton's class needs its extra).
  for backend in ("xla", "pallas", "mosaic"):
    want = "highest" if backend == "xla" else precision.BY_DEPTH
    assert registry.get(backend, "softmax").F32_DEFAULT == want, backend
