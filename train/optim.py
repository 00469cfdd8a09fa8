"""The optimizer and the learning-rate schedule of the LiT trainer.

One update, for either optimizer, is

    u = -s(t) * (lr * m_p * d(g) + wd * p)        weight_decay_scale="schedule"
    u = -lr(t) * (m_p * d(g) + wd * p)            weight_decay_scale="lr"

where ``d`` is the optimizer's direction (Adam's, or Adafactor's factored
second moment followed by momentum) of the clipped gradient ``g``, ``m_p`` the
parameter's LR multiplier (``lr_mults``), ``lr(t)`` the warmup + cosine
schedule and ``s(t) = lr(t) / lr`` the same schedule relative to its peak.
The weight decay follows the schedule either way (an update at lr(t) = 0 is
exactly zero), and it is never scaled by ``m_p``:

* ``"lr"`` is decoupled decay as ``optax.adamw`` and PyTorch's AdamW apply
  it (``wd`` is multiplied by the learning rate), the convention of CLIP and
  OpenCLIP recipes;
* ``"schedule"`` is big_vision's ``config.wd`` (``wd`` is the decay at the
  peak of the schedule; big_vision's LiT/SigLIP configs give values such as
  1e-4 or 0.01 in this convention). The two agree when
  ``wd_schedule = lr * wd_lr``.

Adafactor is big_vision's variant (``big_vision.scale_by_adafactor`` in its
``optax.py``) built from optax's pieces: factored second moment with a
decay ``min(b2, 1 - (t + 1) ** -decay_rate)``, no multiplication by the
parameter scale, no update clipping unless asked, then momentum ``b1`` (an
EMA without bias correction). ``optax.adafactor``'s defaults differ on each
of these points (parameter scaling on, no momentum, ``b1``/``b2`` unused,
decay added after the LR scaling), which is why it is not used.
"""
from __future__ import annotations

import re
from typing import Sequence

import jax
import jax.numpy as jnp
import optax

NAMES = ("adamw", "adafactor")
WEIGHT_DECAY_SCALES = ("lr", "schedule")


def make_schedule(*, lr: float, total_steps: int, warmup_steps: int,
                  end_lr_ratio: float = 0.0):
  """Linear warmup from 0 to ``lr``, then cosine decay to ``lr*end_lr_ratio``."""
  warmup_steps = min(warmup_steps, max(total_steps - 1, 0))
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=lr, warmup_steps=warmup_steps,
      decay_steps=max(total_steps, warmup_steps + 1),
      end_value=lr * end_lr_ratio)


def path_name(path) -> str:
  """"img/conv0a/kernel" for a jax tree path of dict keys."""
  return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def param_labels(params, *, image_locked: bool):
  """"frozen" for every leaf of a locked image tower, "train" elsewhere."""
  return {k: jax.tree.map(
      lambda _, k=k: "frozen" if (k == "img" and image_locked) else "train",
      v) for k, v in params.items()}


