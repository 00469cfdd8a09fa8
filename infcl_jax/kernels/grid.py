"""Grid shapes shared by the kernels of both launch paths (Pallas-Triton and
Triton-language), kept free of any kernel import."""
from __future__ import annotations


def column_splits(nrb, nkb, target_programs):
  """(splits, column blocks per split) giving about ``target_programs``
  programs over ``nrb`` row blocks and ``nkb`` column blocks: at least one
  split, at most one per column block; every column block in exactly one
  split."""
  want = max(1, min(nkb, -(-target_programs // nrb)))
  per = -(-nkb // want)
  return -(-nkb // per), per
