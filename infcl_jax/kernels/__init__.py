"""Pallas kernels of the tile seam, one concept per module.

``lse_fwd``: the fused forward (row and column log-sum-exp in one sweep).
``lse_bwd``: the backward's probability-panel kernel.
Both lower through Pallas' Triton backend on GPU and run with
``interpret=True`` elsewhere. ``infcl_jax.pallas_tiles`` wires them into the
tile seam; a Mosaic GPU version would be a sibling module here.
"""
