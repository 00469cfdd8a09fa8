"""Tile backends: the code that computes blocks of the logit matrix.

``registry`` names them and defines the seam each loss family needs;
``capability`` is the one rule of where each runs. ``base`` holds the
seam's guards and the kernel backends' base, ``precision`` the float32
policy, for every backend. One module per registered name, each
implementing both families: ``xla`` (portable), ``pallas`` (Pallas' Triton
lowering), ``triton`` (the Triton language, through jax-triton) and
``mosaic`` (Hopper's Mosaic GPU kernels; the Triton kernels for what they
do not cover). A kernel backend has the kernels it runs: the two Triton
kernel sets share their tile ops and tuning table (``triton_tiles``), and
every kernel backend ``padding`` and ``panel_backward``. A backend module
is imported only when a loss first uses it, so ``import infcl_jax`` loads
no kernel code.
"""
