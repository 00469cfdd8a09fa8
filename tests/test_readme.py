"""Every ```python block of README.md and docs/*.md runs (on CPU, as written),
and what it prints is checked against a float64 numpy reference of the same
inputs.

Each block is one test, named by its page and its index on the page. A block
is matched to its check by a line of its code (`CHECKS` below): a block that
no check matches, or that two match, fails, so a new snippet comes with its
check and a changed one is looked at again."""
import ast
import dataclasses
import os
import pathlib
import re

import numpy as np
import pytest

from tests import group_reference
from tests import np_reference

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@dataclasses.dataclass(frozen=True)
class Block:
  page: str      # relative to the checkout
  index: int     # the block's place among the page's python blocks
  code: str

  @property
  def id(self):
    return f"{self.page}:{self.index}"


def _blocks():
  out = []
  for page in PAGES:
    text = page.read_text(encoding="utf-8")
    for i, code in enumerate(re.findall(r"^```python\n(.*?)^```", text,
                                        flags=re.S | re.M)):
      out.append(Block(str(page.relative_to(ROOT)), i, code))
  return out


BLOCKS = _blocks()


def _run(block, capsys):
  """Runs a snippet from the checkout's root (snippets name files relative to
  it); returns its namespace and printed words. A snippet may set
  environment variables (e.g. XLA_FLAGS for simulated devices): they must not
  leak into later tests of this worker."""
  before, cwd = dict(os.environ), os.getcwd()
  ns = {"__name__": "__docs__"}
  os.chdir(ROOT)
  try:
    exec(compile(block.code, block.id, "exec"), ns)  # pylint: disable=exec-used
  finally:
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(before)
  return ns, capsys.readouterr().out.strip()


def _printed_loss_and_shapes(out):
  loss, shapes = out.split(" ", 1)
  return float(loss), ast.literal_eval(shapes)


def _unit(a):
  a = np.asarray(a, np.float64)
  return a / np.linalg.norm(a, axis=-1, keepdims=True)


def check_quickstart(ns, out, code):
  del code
  loss, shapes = _printed_loss_and_shapes(out)
  ref = np_reference.clip_loss_and_grads(ns["img"], ns["txt"],
                                         np.exp(float(ns["log_t"])))
  # A small loss (~0.017) from float32 LSEs of ~14: 1e-4 relative.
  assert loss == pytest.approx(ref[0], rel=1e-4)
  assert shapes == [(1024, 128), (1024, 128), ()]


def check_labels_and_groups(ns, out, code):
  del code
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


def check_flax_head(ns, out, code):
  del code
  loss, grads = out.split(" ", 1)
  grads = ast.literal_eval(grads)
  p = ns["params"]["params"]
  # SigLIP's init, as the page says: log 10 and -10.
  assert float(p["log_scale"]) == pytest.approx(np.log(10.0), rel=1e-6)
  assert float(p["bias"]) == -10.0
  ref = np_reference.sigmoid_loss_and_grads(_unit(ns["img"]), _unit(ns["txt"]),
                                            10.0, -10.0)
  assert float(loss) == pytest.approx(ref[0], rel=1e-4)
  # d/d log_scale = t * dL/dt; d/d bias = dL/db.
  assert grads["params"]["log_scale"] == pytest.approx(10.0 * ref[3],
                                                       rel=1e-3, abs=1e-6)
  assert grads["params"]["bias"] == pytest.approx(ref[4], rel=1e-3, abs=1e-6)


def check_flax_step(ns, out, code):
  """The first step's loss is the float64 CLIP loss of the towers' initial
  embeddings at the head's initial temperature, and training lowers it."""
  del code
  first, last = map(float, out.split())
  import jax  # pylint: disable=import-outside-toplevel
  init = ns["model"].init(jax.random.key(1), ns["images"], ns["texts"])
  dense = lambda name, x: (np.asarray(x, np.float64)
                           @ np.asarray(init["params"][name]["kernel"], np.float64)
                           + np.asarray(init["params"][name]["bias"], np.float64))
  head = init["params"]["head"]
  assert "bias" not in head   # softmax: no logit bias
  ref = np_reference.clip_loss_and_grads(
      _unit(dense("img", ns["images"])), _unit(dense("txt", ns["texts"])),
      float(np.exp(np.float64(head["log_scale"]))))[0]
  assert first == pytest.approx(ref, rel=1e-4)
  assert len(ns["losses"]) == 20 and last == ns["losses"][-1]
  assert last < 0.1 * first


def check_nnx_step(ns, out, code):
  """The NNX twin of ``check_flax_step``: the first step's loss is the
  float64 CLIP loss of a freshly made model's embeddings (the same Rngs give
  the same initial parameters), and training lowers it."""
  del code
  first, last = map(float, out.split())
  from flax import nnx  # pylint: disable=import-outside-toplevel
  fresh = ns["TwoTowers"](nnx.Rngs(1))
  dense = lambda layer, x: (np.asarray(x, np.float64)
                            @ np.asarray(layer.kernel[...], np.float64)
                            + np.asarray(layer.bias[...], np.float64))
  assert fresh.head.bias is None   # softmax: no logit bias
  ref = np_reference.clip_loss_and_grads(
      _unit(dense(fresh.img, ns["images"])), _unit(dense(fresh.txt, ns["texts"])),
      float(np.exp(np.float64(fresh.head.log_scale[...]))))[0]
  assert first == pytest.approx(ref, rel=1e-4)
  assert len(ns["losses"]) == 20 and last == ns["losses"][-1]
  assert last < 0.1 * first


