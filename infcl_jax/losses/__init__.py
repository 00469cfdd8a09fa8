"""The losses, each one ``jax.custom_vjp`` over the tile backends.

``softmax`` (CLIP / InfoNCE) and ``sigmoid`` (SigLIP) run the same ring
schedule (``schedule``) for any number of devices; one device is the ring
with N = 1. ``gather`` is the all-gather strategy of the softmax loss.
``terms`` holds the positive-pair term and the direction weights.
"""