def lr_multipliers(params, lr_mults: Sequence, *, image_locked: bool = False):
  """{"a/b/c": multiplier} of the trainable leaves, from ``(regex, m)`` pairs.

  The first pattern that matches the whole name ("txt/.../kernel",
  "head/log_scale") wins; names no pattern matches get 1. A pattern that
  matches no trainable parameter, or a multiplier <= 0, is an error (a
  parameter is frozen by locking its tower, not by a zero multiplier).
  """
  rules = []
  for i, rule in enumerate(lr_mults):
    if not (isinstance(rule, (tuple, list)) and len(rule) == 2):
      raise ValueError(f"config.optim.lr_mults[{i}]={rule!r} must be a "
                       "(regex, multiplier) pair")
    pattern, mult = rule
    try:
      regex = re.compile(pattern)
    except re.error as e:
      raise ValueError(f"config.optim.lr_mults[{i}]: bad regex {pattern!r}: "
                       f"{e}") from None
    if not float(mult) > 0:
      raise ValueError(f"config.optim.lr_mults[{i}]: multiplier {mult!r} "
                       "must be > 0 (lock a tower to freeze it)")
    rules.append((regex, float(mult), pattern))
  names = [path_name(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(params)[0]]
  names = [n for n in names if not (image_locked and n.startswith("img/"))]
  out, used = {}, set()
  for name in names:
    for regex, mult, pattern in rules:
      if regex.fullmatch(name):
        out[name] = mult
        used.add(pattern)
        break
    else:
      out[name] = 1.0
  for _, _, pattern in rules:
    if pattern not in used:
      raise ValueError(f"config.optim.lr_mults pattern {pattern!r} matches no "
                       f"trainable parameter (e.g. {names[:3]})")
  return out


def _scale_by_name(mults: dict):
  """Multiplies each leaf's update by ``mults[name]`` (missing: 1)."""

  def update(updates, state, params=None):
    del params

    def one(path, u):
      m = mults.get(path_name(path), 1.0)
      return u if m == 1.0 else u * jnp.asarray(m, u.dtype)

    return jax.tree_util.tree_map_with_path(one, updates), state

  return optax.GradientTransformation(lambda _: optax.EmptyState(), update)


def adafactor_direction(*, b1: float, b2: float, decay_rate: float = 0.8,
                        min_dim_size_to_factor: int = 32, eps: float = 1e-30,
                        clipping_threshold: float = 0.0,
                        momentum_dtype=jnp.bfloat16):
  """big_vision's Adafactor direction (no learning rate, no decay).

  Factored RMS scaling with the decay ``min(b2, 1 - (t+1)^-decay_rate)`` of
  step t, optional block-RMS clipping of the scaled update, then momentum
  ``b1`` (0: none) kept in ``momentum_dtype``.
  """
  def beta2(step, exponent):
    t = jnp.asarray(step, jnp.float32) + 1.0
    return jnp.minimum(b2, 1.0 - t ** (-exponent))

  parts = [optax.scale_by_factored_rms(
      factored=True, decay_rate=decay_rate, step_offset=0,
      min_dim_size_to_factor=min_dim_size_to_factor, epsilon=eps,
      decay_rate_fn=beta2)]
  if clipping_threshold and clipping_threshold > 0:
    parts.append(optax.clip_by_block_rms(clipping_threshold))
  if b1:
    parts.append(optax.ema(b1, debias=False, accumulator_dtype=momentum_dtype))
  return optax.chain(*parts)


def make_optimizer(*, name: str, schedule, lr: float | None = None,
                   weight_decay: float = 0.0,
                   weight_decay_scale: str = "lr", b1: float = 0.9,
                   b2: float = 0.999, eps: float = 1e-8,
                   grad_clip_norm: float = 0.0, lr_mults: Sequence = (),
                   adafactor_decay_rate: float = 0.8,
                   adafactor_min_dim_size_to_factor: int = 32,
                   adafactor_eps: float = 1e-30,
                   adafactor_clipping_threshold: float = 0.0,
                   momentum_dtype: str = "float32", params,
                   image_locked: bool):
  """AdamW or big_vision's Adafactor on the trainable params (module doc).

  Args:
    name: "adamw" or "adafactor".
    schedule: ``lr(t)``, from ``make_schedule``.
    lr: the schedule's peak (needed for ``weight_decay_scale="schedule"``).
    weight_decay, weight_decay_scale: the decay and its convention.
    b1, b2, eps: Adam's moments and epsilon; for Adafactor ``b1`` is the
      momentum (0: none) and ``b2`` the cap of the second-moment decay
      (big_vision's ``beta2_cap``).
    grad_clip_norm: clip the trainable gradients to this global norm (0: no).
    lr_mults: ``(regex, multiplier)`` pairs over parameter names
      ("txt/...", "head/log_scale", "head/bias"), see ``lr_multipliers``.
    adafactor_*: big_vision's ``decay_rate``, ``min_dim_size_to_factor``,
      ``eps`` and ``clipping_threshold`` (0: none).
    momentum_dtype: dtype of the first moment (Adam's mu, Adafactor's
      momentum); big_vision keeps Adafactor's in bfloat16.
    params: the parameter tree ``{"img", "txt", "head"}``.
    image_locked: the image tower is frozen.

  Freezing is an optax mask (``multi_transform`` with ``set_to_zero``), so a
  locked tower gets exactly zero updates (no weight decay either) and needs no
  optimizer state. Weight decay skips biases, norms and scalars (ndim < 2).
  """
  if name not in NAMES:
    raise ValueError(
        f"config.optim.name must be 'adamw' or 'adafactor', got {name!r}")
  if weight_decay_scale not in WEIGHT_DECAY_SCALES:
    raise ValueError(f"config.optim.weight_decay_scale must be 'lr' or "
                     f"'schedule', got {weight_decay_scale!r}")
  mu_dtype = jnp.dtype(momentum_dtype)
  decay_mask = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)
  parts = []
  if grad_clip_norm and grad_clip_norm > 0:
    parts.append(optax.clip_by_global_norm(grad_clip_norm))
  if name == "adamw":
    parts.append(optax.scale_by_adam(b1=b1, b2=b2, eps=eps,
                                     mu_dtype=mu_dtype))
  else:
    parts.append(adafactor_direction(
        b1=b1, b2=b2, decay_rate=adafactor_decay_rate,
        min_dim_size_to_factor=adafactor_min_dim_size_to_factor,
        eps=adafactor_eps, clipping_threshold=adafactor_clipping_threshold,
        momentum_dtype=mu_dtype))
  mults = lr_multipliers(params, lr_mults, image_locked=image_locked)
  if any(m != 1.0 for m in mults.values()):
    parts.append(_scale_by_name(mults))
  decay = ([optax.add_decayed_weights(weight_decay, decay_mask)]
           if weight_decay else [])
  if weight_decay_scale == "lr":
    parts += decay + [optax.scale_by_learning_rate(schedule)]
  else:
    if lr is None:
      raise ValueError("weight_decay_scale='schedule' needs the peak lr")
    relative = ((lambda t: schedule(t) / lr) if lr > 0
                else (lambda t: jnp.zeros((), jnp.float32)))
    parts += ([optax.scale(lr)] + decay
              + [optax.scale_by_schedule(relative), optax.scale(-1.0)])
  return optax.multi_transform(
      {"train": optax.chain(*parts), "frozen": optax.set_to_zero()},
      param_labels(params, image_locked=image_locked))


