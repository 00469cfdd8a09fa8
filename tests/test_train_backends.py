"""The trainer takes every loss backend the library registers, and the
library's other choices (loss family, group mode), from the library's own
lists: a backend registered there needs no second list here."""
import jax
import jax.numpy as jnp
import pytest

import infcl_jax
from infcl_jax.backends import registry
from tests import helpers
from train import config_base
from train import model as model_lib


def _tiny(**overrides):
  from configs import lit_demo  # pylint: disable=g-import-not-at-top
  return helpers.set_overrides(lit_demo.get_config("tiny"), overrides)


def test_every_registered_backend_passes_the_config_check():
  names = infcl_jax.backend_names()
  assert {"auto", "reference", "xla", "pallas", "mosaic", "triton"} <= set(
      names)
  for name in names:
    config_base.check_config(_tiny(**{"loss.backend": name}))


def test_a_backend_registered_later_is_taken_with_no_trainer_change(
    monkeypatch):
  monkeypatch.setitem(registry._TABLE, "my_tiles",  # pylint: disable=protected-access
                      "infcl_jax.backends.xla")
  config_base.check_config(_tiny(**{"loss.backend": "my_tiles"}))


@pytest.mark.parametrize("key,value", [
    ("loss.backend", "mosiac"), ("loss.name", "clip"),
    ("loss.group_mode", "multi")])
def test_an_unknown_choice_is_one_line_that_lists_the_known(key, value):
  with pytest.raises(ValueError) as e:
    config_base.check_config(_tiny(**{key: value}))
  message = str(e.value)
  assert "\n" not in message
  assert message.startswith(f"config.{key} must be one of ")
  assert message.endswith(f"; got {value!r}")
  known = {"loss.backend": infcl_jax.backend_names(),
           "loss.name": infcl_jax.LOSS_FAMILIES,
           "loss.group_mode": infcl_jax.GROUP_MODES}[key]
  assert all(name in message for name in known), message


@pytest.mark.parametrize("backend,kernels", [
    ("mosaic", {"infcl_mosaic_lse_fwd", "infcl_mosaic_lse_bwd_panel"}),
    ("xla", set())])
def test_the_trainers_head_runs_the_backend_it_names(backend, kernels):
  """The head the trainer builds from ``config.loss`` (``model.make_head``)
  runs the named backend's kernels, forward and backward: the name reaches
  the library, not only the check (the trainer refused mosaic before).
  Traced, not run: the kernels' numbers are their own tests' (the Mosaic
  interpreter at the GPU's tiles: ``test_interpreter_watchdog.py``)."""
  x = jnp.ones((16, 64), jnp.bfloat16)  # mosaic's own kernels take 16 bits.
  head = model_lib.make_head(_tiny(**{"loss.backend": backend}))
  params = jax.eval_shape(head.init, jax.random.key(0), x, x)["params"]
  traced = jax.make_jaxpr(jax.value_and_grad(
      lambda p, x, y: head.apply({"params": p}, x, y), argnums=(0, 1, 2)))(
          params, x, x)
  assert {name for name, _ in helpers.kernel_calls(traced)} == kernels
