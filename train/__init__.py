"""LiT trainer for infcl-jax: ``.venv/bin/python -m train.main --config configs/lit_demo.py``."""
