"""The transformer pieces both towers share: attention, MLP, block, encoder.

Attention goes through ``jax.nn.dot_product_attention``: on a GPU in bf16 or
f16 that is cuDNN's fused (flash) kernel, which keeps the [L, L] scores out
of memory; elsewhere XLA's own. Queries, keys and values come from one fused
projection (one matmul instead of three). A tower that pools one token
(``Encoder(query=...)``) runs its last block for that token only.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

Dtype = Any

_SQRT_HALF = 0.7071067811865476


def gelu(x):
  """The exact GELU, ``x / 2 (1 + erf(x / sqrt 2))``, evaluated in float32.

  This is torch's ``nn.GELU()`` formula (timm, OpenCLIP). ``jax.nn.gelu(x,
  approximate=False)`` is the same function written with ``erfc``, whose
  lowering evaluates two rational approximations and an ``exp`` and selects
  one (139 ops after XLA:CPU's optimisation against 32 for this form); in a
  ViT the activation runs on every fc1 output, fused into the matmuls.
  float32 inside for 16-bit inputs: ``1 + erf`` in bfloat16 would keep 8
  bits of the CDF.
  """
  y = x.astype(jnp.float32)
  return (y * 0.5 * (1.0 + jax.lax.erf(y * _SQRT_HALF))).astype(x.dtype)


class LayerNorm(nn.Module):
  """LayerNorm over the last axis with flax's params (``scale``, ``bias``),
  statistics in one pass and float32, shifted by each row's first element.

  One pass (the mean and the mean square from one read, one reduction
  kernel) as flax's default, but of ``x - x[..., 0]``: the variance
  ``E[d^2] - E[d]^2`` of the shifted row loses ``(mean - x0)^2 / var``
  float32 ulps to cancellation, a few for any row, where flax's unshifted
  form loses ``mean^2 / var`` (at |mean| = 3000 std its variance is 0).
  """
  epsilon: float = 1e-6
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    scale = self.param("scale", nn.initializers.ones, (d,), jnp.float32)
    bias = self.param("bias", nn.initializers.zeros, (d,), jnp.float32)
    y = x.astype(jnp.float32)
    shift = jax.lax.stop_gradient(y[..., :1])
    c = y - shift
    m1 = jnp.mean(c, axis=-1, keepdims=True)
    m2 = jnp.mean(c * c, axis=-1, keepdims=True)
    inv = jax.lax.rsqrt(jnp.maximum(m2 - m1 * m1, 0.0) + self.epsilon)
    return ((c - m1) * inv * scale + bias).astype(self.dtype)


# The MLP nonlinearity of each checkpoint family, by name.
ACTIVATIONS = {
    "gelu": gelu,                                         # timm, OpenCLIP.
    "gelu_tanh": lambda x: nn.gelu(x, approximate=True),  # SigLIP, bv.
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),  # OpenAI CLIP.
}


def activation(name: str):
  """The MLP nonlinearity called ``name`` (a key of ``ACTIVATIONS``)."""
  if name not in ACTIVATIONS:
    raise ValueError(f"activation must be one of {tuple(ACTIVATIONS)}, got "
                     f"{name!r}")
  return ACTIVATIONS[name]


def attention_implementation(dtype) -> str | None:
  """cuDNN's fused attention on GPU for 16-bit compute, else XLA's."""
  if jax.default_backend() == "gpu" and jnp.dtype(dtype) in (
      jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return "cudnn"
  return "xla"


class Attention(nn.Module):
  """Multi-head attention of ``q_in`` over ``kv_in`` (self-attention if None).

  ``lengths`` [b] (int32): only the first ``lengths[i]`` keys of row i are
  attended to (trailing padding); ``causal``: a lower-triangular mask. Both
  are what cuDNN's fused kernel takes. Params: ``qkv`` (fused, self-attention) or ``q``
  and ``kv`` (cross-attention, e.g. a MAP head's probe), and ``out``.
  """
  num_heads: int
  qkv_bias: bool = True
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, q_in, kv_in=None, lengths=None, causal=False,
               query=None):
    """``query`` [b] (int32), self-attention only: the output at one
    position per row, [b, 1, d] (``Encoder``'s last block)."""
    d = q_in.shape[-1]
    if d % self.num_heads:
      raise ValueError(f"width {d} is not divisible by num_heads "
                       f"{self.num_heads}")
    hd = d // self.num_heads
    dense = lambda feats, name: nn.DenseGeneral(  # noqa: E731
        feats, use_bias=self.qkv_bias, dtype=self.dtype, name=name)
    if kv_in is None:
      qkv = dense((3, self.num_heads, hd), "qkv")(q_in)
      q, k, v = qkv[..., 0, :, :], qkv[..., 1, :, :], qkv[..., 2, :, :]
    else:
      q = dense((self.num_heads, hd), "q")(q_in)
      kv = dense((2, self.num_heads, hd), "kv")(kv_in)
      k, v = kv[..., 0, :, :], kv[..., 1, :, :]
    if query is None:
      x = jax.nn.dot_product_attention(
          q, k, v, is_causal=causal, key_value_seq_lengths=lengths,
          implementation=attention_implementation(self.dtype))
    else:
      # One query per row: under the causal mask it sees keys 0..query,
      # i.e. a length. A [b, 1] query is a matrix-vector product per head,
      # which XLA's attention does well (cuDNN's fused kernel wants even
      # query lengths once a mask is involved).
      q = jnp.take_along_axis(q, query[:, None, None, None], axis=1)
      seen = query + 1 if causal else None
      if lengths is not None:
        seen = lengths if seen is None else jnp.minimum(seen, lengths)
      x = jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=seen,
                                       implementation="xla")
    return nn.DenseGeneral(d, axis=(-2, -1), dtype=self.dtype, name="out")(x)


class Mlp(nn.Module):
  mlp_dim: int
  act: str = "gelu"
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    x = nn.Dense(self.mlp_dim, dtype=self.dtype, name="fc1")(x)
    x = activation(self.act)(x)
    return nn.Dense(d, dtype=self.dtype, name="fc2")(x)


class _BlockSettings(nn.Module):
  """The settings of a ``Block``, which an ``Encoder`` gives each of its
  blocks.

  ``layer_scale``: a learned per-channel gain on each branch (timm's
  ``ls1``/``ls2``, OpenCLIP's ``ls_1``/``ls_2``), when the checkpoint has one.
  """
  num_heads: int
  mlp_dim: int
  act: str = "gelu"
  ln_eps: float = 1e-6
  qkv_bias: bool = True
  layer_scale: bool = False
  dtype: Dtype = jnp.float32


class Block(_BlockSettings):
  """Pre-LayerNorm residual block: x + attn(ln(x)), then x + mlp(ln(x))."""

  @nn.compact
  def __call__(self, x, lengths=None, causal=False, query=None):
    """``query`` [b] (int32): only the token at that position of each row,
    [b, 1, d] (its attention still reads every key)."""
    ln = lambda name: nn.LayerNorm(self.ln_eps, dtype=self.dtype, name=name)  # noqa: E731
    y = Attention(self.num_heads, self.qkv_bias, dtype=self.dtype,
                  name="attn")(ln("norm1")(x), lengths=lengths, causal=causal,
                               query=query)
    if query is not None:
      x = jnp.take_along_axis(x, query[:, None, None], axis=1)
    if self.layer_scale:
      y = y * self.param("ls1", nn.initializers.ones, (x.shape[-1],))
    x = x + y
    y = Mlp(self.mlp_dim, self.act, dtype=self.dtype, name="mlp")(
        ln("norm2")(x))
    if self.layer_scale:
      y = y * self.param("ls2", nn.initializers.ones, (x.shape[-1],))
    return x + y


# What a block keeps for its backward pass (``Encoder.remat``): "none"
# keeps every activation (the fastest, the most memory); "block" keeps each
# block's input only and recomputes the block inside the backward (one more
# forward of the tower; activation memory of one block plus a [b, L, W]
# input per block); "dots" keeps the block's matmul outputs and recomputes
# the rest (LayerNorms, GELU, softmax: about half the memory of "none").
REMAT_POLICIES = ("none", "block", "dots")


def remat_policy(name: str):
  """``jax.checkpoint``'s policy of a ``REMAT_POLICIES`` name ("block":
  none, nothing saved); ValueError in one line for another name."""
  if name not in REMAT_POLICIES:
    raise ValueError(f"remat must be one of {', '.join(REMAT_POLICIES)}, "
                     f"got {name!r}")
  if name == "dots":
    return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
  return None


class Encoder(_BlockSettings):
  """``depth`` blocks named ``block{i}`` (no final norm: the towers place it),
  each a ``Block`` of these settings.

  ``query`` [b] (int32): the one position per row that the tower pools
  (the class token, CLIP text's EOS); the result is then [b, d]. The last
  block computes its attention output, residual and MLP for that token
  only: the other tokens' outputs are never read, and this is about a
  twelfth of a 12-block tower's work (a torch tower computes them).
  ``prune_last=False`` computes every token and picks the row's token after
  the last block (the same numbers up to rounding; the benchmark's A/B).
  ``remat`` (``REMAT_POLICIES``): what each block keeps for the backward
  pass; the params and the forward's results are the same for every value.
  ``depth`` and the rest are keyword-only (they follow the block's settings).
  """
  _: dataclasses.KW_ONLY
  depth: int
  prune_last: bool = True
  remat: str = "none"

  @nn.compact
  def __call__(self, x, lengths=None, causal=False, query=None):
    pruned = query is not None and self.prune_last and self.depth > 0
    block = Block
    if self.remat != "none":
      # ``causal`` (argument 3, counting the module) picks the mask: static.
      block = nn.remat(Block, policy=remat_policy(self.remat),
                       static_argnums=(3,))
    for i in range(self.depth):
      x = block(self.num_heads, self.mlp_dim, self.act, self.ln_eps,
                self.qkv_bias, self.layer_scale, dtype=self.dtype,
                name=f"block{i}")(
                    x, lengths, causal,
                    query=query if pruned and i == self.depth - 1 else None)
    if query is None:
      return x
    if not pruned:
      x = jnp.take_along_axis(x, query[:, None, None], axis=1)
    return x[:, 0]
