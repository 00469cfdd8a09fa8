"""Pallas kernels of the tile seam, lowered through Pallas' Triton backend.

``lse_fwd``: the fused softmax forward (row and column log-sum-exp in one
sweep). ``lse_bwd``: the softmax backward's probability-panel kernel.
``sigmoid_fwd`` / ``sigmoid_bwd``: the same two for the SigLIP loss.
``tile_dot``: the logit tile they all start from. ``panel_call``: the grid
and block specs of both backward panels. ``interpret_vma``: runs a
kernel body so that interpret mode works inside ``shard_map``.
All lower through Pallas' Triton backend on GPU and run with
``interpret=True`` elsewhere. ``infcl_jax.backends.pallas`` wires
them into the tile seam.
"""