def from_config(optim, *, total_steps: int, params, image_locked: bool):
  """(optimizer, schedule) of ``config.optim``."""
  schedule = make_schedule(lr=optim.lr, total_steps=total_steps,
                           warmup_steps=optim.warmup_steps,
                           end_lr_ratio=optim.end_lr_ratio)
  optimizer = make_optimizer(
      name=optim.name, schedule=schedule, lr=optim.lr,
      weight_decay=optim.weight_decay,
      weight_decay_scale=optim.weight_decay_scale, b1=optim.b1, b2=optim.b2,
      eps=optim.eps, grad_clip_norm=optim.grad_clip_norm,
      lr_mults=tuple(tuple(r) for r in optim.lr_mults),
      adafactor_decay_rate=optim.adafactor_decay_rate,
      adafactor_min_dim_size_to_factor=optim.adafactor_min_dim_size_to_factor,
      adafactor_eps=optim.adafactor_eps,
      adafactor_clipping_threshold=optim.adafactor_clipping_threshold,
      momentum_dtype=optim.momentum_dtype, params=params,
      image_locked=image_locked)
  return optimizer, schedule


def batch_repeat_warning(batch_size: int, num_examples: int | None,
                         split: str) -> str | None:
  """The one-line warning when a batch is larger than the training split.

  Such a batch holds some images twice (from consecutive epochs), and the
  contrastive loss then counts an image's copy as one of its negatives.
  """
  if num_examples is None or batch_size <= num_examples:
    return None
  return (f"[lit] warning: config.batch_size={batch_size} is larger than the "
          f"{num_examples} examples of the training split {split!r}: every "
          "batch repeats examples, and a repeated image counts as a negative "
          "of itself in the contrastive loss")
