"""The workdir check, before any work (no heavy imports: ``train.main`` runs it
before it imports JAX)."""
from __future__ import annotations

import os
import tempfile


def check_workdir(workdir: str) -> None:
  """One-line ValueError unless ``workdir`` is (or can be created as) a
  writable directory; checked before any work."""
  if not workdir:
    raise ValueError("the workdir is empty: pass --workdir DIR")
  path = os.path.expanduser(workdir)
  if os.path.exists(path) and not os.path.isdir(path):
    raise ValueError(f"workdir {workdir} is an existing file, not a "
                     "directory: pass a directory (new or existing) as "
                     "--workdir")
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise ValueError(f"workdir {workdir} cannot be created: "
                     f"{e.strerror or e} ({e.filename or path})") from None
  try:  # os.access can pass on a read-only mount; a real write cannot.
    fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=path)
    os.close(fd)
    os.remove(probe)
  except OSError as e:
    raise ValueError(f"workdir {workdir} is not writable: "
                     f"{e.strerror or e}") from None
