"""Image and text towers of the LiT trainer, and the ``Tower`` seam."""
from train.towers.tower import Normalization
from train.towers.tower import SYMMETRIC
from train.towers.tower import Tower
