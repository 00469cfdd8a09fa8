"""LiT trainer for infcl-jax: ``python -m train.main --config configs/lit_demo.py``."""
