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


# train/ is layered too. Its modules (train/*.py: the entry points, the
# loop, the step, the model) sit on top of its packages (train/data,
# train/towers, train/eval), which import none of them but the base (the
# one-axis mesh). Within train/data the sources come first, then the
# decoders, then the pipeline that batches, prefetches and places, then the
# config check and the held-out sets. Imports inside functions count.
TRAIN_BASE = {"train.mesh"}
TRAIN_PACKAGES = ("train.data", "train.towers", "train.eval")
DATA_LAYERS = [("sources", "ledger", "stopwatch", "tokenizer"), ("decode",),
               ("batching", "pipeline"), ("config", "eval_sets", "")]
# The only imports of the trainer's own modules that wait until a function
# runs: train.main loads the trainer (and JAX with it) once the signals are
# caught.
LAZY_TRAINER_IMPORTS = {("train.main", "train.train"),
                        ("train.main", "train.data.sources.remote")}


def _trainer_modules(graph):
  """train/*.py: the modules of train/ that are in none of its packages."""
  return {m for m in graph if m.count(".") == 1 and not any(
      m == p for p in TRAIN_PACKAGES)}


def _data_layer(mod):
  """The index in DATA_LAYERS of a module of train/data."""
  part = mod.split(".")[2] if mod.count(".") >= 2 else ""
  return next(i for i, layer in enumerate(DATA_LAYERS) if part in layer)


def _local_imports(path, prefix="train"):
  """The modules named ``prefix``... that the file imports inside its
  functions (a ``from a import b`` names a.b)."""
  out = set()
  for fn in ast.walk(ast.parse(path.read_text(), str(path))):
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
      continue
    for node in ast.walk(fn):
      if isinstance(node, ast.Import):
        out |= {a.name for a in node.names}
      elif isinstance(node, ast.ImportFrom) and node.module:
        out |= {f"{node.module}.{a.name}" for a in node.names}
  return {m for m in out if m == prefix or m.startswith(prefix + ".")}


def test_no_import_cycles_in_the_trainer():
  # train/ too, imports inside functions included: no module imports one
  # that imports it back.
  graph = _import_graph(TRAIN)
  assert len(graph) > 40 and "train.data.decode.gpu" in graph
  assert graph["train.data.pipeline"] >= {"train.data.batching",
                                          "train.data.decode.choice"}
  assert _find_cycle(graph) is None, " -> ".join(_find_cycle(graph))


def test_the_trainer_packages_import_nothing_of_the_trainer_above_them():
  graph = _import_graph(TRAIN)
  top = _trainer_modules(graph)
  assert {"train.train", "train.step", "train.model", "train.main"} <= top
  assert not top & {"train.data", "train.towers", "train.eval"}
  bad = [f"{m} -> {d}" for m, deps in graph.items()
         if m.startswith(tuple(p + "." for p in TRAIN_PACKAGES))
         or m in TRAIN_PACKAGES
         for d in sorted(deps & (top - TRAIN_BASE))]
  assert not bad, bad


def test_train_data_imports_only_downwards():
  # sources < decoders < the pipeline < the config and the held-out sets.
  graph = _import_graph(TRAIN)
  data = [m for m in graph if m == "train.data" or m.startswith("train.data.")]
  assert {_data_layer(m) for m in data} == set(range(len(DATA_LAYERS)))
  bad = [f"{m} -> {d}" for m in data for d in sorted(graph[m])
         if (d == "train.data" or d.startswith("train.data."))
         and _data_layer(d) > _data_layer(m)]
  assert not bad, bad


def test_the_entry_points_are_on_top():
  # Nothing imports train.main, and only train.main the training loop.
  graph = _import_graph(TRAIN)
  assert not [m for m, deps in graph.items() if "train.main" in deps]
  assert [m for m, deps in graph.items() if "train.train" in deps] == [
      "train.main"]


def test_the_trainer_imports_its_own_modules_at_the_top():
  # A module of train/ imported inside a function hides a dependency (and
  # an upward one hides a layering error from the reader): only train.main's
  # lazy load of the trainer does it.
  found = {(m, d) for m, path in _modules(TRAIN).items()
           for d in _local_imports(path)}
  assert found == LAZY_TRAINER_IMPORTS, found ^ LAZY_TRAINER_IMPORTS


def test_the_import_checks_see_what_they_forbid(tmp_path):
  """The checkers themselves: a planted function-local import is found,
  and a data module's layer is its directory's."""
  f = tmp_path / "m.py"
  f.write_text("import os\n\ndef f():\n  from train import step\n"
               "  import train.data.pipeline as p\n  import json\n")
  assert _local_imports(f) == {"train.step", "train.data.pipeline"}
  assert _data_layer("train.data.sources.tfds") < _data_layer(
      "train.data.decode.gpu") < _data_layer("train.data.pipeline") < (
          _data_layer("train.data"))
  assert _trainer_modules({"train.step": set(), "train.data": set(),
                           "train.data.config": set()}) == {"train.step"}


def test_the_decoders_import_neither_each_other_nor_the_pipeline():
  # Each decoder is one file that changes without the other: the GPU one
  # shares only the lower modules (the host's decode, the source contract,
  # the stopwatch).
  graph = _import_graph(TRAIN)
  upper = {"train.data.decode.choice", "train.data.decode.gpu",
           "train.data.batching", "train.data.pipeline", "train.data"}
  gpu = graph["train.data.decode.gpu"]
  assert not gpu & upper, gpu
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


def test_files_are_named_by_what_they_hold():
  """One backend module per registered name (``backends/<name>.py``), one
  kernel folder per lowering (``kernels/<lowering>/``), and no backend
  built on another: each subclasses ``base.TileBackend`` or
  ``base.KernelBackend`` and has what else it runs (read from the source:
  the triton backend needs its extra to import)."""
  from infcl_jax.backends import registry
  assert registry.BUILTIN == {name: f"infcl_jax.backends.{name}"
                              for name in registry.BUILTIN}
  lowerings = {p.name for p in (PKG / "kernels").iterdir()
               if p.is_dir() and p.name != "__pycache__"}
  assert lowerings == {"pallas", "triton", "mosaic"}
  for name in registry.BUILTIN:
    tree = ast.parse((PKG / "backends" / f"{name}.py").read_text())
    bases = {ast.unparse(b) for node in ast.walk(tree)
             if isinstance(node, ast.ClassDef) for b in node.bases}
    assert bases <= {"base.TileBackend", "base.KernelBackend"}, (name, bases)


def _run(code):
  return subprocess.run([sys.executable, "-c", code], capture_output=True,
                        text=True, check=True).stdout


def test_import_loads_no_kernel_code_until_a_kernel_backend_is_used():
  out = _run(
      "import sys\n"
      "def loaded():\n"
      "  return sorted(m for m in sys.modules if m.startswith(("
      "'jax.experimental.pallas', 'jax._src.pallas', 'infcl_jax.kernels', "
      "'infcl_jax.backends.pallas')))\n"
      "import jax.numpy as jnp\n"
      "import infcl_jax\n"
      "print('import', loaded())\n"
      "x = jnp.ones((8, 4))\n"
      "infcl_jax.contrastive_loss(x, x, 1.0, backend='xla')\n"
      "infcl_jax.sigmoid_loss(x, x, 1.0, 0.0, backend='xla')\n"
      "print('xla', loaded())\n"
      "infcl_jax.contrastive_loss(x, x, 1.0, backend='pallas')\n"
      "print('pallas', 'infcl_jax.kernels.pallas.lse_fwd' in loaded())\n")
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