def check_sigmoid(ns, out, code):
  del code
  loss, shapes = _printed_loss_and_shapes(out)
  ref = np_reference.sigmoid_loss_and_grads(ns["img"], ns["txt"], 10.0, -10.0)
  assert loss == pytest.approx(ref[0], rel=1e-5)
  assert shapes == [(2048, 128), (2048, 128), (), ()]


# The loss (~0.148) is a difference of float32 log-sum-exps of about 10 (the
# logits' scale): a few float32 roundings of those, as the ring's merges and
# sums make them, are 1e-6 absolute, 1e-5 of this loss (the ring gave +1.0e-5,
# one device -2.6e-6, on one CI machine).
_RING_TOL = dict(rel=1e-5, abs=5e-6)


def check_across_devices(ns, out, code):
  """Both ways (sharded arrays; the user's own shard_map) give the global
  loss of the whole batch, and the same gradients."""
  assert "xla_force_host_platform_device_count=8" in code
  assert "jnp.linalg.norm(img" in code and "jnp.linalg.norm(txt" in code
  n, loss, loss2, dgrad = out.split()
  assert int(n) == 8
  ref = np_reference.clip_loss_and_grads(np.asarray(ns["img"]),
                                         np.asarray(ns["txt"]), 10.0)
  assert float(loss) == pytest.approx(ref[0], **_RING_TOL)
  assert float(loss2) == pytest.approx(ref[0], **_RING_TOL)
  assert float(dgrad) < 1e-5
  # The sharded loss's gradients are the global ones of the whole batch.
  for got, want in ((ns["d_img"], ref[1]), (ns["d_txt"], ref[2])):
    np.testing.assert_allclose(np.asarray(got, np.float64), want,
                               rtol=0, atol=1e-5 * np.abs(want).max())


def check_precision(ns, out, code):
  """Each precision the block asks for gives the float64 loss (on the CPU
  every one is full float32: this pins the API and the printed numbers)."""
  del code
  ref = np_reference.clip_loss_and_grads(ns["img"], ns["txt"], 50.0)[0]
  assert ref > 1e-2   # a loss the roundings below are small against
  # float32 log-sum-exps of about 50 (the scale) round at a few 1e-6.
  for got in map(float, out.split()):
    assert got == pytest.approx(ref, rel=1e-4)
  assert len(out.split()) == 3


def check_pretrained_tower(ns, out, code):
  """The snippet's tower is the committed tiny HF CLIP: what it prints is
  that checkpoint's, and its embedding of the fixture images equals the one
  transformers computed (tests/fixtures/towers/expected.npz)."""
  del code
  tower = ns["tower"]
  assert out.startswith("(4, 20) float32 32 (0.48145466, 0.4578275, "
                        "0.40821073)"), out
  assert "hf-clip" in out
  expected = np.load(ROOT / "tests" / "fixtures" / "towers" / "expected.npz")
  ref = expected["hf_clip/embedding"]
  emb = np.asarray(tower(expected["hf_clip/images"]), np.float64)
  assert np.max(np.abs(emb - ref)) <= 1e-5 * np.max(np.abs(ref))


# A line of a block's code -> its check.
CHECKS = {
    "contrastive_loss(img, txt, jnp.exp(log_t))": check_quickstart,
    "labels = jnp.array([0, 0, 2, 5])": check_labels_and_groups,
    'head = ContrastiveLoss(loss="sigmoid")': check_flax_head,
    "class TwoTowers(nn.Module):": check_flax_step,
    "class TwoTowers(nnx.Module):": check_nnx_step,
    "sigmoid_loss(img, txt, jnp.exp(t_prime), b)": check_sigmoid,
    "def per_device(img_shard, txt_shard):": check_across_devices,
    'contrastive_loss(img, txt, 50.0, precision="default")': check_precision,
    "pretrained.load_image_tower(": check_pretrained_tower,
}


def _checks_of(block):
  return [check for marker, check in CHECKS.items() if marker in block.code]


def _needs_trainer(block):
  return re.search(r"^\s*(from|import) train\b", block.code, re.M) is not None


def test_every_block_has_exactly_one_check_and_every_check_a_block():
  assert BLOCKS, "no ```python block found"
  for block in BLOCKS:
    assert len(_checks_of(block)) == 1, (
        f"{block.id}: {len(_checks_of(block))} checks match; give it one "
        f"in tests/test_readme.py CHECKS")
  used = {c for b in BLOCKS for c in _checks_of(b)}
  unused = [c.__name__ for c in CHECKS.values() if c not in used]
  assert not unused, f"checks whose block is gone: {unused}"


def _ids(blocks):
  return [b.id for b in blocks]


_LIBRARY = [b for b in BLOCKS if not _needs_trainer(b)]
_TRAINER = [b for b in BLOCKS if _needs_trainer(b)]


@pytest.mark.parametrize("block", _LIBRARY, ids=_ids(_LIBRARY))
def test_snippet_runs_and_prints_what_the_reference_computes(block, capsys):
  (check,) = _checks_of(block)
  ns, out = _run(block, capsys)
  check(ns, out, block.code)


# The blocks that import the trainer (train/) need its packages: the jax 0.12
# leg of scripts/test.sh, which has the library's only, deselects them by
# this test's name.
@pytest.mark.parametrize("block", _TRAINER, ids=_ids(_TRAINER))
def test_pretrained_tower_snippet_embeds_as_transformers_does(block, capsys):
  (check,) = _checks_of(block)
  ns, out = _run(block, capsys)
  check(ns, out, block.code)
