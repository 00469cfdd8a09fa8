"""The installed wheel, used as a library user would (scripts/wheel_smoke.sh).

Run from a directory outside the checkout, in a venv where infcl-jax was
installed from its wheel: the package is imported from site-packages; its
metadata is complete (classifiers, project URLs, authors, the license and
its files, a Markdown long description without relative links); the
wheel holds the library and its license only; one loss and its gradients
equal a float64 numpy computation; the linen and NNX heads give the same
loss and gradients for the same parameters; and the README's NNX example
runs and trains. Exits non-zero with one line per failure.
"""
import argparse
import importlib.metadata
import math
import os
import re
import sys
import tarfile
import zipfile

import numpy as np

FAILURES = []


def check(ok, what):
  print(f"  {'ok  ' if ok else 'FAIL'} {what}", file=sys.stderr)
  if not ok:
    FAILURES.append(what)


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def clip_float64(x, y, t):
  """CLIP loss and its gradients w.r.t. x, y and the scale, in float64."""
  s0 = x @ y.T
  s = t * s0
  n = s.shape[0]

  def lse(a, axis):
    m = a.max(axis=axis, keepdims=True)
    return np.squeeze(m, axis) + np.log(np.exp(a - m).sum(axis=axis))

  r, c = lse(s, 1), lse(s, 0)
  loss = 0.5 * (np.mean(r - np.diag(s)) + np.mean(c - np.diag(s)))
  g = (np.exp(s - r[:, None]) + np.exp(s - c[None, :]) - 2 * np.eye(n)) / (2 * n)
  return loss, t * g @ y, t * g.T @ x, float(np.sum(g * s0))


def check_install(root, wheel, sdist):
  import infcl_jax  # pylint: disable=import-outside-toplevel
  where = os.path.realpath(infcl_jax.__file__)
  check("site-packages" in where and not where.startswith(root + os.sep),
        f"infcl_jax imported from the venv ({where})")
  meta = importlib.metadata.metadata("infcl-jax")
  check(meta["Version"] == infcl_jax.__version__,
        f"version {meta['Version']} == infcl_jax.__version__")
  check(meta.get("License-Expression") == "Apache-2.0",
        f"License-Expression {meta.get('License-Expression')!r}")
  files = [str(f) for f in importlib.metadata.files("infcl-jax")]
  for name in ("LICENSE", "NOTICE"):
    check(any(f.endswith(f"licenses/{name}") for f in files),
          f"the {name} file installed with the metadata")
  check_metadata(meta)
  names = zipfile.ZipFile(wheel).namelist()
  tops = {n.split("/")[0] for n in names}
  check(all(t == "infcl_jax" or t.endswith(".dist-info") for t in tops),
        f"the wheel holds the library only: {sorted(tops)}")
  check("infcl_jax/nnx.py" in names and "infcl_jax/flax.py" in names,
        "the wheel holds both Flax heads")
  with tarfile.open(sdist) as tar:
    members = {m.name.split("/", 1)[-1] for m in tar.getmembers()}
  check({"LICENSE", "NOTICE", "README.md", "docs/pypi.md",
         "pyproject.toml"} <= members,
        "the sdist holds LICENSE, NOTICE, README.md, docs/pypi.md and "
        "pyproject.toml")


# The project's one placeholder address (pyproject's [project.urls]).
PROJECT_URL = "https://github.com/infcl-jax/infcl-jax"
_MD_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)")
_HTML_REF = re.compile(r"""<(?:img|a)\b[^>]*?(?:src|href)=["']([^"']+)""", re.I)


def relative_links(markdown):
  """The link and image targets of a Markdown text that are not absolute
  URLs (an index shows the text away from the checkout, where they break)."""
  targets = _MD_LINK.findall(markdown) + _HTML_REF.findall(markdown)
  return [t for t in targets if not re.match(r"^(https?:|mailto:)", t)]


def check_metadata(meta):
  """What an index shows about the package: its classifiers (known trove
  classifiers, when trove-classifiers is installed), its project URLs,
  authors, license, and a Markdown long description with absolute links
  only."""
  classifiers = meta.get_all("Classifier") or []
  check("Programming Language :: Python :: 3.12" in classifiers
        and any(c.startswith("Topic :: ") for c in classifiers)
        and any(c.startswith("Development Status :: ") for c in classifiers),
        f"classifiers: {len(classifiers)}, with the Python version, a topic "
        "and a development status")
  check(not any(c.startswith("License :: ") for c in classifiers),
        "no License classifier beside the license expression (PEP 639)")
  try:
    from trove_classifiers import classifiers as known  # pylint: disable=import-outside-toplevel
  except ImportError:
    known = None
  if known is not None:
    unknown = sorted(set(classifiers) - set(known))
    check(not unknown, f"every classifier is a trove classifier: {unknown}")
  urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL") or [])
  check({"Homepage", "Repository", "Issues", "Documentation"} <= set(urls)
        and all(u.startswith(PROJECT_URL) for u in urls.values()),
        f"project URLs under {PROJECT_URL}: {sorted(urls)}")
  author = meta.get("Author") or meta.get("Author-email") or ""
  check("infcl-jax authors" in author, f"authors: {author!r}")
  check(meta.get("Requires-Python") == ">=3.12",
        f"Requires-Python {meta.get('Requires-Python')!r}")
  check((meta.get("Description-Content-Type") or "").startswith("text/markdown"),
        f"long description type {meta.get('Description-Content-Type')!r}")
  body = meta.get_payload() or ""
  check("contrastive_loss" in body and len(body.splitlines()) <= 100,
        f"a short long description ({len(body.splitlines())} lines)")
  bad = relative_links(body)
  check(not bad, f"the long description has no relative link: {bad}")


