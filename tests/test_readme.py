"""Every ```python block of README.md runs (on CPU, as written)."""
import os
import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
# The "Across devices" snippet runs in its own test below, with checks.
ACROSS = [b for b in BLOCKS if "sharded_contrastive_loss(a, b" in b]
OTHERS = [b for b in BLOCKS if b not in ACROSS]


def test_readme_has_python_snippets():
  assert BLOCKS


@pytest.mark.parametrize("index", range(len(OTHERS)))
def test_readme_snippet_runs(index):
  # A snippet may set environment variables (e.g. XLA_FLAGS for simulated
  # devices): they must not leak into later tests of this worker.
  before = dict(os.environ)
  code = OTHERS[index]
  try:
    exec(compile(code, f"README.md snippet {index}", "exec"), {"__name__": "__readme__"})
  finally:
    os.environ.clear()
    os.environ.update(before)


def test_across_devices_snippet_normalizes_and_runs_on_8_devices(capsys):
  """On one device its loss once underflowed to exactly 0; here (8 CPU
  devices, tests/conftest.py) it must print 8 and a positive loss."""
  (code,) = ACROSS
  assert "xla_force_host_platform_device_count=8" in code
  assert "jnp.linalg.norm(img" in code and "jnp.linalg.norm(txt" in code
  before = dict(os.environ)
  try:
    exec(compile(code, "README.md across devices", "exec"), {"__name__": "__readme__"})
  finally:
    os.environ.clear()
    os.environ.update(before)
  n, loss, loss2, dgrad = capsys.readouterr().out.split()
  assert int(n) == 8
  assert float(loss) > 0.01 and float(loss) == pytest.approx(float(loss2), rel=1e-5)
  assert float(dgrad) < 1e-5
