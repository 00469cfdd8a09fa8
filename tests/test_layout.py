"""The package's shape: layers, no import cycles, no eager kernel imports.

The import graph is read from the source (``ast``), so these tests see
imports inside functions too, and need no GPU.
"""
import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "infcl_jax"
TRAIN = ROOT / "train"

# Each layer may import only the layers below it (and the shared base
# modules); the public API sits on top.
LAYERS = ["kernels", "backends", "losses", "api"]
BASE = {"infcl_jax._axes", "infcl_jax._device", "infcl_jax._math",
        "infcl_jax.block_sizes"}


def _module_name(path, pkg=PKG):
  rel = path.relative_to(pkg.parent).with_suffix("")
  parts = list(rel.parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def _modules(pkg=PKG):
  return {_module_name(p, pkg): p for p in pkg.rglob("*.py")}


def _imports(path, mods, prefixes):
  """The modules of ``mods`` (and any named by ``prefixes``) that the file
  imports, at its top or inside functions, classes and branches."""
  deps = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      # `from a import b` imports module a.b if there is one, else a.
      targets = [f"{node.module}.{a.name}"
                 if f"{node.module}.{a.name}" in mods else node.module
                 for a in node.names]
    else:
      continue
    deps |= {t for t in targets if t.split(".")[0] in prefixes}
  return deps


def _import_graph(pkg=PKG):
  """{module: {the package's modules it imports explicitly}}."""
  mods = _modules(pkg)
  graph = {}
  for name, path in mods.items():
    deps = _imports(path, mods, {pkg.name})
    assert all(d in mods for d in deps), (name, deps - set(mods))
    graph[name] = deps - {name}
  return graph


def _find_cycle(graph):
  state, stack = {}, []

  def visit(v):
    state[v] = "open"
    stack.append(v)
    for w in sorted(graph[v]):
      if state.get(w) == "open":
        return stack[stack.index(w):] + [w]
      if w not in state:
        found = visit(w)
        if found:
          return found
    stack.pop()
    state[v] = "done"
    return None

  for v in sorted(graph):
    if v not in state:
      found = visit(v)
      if found:
        return found
  return None


def test_finder_sees_a_cycle():
  """The checker itself: a planted cycle is found, a DAG is not."""
  assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert _find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycles():
  graph = _import_graph()
  assert len(graph) > 15  # The walk found the package.
  assert _find_cycle(graph) is None, " -> ".join(_find_cycle(graph))


def test_no_import_cycles_in_the_trainer():
  # train/ too, imports inside functions included: no module imports one
  # that imports it back (train/data: sources, then the decoders, then the
  # pipeline that batches, prefetches and places).
  graph = _import_graph(TRAIN)
  assert len(graph) > 40 and "train.data.decode.gpu" in graph
  assert graph["train.data.pipeline"] >= {"train.data.batching",
                                          "train.data.decode.choice"}
  assert _find_cycle(graph) is None, " -> ".join(_find_cycle(graph))


def test_the_decoders_import_neither_each_other_nor_the_pipeline():
  # Each decoder is one file that changes without the other: they share
  # only the lower modules (image, source, stopwatch).
  graph = _import_graph(TRAIN)
  upper = {"train.data.decode.choice", "train.data.decode.gpu",
           "train.data.batching", "train.data.pipeline", "train.data"}
  assert not graph["train.data.decode.gpu"] & upper, graph["train.data.decode.gpu"]
  assert not graph["train.data.batching"] & upper, graph["train.data.batching"]
  assert not graph["train.data.decode.host"] - {"train.data.sources.contract"}


def test_the_library_imports_neither_the_trainer_nor_the_benchmarks():
  mods = _modules()
  bad = {name: deps for name, path in mods.items()
         if (deps := _imports(path, mods, {"train", "benchmarks"}))}
  assert not bad, bad


def _layer(mod):
  parts = mod.split(".")
  return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def test_layers_import_only_downwards():
  bad = []
  for mod, deps in _import_graph().items():
    me = _layer(mod)
    if me is None:
      continue
    for d in deps - BASE:
      other = _layer(d)
      # The top layer may use the package's other modules (checks, the
      # reference); the lower ones only lower layers and the base.
      if (other is None and me != "api") or (
          other is not None and LAYERS.index(other) > LAYERS.index(me)):
        bad.append(f"{mod} -> {d}")
  assert not bad, bad


def test_backend_modules_are_registered_and_found():
  """Every module under backends/ that defines BACKEND is in the table."""
  from infcl_jax.backends import registry
  defining = {m for m, p in _modules().items()
              if m.startswith("infcl_jax.backends.")
              and "\nBACKEND = " in p.read_text()}
  assert defining == set(registry.BUILTIN.values())
  assert set(registry.BUILTIN) <= set(registry.names())


def _run(code):
  return subprocess.run([sys.executable, "-c", code], capture_output=True,
                        text=True, check=True).stdout


def test_import_loads_no_kernel_code_until_a_kernel_backend_is_used():
  out = _run(
      "import sys\n"
      "def loaded():\n"
      "  return sorted(m for m in sys.modules if m.startswith(("
      "'jax.experimental.pallas', 'jax._src.pallas', 'infcl_jax.kernels', "
      "'infcl_jax.backends.pallas_triton')))\n"
      "import jax.numpy as jnp\n"
      "import infcl_jax\n"
      "print('import', loaded())\n"
      "x = jnp.ones((8, 4))\n"
      "infcl_jax.contrastive_loss(x, x, 1.0, backend='xla')\n"
      "infcl_jax.sigmoid_loss(x, x, 1.0, 0.0, backend='xla')\n"
      "print('xla', loaded())\n"
      "infcl_jax.contrastive_loss(x, x, 1.0, backend='pallas')\n"
      "print('pallas', 'infcl_jax.kernels.lse_fwd' in loaded())\n")
  lines = out.strip().splitlines()
  assert lines == ["import []", "xla []", "pallas True"], out


def test_backend_names_come_from_the_registry(monkeypatch):
  """A registered backend is accepted by the public API's checks, and an
  unknown one is rejected with the registered names listed."""
  import jax.numpy as jnp
  import numpy as np
  import pytest
  import infcl_jax
  from infcl_jax.backends import registry
  from infcl_jax.backends import xla

  class Renamed(xla.XlaBackend):
    name = "xla_renamed_for_test"

  monkeypatch.setitem(registry._TABLE, Renamed.name, Renamed)
  x = jnp.asarray(np.random.default_rng(0).standard_normal((6, 3)),
                  jnp.float32)
  got = infcl_jax.contrastive_loss(x, x, 2.0, backend=Renamed.name)
  want = infcl_jax.contrastive_loss(x, x, 2.0, backend="reference")
  np.testing.assert_allclose(got, want, rtol=1e-5)
  with pytest.raises(ValueError, match=r"backend must be one of.*'xla_renamed"):
    infcl_jax.contrastive_loss(x, x, 2.0, backend="nope")
