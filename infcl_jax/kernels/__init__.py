"""Pallas kernels of the tile seam, one concept per module.

``lse_fwd``: the fused softmax forward (row and column log-sum-exp in one
sweep). ``lse_bwd``: the softmax backward's probability-panel kernel.
``sigmoid_fwd`` / ``sigmoid_bwd``: the same two for the SigLIP loss.
``tile_dot``: the logit tile they all start from. ``interpret_vma``: runs a
kernel body so that interpret mode works inside ``shard_map``.
All lower through Pallas' Triton backend on GPU and run with
``interpret=True`` elsewhere. ``infcl_jax.pallas_tiles`` and
``infcl_jax.pallas_sigmoid_tiles`` wire them into the tile seam; a Mosaic GPU
version would be a sibling module here.
"""
