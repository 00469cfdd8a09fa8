"""Kernels in the Triton language, called through ``jax_triton.triton_call``.

The ``triton`` backend's kernels (``backends/triton.py``): the same
two families and the same tile algorithms as the Pallas-Triton kernels
(``kernels/pallas/``), written against ``triton.language`` directly so
that they do not depend on Pallas' (deprecated) Triton lowering.
``launch`` runs them: compiled on the GPU, in Triton's interpreter
(``TRITON_INTERPRET=1``) off it.

Importing this package imports nothing; its modules import ``triton``.
"""
