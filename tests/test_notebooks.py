"""The notebooks run top to bottom (short parameters), and are stored clean."""
import os
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_without_outputs(path):
  nb = nbformat.read(path, as_version=4)
  for cell in nb.cells:
    if cell.cell_type == "code":
      assert not cell.outputs and cell.execution_count is None, (
          f"{path.name}: strip outputs before committing")


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, tmp_path, monkeypatch):
  monkeypatch.setenv("INFCL_NB_QUICK", "1")
  monkeypatch.setenv("INFCL_NB_WORKDIR", str(tmp_path))
  monkeypatch.setenv("MPLBACKEND", "Agg")
  # The kernel is a fresh process: it sets its own device count; XLA's
  # optimisation level of the CPU tests (scripts/cpu_test_env.sh) stays.
  monkeypatch.setenv("XLA_FLAGS", " ".join(
      f for f in os.environ.get("XLA_FLAGS", "").split()
      if "xla_force_host_platform_device_count" not in f))
  nb = nbformat.read(path, as_version=4)
  client = NotebookClient(nb, timeout=600, kernel_name="python3",
                          resources={"metadata": {"path": str(path.parent)}})
  client.execute()
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == "error"]
  assert not errors
