"""The workdir check, before any work (no heavy imports: ``train.main`` runs it
before it imports JAX)."""
from __future__ import annotations

import os
import tempfile


def _nearest_existing(path: str) -> str:
  while not os.path.exists(path):
    parent = os.path.dirname(path)
    if parent == path:
      break
    path = parent
  return path


def check_workdir(workdir: str, *, create: bool = True) -> None:
  """One-line ValueError unless ``workdir`` is (or can be created as) a
  writable directory.

  With ``create=False`` nothing is made: the directory, or the nearest
  existing folder above it, must be a writable directory. ``train.main``
  checks so at start-up, and the directory is created (``create=True``)
  only once the config has been validated, so a run that fails its checks
  leaves no empty workdir behind.
  """
  if not workdir:
    raise ValueError("the workdir is empty: pass --workdir DIR")
  path = os.path.abspath(os.path.expanduser(workdir))
  if os.path.exists(path) and not os.path.isdir(path):
    raise ValueError(f"workdir {workdir} is an existing file, not a "
                     "directory: pass a directory (new or existing) as "
                     "--workdir")
  if not create:
    base = _nearest_existing(path)
    if not os.path.isdir(base):
      raise ValueError(f"workdir {workdir} cannot be created: Not a "
                       f"directory ({base})")
    if base != path and not os.access(base, os.W_OK | os.X_OK):
      raise ValueError(f"workdir {workdir} cannot be created: Permission "
                       f"denied ({base})")
    if base == path:
      _probe(workdir, path)
    return
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise ValueError(f"workdir {workdir} cannot be created: "
                     f"{e.strerror or e} ({e.filename or path})") from None
  _probe(workdir, path)


def _probe(workdir: str, path: str) -> None:
  try:  # os.access can pass on a read-only mount; a real write cannot.
    fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=path)
    os.close(fd)
    os.remove(probe)
  except OSError as e:
    raise ValueError(f"workdir {workdir} is not writable: "
                     f"{e.strerror or e}") from None
