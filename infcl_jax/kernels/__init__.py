"""The GPU kernels of the tile seam, one folder per lowering.

``pallas/``: Pallas kernels lowered through Pallas' Triton backend (the
``pallas`` backend). ``triton/``: the same algorithms in the Triton
language, launched through jax-triton (the ``triton`` backend).
``mosaic/``: Mosaic GPU kernels for Hopper (the ``mosaic`` backend).
``grid``: the persistent grid's column split, the one helper that both
Triton lowerings share (free of any kernel import). Nothing here is
imported by ``import infcl_jax``; a backend imports its folder on first use.
"""
