"""Every ```python block of README.md runs (on CPU, as written), and what it
prints is checked against a float64 numpy reference of the same inputs."""
import ast
import os
import pathlib
import re

import numpy as np
import pytest

from tests import group_reference
from tests import np_reference

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _block(marker):
  (code,) = [b for b in BLOCKS if marker in b]
  return code


def _run(code, capsys, name):
  """Runs a snippet; returns its namespace and printed words. A snippet may
  set environment variables (e.g. XLA_FLAGS for simulated devices): they
  must not leak into later tests of this worker."""
  before = dict(os.environ)
  ns = {"__name__": "__readme__"}
  try:
    exec(compile(code, f"README.md {name}", "exec"), ns)  # pylint: disable=exec-used
  finally:
    os.environ.clear()
    os.environ.update(before)
  return ns, capsys.readouterr().out.strip()


def test_every_snippet_is_checked_below():
  assert len(BLOCKS) == 6, "a README snippet was added or removed: check it"


def _printed_loss_and_shapes(out):
  loss, shapes = out.split(" ", 1)
  return float(loss), ast.literal_eval(shapes)


def test_quickstart_prints_the_exact_loss_and_grad_shapes(capsys):
  ns, out = _run(_block("contrastive_loss(img, txt, jnp.exp(log_t))"),
                 capsys, "quickstart")
  loss, shapes = _printed_loss_and_shapes(out)
  ref = np_reference.clip_loss_and_grads(ns["img"], ns["txt"],
                                         np.exp(float(ns["log_t"])))
  # A small loss (~0.017) from float32 LSEs of ~14: 1e-4 relative.
  assert loss == pytest.approx(ref[0], rel=1e-4)
  assert shapes == [(4096, 256), (4096, 256), ()]


def test_labels_and_groups_snippet_prints_the_exact_losses(capsys):
  ns, out = _run(_block("labels = jnp.array([0, 0, 2, 5])"), capsys,
                 "labels")
  first, second = out.splitlines()
  ref = np_reference.clip_loss_and_grads(
      ns["img"], ns["txt"], 10.0, direction="image_to_text",
      labels=np.asarray(ns["labels"]))
  assert float(first) == pytest.approx(ref[0], rel=1e-5)
  g = np.asarray(ns["groups"])
  masked, multi = map(float, second.split())
  for got, mode in ((masked, "mask"), (multi, "positives")):
    want = group_reference.clip_loss_and_grads(
        ns["pairs_img"], ns["pairs_txt"], 10.0, 0.0, g, g, mode)[0]
    assert got == pytest.approx(want, rel=1e-5), mode


def test_flax_head_snippet_prints_the_siglip_loss_and_grads(capsys):
  ns, out = _run(_block("ContrastiveLoss(loss=\"sigmoid\")"), capsys, "flax")
  loss, grads = out.split(" ", 1)
  grads = ast.literal_eval(grads)
  p = ns["params"]["params"]
  # SigLIP's init, as the README says: log 10 and -10.
  assert float(p["log_scale"]) == pytest.approx(np.log(10.0), rel=1e-6)
  assert float(p["bias"]) == -10.0
  unit = lambda a: (np.asarray(a, np.float64)
                    / np.linalg.norm(np.asarray(a, np.float64), axis=-1,
                                     keepdims=True))
  ref = np_reference.sigmoid_loss_and_grads(unit(ns["img"]), unit(ns["txt"]),
                                            10.0, -10.0)
  assert float(loss) == pytest.approx(ref[0], rel=1e-4)
  # d/d log_scale = t * dL/dt; d/d bias = dL/db.
  assert grads["params"]["log_scale"] == pytest.approx(10.0 * ref[3],
                                                       rel=1e-3, abs=1e-6)
  assert grads["params"]["bias"] == pytest.approx(ref[4], rel=1e-3, abs=1e-6)


def test_sigmoid_snippet_prints_the_exact_loss_and_grad_shapes(capsys):
  ns, out = _run(_block("sigmoid_loss(img, txt, jnp.exp(t_prime), b)"),
                 capsys, "sigmoid")
  loss, shapes = _printed_loss_and_shapes(out)
  ref = np_reference.sigmoid_loss_and_grads(ns["img"], ns["txt"], 10.0, -10.0)
  assert loss == pytest.approx(ref[0], rel=1e-5)
  assert shapes == [(2048, 128), (2048, 128), (), ()]


def test_across_devices_snippet_normalizes_and_runs_on_8_devices(capsys):
  """8 CPU devices (tests/conftest.py): both ways give the global loss of
  the whole batch, and the same gradients."""
  code = _block("sharded_contrastive_loss(a, b")
  assert "xla_force_host_platform_device_count=8" in code
  assert "jnp.linalg.norm(img" in code and "jnp.linalg.norm(txt" in code
  ns, out = _run(code, capsys, "across devices")
  n, loss, loss2, dgrad = out.split()
  assert int(n) == 8
  ref = np_reference.clip_loss_and_grads(ns["img"], ns["txt"], 10.0)
  # The loss (0.148) is a difference of float32 log-sum-exps of about 10
  # (the logits' scale): a few float32 roundings of those, as the ring's
  # merges and sums make them, are 1e-6 absolute, 1e-5 of this loss (the
  # ring gave +1.0e-5, one device -2.6e-6, on one CI machine).
  assert float(loss) == pytest.approx(ref[0], rel=1e-5, abs=5e-6)
  assert float(loss2) == pytest.approx(ref[0], rel=1e-5, abs=5e-6)
  assert float(dgrad) < 1e-5


def test_pretrained_tower_snippet_embeds_as_transformers_does(capsys):
  """The snippet's tower is the committed tiny HF CLIP: what it prints is
  that checkpoint's, and its embedding of the fixture images equals the one
  transformers computed (tests/fixtures/towers/expected.npz)."""
  root = README.parent
  cwd = os.getcwd()
  os.chdir(root)  # The snippet names the fixture relative to the checkout.
  try:
    ns, out = _run(_block("pretrained.load_image_tower("), capsys,
                   "pretrained tower")
  finally:
    os.chdir(cwd)
  tower = ns["tower"]
  assert out.startswith("(4, 20) float32 32 (0.48145466, 0.4578275, "
                        "0.40821073)"), out
  assert "hf-clip" in out
  expected = np.load(root / "tests" / "fixtures" / "towers" / "expected.npz")
  ref = expected["hf_clip/embedding"]
  emb = np.asarray(tower(expected["hf_clip/images"]), np.float64)
  assert np.max(np.abs(emb - ref)) <= 1e-5 * np.max(np.abs(ref))
