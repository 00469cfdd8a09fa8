"""infcl-jax: exact contrastive losses at batch sizes of millions."""
from infcl_jax import reference
from infcl_jax import xla_tiles as _xla_tiles  # Registers backend "xla".
from infcl_jax.api import contrastive_loss
from infcl_jax import tile_backend as _tile_backend
from infcl_jax.block_sizes import BlockSizes
from infcl_jax.sharded import sharded_contrastive_loss
from infcl_jax.sharded import sharded_sigmoid_loss
from infcl_jax.sigmoid import sigmoid_loss

__all__ = ["BlockSizes", "contrastive_loss", "reference",
           "sharded_contrastive_loss", "sharded_sigmoid_loss", "sigmoid_loss"]
__version__ = "0.1.0"


def _pallas_softmax():
  # Lazy: Pallas and its Triton lowering are imported only when asked for,
  # so `import infcl_jax` stays light. On a CPU it runs in interpret mode.
  from infcl_jax import pallas_tiles
  return pallas_tiles.PallasTiles()


_tile_backend.register("pallas", _pallas_softmax, family="softmax")


def _pallas_sigmoid():
  from infcl_jax import pallas_sigmoid_tiles
  return pallas_sigmoid_tiles.PallasSigmoidTiles()


_tile_backend.register("pallas", _pallas_sigmoid, family="sigmoid")
