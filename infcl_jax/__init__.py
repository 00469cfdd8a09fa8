"""infcl-jax: exact contrastive losses at batch sizes of millions.

Layers, top to bottom: ``api`` (the public losses: checks and dispatch) ->
``losses`` (one ``custom_vjp`` per family, for 1..N devices) -> ``backends``
(the tile computations, one module per registered name) -> ``kernels``
(one folder per lowering: Pallas, Triton, Mosaic GPU). Kernel code is
imported only when a kernel backend is first used.
"""
from infcl_jax import reference
from infcl_jax import xla_flags
from infcl_jax.api import GROUP_MODES
from infcl_jax.api import LOSS_FAMILIES
from infcl_jax.api import backend_names
from infcl_jax.api import contrastive_loss
from infcl_jax.api import sharded_contrastive_loss
from infcl_jax.api import sharded_sigmoid_loss
from infcl_jax.api import sigmoid_loss
from infcl_jax.block_sizes import BlockSizes

__all__ = ["BlockSizes", "GROUP_MODES", "LOSS_FAMILIES", "backend_names",
           "contrastive_loss", "reference",
           "sharded_contrastive_loss", "sharded_sigmoid_loss", "sigmoid_loss",
           "xla_flags"]
__version__ = "0.1.0"
