"""Tile backends: the code that computes blocks of the logit matrix.

``registry`` names them and defines what each loss family needs of one;
``xla`` (portable) and ``pallas_triton`` (fused GPU kernels) implement both
families; ``kernel_plumbing`` is what kernel backends share (padding, the
panel backward). A backend module is imported only when a loss first uses
it, so ``import infcl_jax`` loads no kernel code.
"""
