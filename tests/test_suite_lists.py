"""The suite's own lists stay true to the test files.

- every id in slow_tests.txt and interpret_tests.txt names a test function
  that exists (a renamed test would silently leave quick mode or the
  interpreter split);
- every test file that imports the trainer's packages is left out of the
  jax 0.12 leg (scripts/test.sh), whose venv holds only the library's;
- every test file with ``gpu`` tests is run by scripts/gpu.sh (a file it
  does not name would never run anywhere).
"""
import ast
import fnmatch
import pathlib
import re

import pytest

TESTS = pathlib.Path(__file__).resolve().parent
ROOT = TESTS.parent
# Packages of the [train] extra (and the trainer itself), absent from the
# jax 0.12 venv (scripts/setup_env.sh jax012). Not optax: flax requires it,
# so it comes with the flax that venv holds (tests/test_nnx.py uses it).
TRAIN_ONLY = {"train", "ml_collections", "grain", "tensorflow_datasets",
              "array_record", "orbax", "tokenizers", "safetensors",
              "braceexpand", "PIL", "tensorboardX", "nbformat", "nbclient"}


def _ids(name):
  lines = (TESTS / name).read_text().splitlines()
  return [l.strip() for l in lines if l.strip() and not l.startswith("#")]


def _defined(path):
  """Test names a file defines: functions and Class::method, with the
  methods a class inherits from classes of test modules it imports."""
  tree = ast.parse(path.read_text())
  names, bases = set(), {}
  for node in tree.body:
    if isinstance(node, ast.FunctionDef):
      names.add(node.name)
    elif isinstance(node, ast.ClassDef):
      bases[node.name] = node.bases
      for item in node.body:
        if isinstance(item, ast.FunctionDef):
          names.add(f"{node.name}::{item.name}")
  for cls, bs in bases.items():
    for b in bs:
      # A class of this module (TestMosaic(TestKernels)), its own methods.
      if isinstance(b, ast.Name) and b.id in bases:
        names |= {cls + n[len(b.id):] for n in set(names)
                  if n.startswith(b.id + "::")}
      # test_pallas.TestPallasSoftmaxInterpret and the like
      if isinstance(b, ast.Attribute) and isinstance(b.value, ast.Name):
        other = TESTS / f"{b.value.id}.py"
        if other.exists():
          for n in _defined(other):
            if n.startswith(b.attr + "::"):
              names.add(cls + n[len(b.attr):])
  return names


@pytest.mark.parametrize("listing", ["slow_tests.txt", "interpret_tests.txt"])
def test_every_listed_id_names_an_existing_test(listing):
  stale, cache = [], {}
  for nodeid in _ids(listing):
    path, _, rest = nodeid.partition("::")
    name = re.sub(r"\[.*\]$", "", rest)
    if path not in cache:
      f = ROOT / path
      cache[path] = _defined(f) if f.exists() else set()
    if name not in cache[path]:
      stale.append(nodeid)
  assert not stale, f"{listing}: ids of no test (renamed or removed?): {stale}"


def _imports(path, seen=None):
  """Top-level packages a test file imports, through the helper modules of
  tests/ it imports (tests.lit_fixtures and the like)."""
  seen = set() if seen is None else seen
  seen.add(path)
  out, helpers = set(), []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      out |= {a.name.split(".")[0] for a in node.names}
      helpers += [a.name.split(".")[1] for a in node.names
                  if a.name.startswith("tests.")]
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      out.add(node.module.split(".")[0])
      if node.module == "tests":
        helpers += [a.name for a in node.names]
      elif node.module.startswith("tests."):
        helpers.append(node.module.split(".")[1])
  for h in helpers:
    f = TESTS / f"{h}.py"
    if f.exists() and f not in seen:
      out |= _imports(f, seen)
  return out


def test_trainer_test_files_are_left_out_of_the_jax012_leg():
  script = (ROOT / "scripts" / "test.sh").read_text()
  globs = re.findall(r'--ignore-glob="([^"]+)"', script)
  globs += re.findall(r"--ignore=(\S+)", script)
  assert globs, "scripts/test.sh: no --ignore-glob found for the jax012 leg"
  missing = []
  for f in sorted(TESTS.glob("test_*.py")):
    rel = f.relative_to(ROOT).as_posix()
    if _imports(f) & TRAIN_ONLY and not any(fnmatch.fnmatch(rel, g)
                                            for g in globs):
      missing.append(rel)
  assert not missing, ("these import the trainer's packages, absent from "
                       f"the jax 0.12 venv; add them to scripts/test.sh's "
                       f"jax012 --ignore-glob list: {missing}")


def test_every_gpu_test_file_is_run_by_gpu_sh():
  named = set(re.findall(r"tests/test_\w+\.py", (ROOT / "scripts" / "gpu.sh")
                         .read_text()))
  gpu_files = {f.relative_to(ROOT).as_posix()
               for f in sorted(TESTS.glob("test_*.py"))
               if re.search(r"^\s*(@pytest\.mark\.gpu\b|pytestmark\b.*\bgpu\b)",
                            f.read_text(), re.M)}
  missing = sorted(gpu_files - named)
  assert gpu_files and not missing, (
      f"these hold -m gpu tests that scripts/gpu.sh never runs: {missing}")
