"""infcl-jax: exact contrastive losses at batch sizes of millions."""
from infcl_jax import reference
from infcl_jax import xla_tiles as _xla_tiles  # Registers backend "xla".
from infcl_jax.api import contrastive_loss
from infcl_jax.block_sizes import BlockSizes

__all__ = ["BlockSizes", "contrastive_loss", "reference"]
__version__ = "0.1.0"
