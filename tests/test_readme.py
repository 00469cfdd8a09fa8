"""Every ```python block of README.md runs (on CPU, as written)."""
import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_python_snippets():
  assert BLOCKS


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_snippet_runs(index):
  code = BLOCKS[index]
  exec(compile(code, f"README.md snippet {index}", "exec"), {"__name__": "__readme__"})
