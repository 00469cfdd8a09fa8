"""Mosaic GPU (``jax.experimental.pallas.mosaic_gpu``) kernels for Hopper.

Drop-in kernels for the tile seam's Pallas-Triton ones: they take the same
padded arrays and return the same things.

``lse_fwd.lse_fwd``: row and column LSE of s = scale * x y^T + bias in one
persistent, warp-specialized sweep (TMA producer, two wgmma consumers).
``g_panel.g_panel``: the softmax backward's probability panel
G = a_r P^r + a_c P^c in the input dtype, plus the sums of G * (x y^T) and G.
``sigmoid.sigmoid_tiles``: the sigmoid family's forward sum of softplus(-z s),
its G panel, and the float16 max |G| pre-pass (one kernel, three modes).
``common``: the producer loop and the wgmma tile both share.
Their measurements, stage by stage:
https://github.com/infcl-jax/infcl-jax/blob/main/BENCHMARKS.md#loss.

Inputs must be bf16 or f16 (wgmma with float32 accumulation). Every kernel
also runs, unchanged, under jax's Mosaic GPU interpreter on the CPU
(``interpret=True``), which is how the project's CPU tests check them
without a GPU.
"""
