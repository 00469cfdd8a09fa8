"""Held-out evaluation: streamed embedding, zero-shot, retrieval, names.

``train.evaluate.Evaluator`` puts these together for the trainer.
"""
