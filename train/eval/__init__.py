"""Held-out evaluation: embedding, zero-shot, retrieval, names.

``train.eval.evaluator.Evaluator`` puts these together for the trainer.
"""