def check_loss():
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from infcl_jax import contrastive_loss  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  x = rng.standard_normal((37, 24))
  y = x + 0.8 * rng.standard_normal((37, 24))
  x /= np.linalg.norm(x, axis=1, keepdims=True)
  y /= np.linalg.norm(y, axis=1, keepdims=True)
  t = 9.0
  loss, (dx, dy, dt) = jax.value_and_grad(contrastive_loss, argnums=(0, 1, 2))(
      jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32), jnp.float32(t))
  ref = clip_float64(x, y, t)
  check(abs(float(loss) - ref[0]) <= 1e-5 * ref[0],
        f"contrastive_loss {float(loss):.7f} vs float64 {ref[0]:.7f}")
  for name, got, want in (("d image", dx, ref[1]), ("d text", dy, ref[2]),
                          ("d scale", dt, ref[3])):
    err = rel_err(got, want)
    check(err <= 1e-4, f"{name} within {err:.1e} of float64")


def check_heads():
  """The linen and NNX heads, the same parameter values: the same loss and
  gradients (softmax with a bias, and sigmoid)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from infcl_jax import flax as linen_head  # pylint: disable=import-outside-toplevel
  from infcl_jax import nnx as nnx_head  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((21, 16)), jnp.float32)
  y = jnp.asarray(rng.standard_normal((21, 16)), jnp.float32)
  for kw, params in (({"use_bias": True}, {"log_scale": 2.1, "bias": 0.3}),
                     ({"loss": "sigmoid"}, {"log_scale": 1.4, "bias": -2.0})):
    linen = linen_head.ContrastiveLoss(**kw)
    p = {k: jnp.float32(v) for k, v in params.items()}
    want, (g_p, g_x) = jax.value_and_grad(
        lambda p, a: linen.apply({"params": p}, a, y), argnums=(0, 1))(p, x)
    head = nnx_head.ContrastiveLoss(**kw)
    for k, v in params.items():
      getattr(head, k)[...] = jnp.float32(v)
    got, (g_h, h_x) = nnx.value_and_grad(lambda h, a: h(a, y),
                                         argnums=(0, 1))(head, x)
    name = kw.get("loss", "softmax")
    check(abs(float(got) - float(want)) <= 1e-6 * abs(float(want)),
          f"{name}: NNX head loss {float(got):.7f} == linen {float(want):.7f}")
    errs = [rel_err(getattr(g_h, k)[...], g_p[k]) for k in params]
    errs.append(rel_err(h_x, g_x))
    check(max(errs) <= 1e-5, f"{name}: NNX head gradients == linen "
          f"(worst {max(errs):.1e})")


def check_readme_nnx(readme):
  text = open(readme, encoding="utf-8").read()
  blocks = [b for b in re.findall(r"^```python\n(.*?)^```", text,
                                  flags=re.S | re.M)
            if "class TwoTowers(nnx.Module):" in b]
  check(len(blocks) == 1, "README has one NNX example")
  if not blocks:
    return
  ns = {"__name__": "__readme__"}
  exec(compile(blocks[0], "README.md (NNX)", "exec"), ns)  # pylint: disable=exec-used
  losses = ns["losses"]
  check(len(losses) == 20 and all(map(math.isfinite, losses))
        and losses[-1] < 0.1 * losses[0],
        f"README NNX example trains: {losses[0]:.4f} -> {losses[-1]:.4f}")


def check_link_finder():
  found = relative_links(
      "[a](https://x.org/a.md) ![b](docs/memory_wall.png) [c](guide/page.md#x)"
      " [d](#anchor) <img src='pic.png'> <a href=\"https://x.org\">e</a>"
      " `[f](in/code.md)`")
  check(found == ["docs/memory_wall.png", "guide/page.md#x", "#anchor",
                  "in/code.md", "pic.png"],
        f"the relative-link finder finds relative links: {found}")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--readme", required=True)
  ap.add_argument("--wheel", required=True)
  ap.add_argument("--sdist", required=True)
  args = ap.parse_args()
  root = os.path.realpath(os.path.dirname(args.readme))
  check(not os.path.realpath(os.getcwd()).startswith(root + os.sep)
        and os.path.realpath(os.getcwd()) != root,
        "run from outside the checkout")
  check_link_finder()
  check_install(root, args.wheel, args.sdist)
  check_loss()
  check_heads()
  check_readme_nnx(args.readme)
  if FAILURES:
    sys.exit(f"wheel smoke: {len(FAILURES)} failed: " + "; ".join(FAILURES))
  print("wheel smoke: all passed", file=sys.stderr)


if __name__ == "__main__":
  main()
