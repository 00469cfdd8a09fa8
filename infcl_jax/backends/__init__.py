"""Tile backends: the code that computes blocks of the logit matrix.

``registry`` names them and defines the seam each loss family needs;
``capability`` is the one rule of where each runs. ``base`` holds the
seam's guards and ``precision`` the float32 policy, for every backend.
``xla`` (portable), ``pallas`` (fused Triton kernels, tuned per GPU
by ``triton_tiles``) and ``mosaic`` (Hopper's Mosaic GPU kernels)
implement both families; the kernel backends share ``kernel_backend``
(interpret mode), ``padding`` and ``panel_backward``. A backend module is
imported only when a loss first uses it, so ``import infcl_jax`` loads no
kernel code.
"""
