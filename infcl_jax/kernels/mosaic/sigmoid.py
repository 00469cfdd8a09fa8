"""Mosaic GPU kernels of the sigmoid (SigLIP) family: forward sum and G panel.

One persistent, warp-specialized kernel with three modes, on the same
skeleton as the softmax panel (``g_panel``; see ``common``): a TMA producer
and two wgmma consumers, a persistent grid of P CTAs over the
(n_pad / block_q) x (m_pad / (2 * block_k)) tiles, row blocks fastest. Per
(block_q, block_k) float32 logit tile s = t * x y^T + b a consumer forms, with
z = +1 on the positives (global row index == global column index, when the
block pair has a diagonal) and -1 elsewhere:

* ``mode="sum"`` (forward): softplus(-z s), summed per row into a register
  vector kept across all the CTA's tiles; the (P, 2, block_q) partials are
  summed in XLA. The loss needs only the total, so no row ever needs its
  own complete sum and nothing is merged across CTAs in the kernel.
* ``mode="g"`` (backward panel): G = (-z) sigmoid(-z s), written to HBM in
  the input dtype (registers -> swizzled SMEM -> TMA store) times
  ``params[2]`` when ``scaled``; the partial sums of G * (x y^T) and of G
  (from the unscaled float32 G) as per-row register vectors.
* ``mode="max"``: the largest |G| only (the float16 pre-pass that picks the
  panel's divisor; see ``backends.pallas``).

No column statistics: no cross-warp reduction, so the consumers need no
turns. Each term is evaluated on its own: softplus(u) = max(u, 0) +
log1p(e^-|u|), with log1p from a short series (Mosaic GPU has no log1p
lowering, and log(1 + e) loses a tiny e entirely): log1p(e) =
2 atanh(e / (2 + e)), eight odd terms for e in [0, 1] (relative error
< 2e-9), so a tiny loss keeps its relative accuracy.

Row ids: ``row_ids[i]`` is row i's global index (-1 on padding); columns are
valid below ``m``. Padding must be masked here: a zero row's logit is the
bias, not -inf.

Groups (``groups=(gx, gy)``, a static switch): pair (i, j) is related when
gx_i == gy_j; ``group_mode="positives"`` makes related pairs positives
(z = +1, like the diagonal), ``"mask"`` drops those that are not the
diagonal (term and G are 0). Per element: one compare and one select (an
or, for "positives"); the rows' ids are loaded beside the row ids, the
columns' per tile.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from infcl_jax import _device
from infcl_jax.kernels.mosaic import common

F32 = jnp.float32
WGMMA = plgpu.Layout.WGMMA
ROW = plgpu.Layout.WGMMA.reduce(1)
COL = plgpu.Layout.WGMMA.reduce(0)
MODES = ("sum", "g", "max")
GROUP_MODES = ("mask", "positives")


def log1p_unit(e):
  """log(1 + e) for e in [0, 1] to float32 relative accuracy.

  2 atanh(t) with t = e / (2 + e) in [0, 1/3]: t + t^3/3 + ... + t^15/15.
  """
  t = e / (e + 2.0)
  t2 = t * t
  p = t2 * (1.0 / 15.0) + (1.0 / 13.0)
  for k in (11, 9, 7, 5, 3):
    p = p * t2 + (1.0 / k)
  p = p * t2 + 1.0
  return 2.0 * t * p


def softplus(u):
  """log(1 + e^u), stable for both signs, relative accuracy for u << 0."""
  return jnp.maximum(u, 0.0) + log1p_unit(jnp.exp(-jnp.abs(u)))


def _kernel(params_ref, x_ref, y_ref, rid_ref, *refs, mode, m, mask,
            has_diagonal, scaled, group_mode, bq, bk, bd, nd, ni, num_tiles,
            nprog, stages):
  refs = list(refs)
  gx_ref, gy_ref = ([refs.pop(0) for _ in range(2)] if group_mode
                    else (None, None))
  g_ref = refs.pop(0) if mode == "g" else None
  part_ref = refs.pop(0)
  if mode == "g":
    x_smem, y_smem, g_smem, x_full, y_full, consumed = refs
  else:
    x_smem, y_smem, x_full, y_full, consumed = refs
    g_smem = None
  pid, my_tiles, coords = common.persistent_tiles(num_tiles, nprog, ni)

  def consumer(wg):
    scale = params_ref[0]
    bias = params_ref[1]
    g_scale = params_ref[2]
    zero_r = plgpu.layout_cast(jnp.zeros((bq,), F32), ROW)

    def tile_body(u, acc):
      i, j = coords(u)
      c0 = j * (2 * bk) + wg * bk
      # Issued before the matmul: its latency hides behind it.
      rid = plgpu.load(rid_ref.at[pl.ds(i * bq, bq)], layout=ROW,
                       optimized=False)
      if group_mode:
        gx = plgpu.load(gx_ref.at[pl.ds(i * bq, bq)], layout=ROW,
                        optimized=False)
        gy = plgpu.load(gy_ref.at[pl.ds(c0, bk)], layout=COL,
                        optimized=False)
      s0 = common.mma_tile(x_smem, y_smem, x_full, y_full, consumed,
                           g0=u * nd, nd=nd, wg=wg, bq=bq, bk=bk,
                           stages=stages, split_rings=False)
      s = s0 * scale + bias
      rid2 = None
      if has_diagonal or mask:
        ci = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 1, layout=WGMMA) + c0
        rid2 = lax.broadcast_in_dim(rid, s.shape, [0])
      pos = (rid2 == ci) if has_diagonal else None
      valid = ((rid2 >= 0) & (ci < m)) if mask else None
      if group_mode:
        gx2 = lax.broadcast_in_dim(gx, s.shape, [0])
        gy2 = lax.broadcast_in_dim(gy, s.shape, [1])
        # Negations as comparisons: Mosaic GPU does not lower a bool ``~``.
        keep = None
        if group_mode == "positives":
          rel = gx2 == gy2
          pos = rel if pos is None else pos | rel
        else:
          keep = gx2 != gy2
          keep = keep if pos is None else pos | keep
      zeros = jnp.zeros(s.shape, F32)
      signed = pos is not None
      # -z * s: -s on the positives, s elsewhere.
      u_ = jnp.where(pos, -s, s) if signed else s
      if group_mode == "mask":
        # A dropped pair's argument is -inf: softplus(-inf) = sigmoid(-inf)
        # = 0, one select before the exponentials and no mask kept across
        # them.
        u_ = jnp.where(keep, u_, jnp.full(s.shape, -jnp.inf, F32))
      if mode == "sum":
        sp = softplus(u_)
        if valid is not None:
          sp = jnp.where(valid, sp, zeros)
        return acc[0] + sp.sum(axis=1), acc[1]
      # sigmoid(u) = 1 / (1 + e^-u): e^-u overflows to inf for u << 0 and
      # gives 0, never NaN.
      sg = 1.0 / (1.0 + jnp.exp(-u_))
      g = jnp.where(pos, -sg, sg) if signed else sg
      if valid is not None:
        g = jnp.where(valid, g, zeros)
      if mode == "max":
        return jnp.maximum(acc[0], jnp.abs(g).max(axis=1)), acc[1]
      gs = g * g_scale if scaled else g
      # The previous tile's TMA store must have read g_smem before reuse.
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      g_smem.at[wg][...] = gs.astype(g_smem.dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(g_smem.at[wg],
                              g_ref.at[pl.ds(i * bq, bq), pl.ds(c0, bk)])
      return acc[0] + (g * s0).sum(axis=1), acc[1] + g.sum(axis=1)

    a0, a1 = lax.fori_loop(0, my_tiles, tile_body, (zero_r, zero_r))
    part_ref.at[pid, wg, 0][...] = a0
    part_ref.at[pid, wg, 1][...] = a1
    if mode == "g":
      plgpu.wait_smem_to_gmem(0)

  # One shared ring: with no column statistics the consumers take no turns,
  # so a ring per consumer would only add a second fetch of x.
  common.specialize(consumer, x_ref, y_ref, x_smem, y_smem, x_full, y_full,
                    consumed, coords=coords, num_tiles=my_tiles, nd=nd, bq=bq,
                    bk=bk, bd=bd, stages=stages, split_rings=False)


def sigmoid_tiles(x, y, row_ids, params, *, mode, m, mask, has_diagonal,
                  scaled=False, block_q=128, block_k=128, block_d=64,
                  num_stages=None, num_programs=None, interpret=False,
                  groups=None, group_mode="mask"):
  """The sigmoid forward sum, G panel or max |G| of padded x against y.

  Args:
    x: (R, Dp) zero-padded bf16 / f16 rows (R a multiple of block_q).
    y: (m_pad, Dp) zero-padded rows (m_pad a multiple of 2 * block_k).
    row_ids: (R,) int32 global row index of each row of x, -1 on padding.
    params: (4,) float32 [scale, bias, g_scale, unused] (natural units).
    mode: "sum", "g" or "max" (see the module docstring).
    m: valid rows of y (static); mask: whether any padding exists (static).
    has_diagonal: whether the pairs (row id == column) are the positives.
    scaled: "g" only: store G * g_scale (float16 panels).
    num_stages: ring slots; default 4 for "sum" / "max", 3 for "g" (whose
      64 KB of G buffers take the fourth's shared memory).
    num_programs: persistent CTAs (default: one per SM).
    groups: None, or (gx (R,), gy (m_pad,)) int32 group ids of the rows of
      x and y (any value on padding).
    group_mode: with ``groups``, "mask" (related pairs off the diagonal are
      left out) or "positives" (related pairs get z = +1).

  Returns:
    "sum": the float32 sum of softplus(-z s) over the valid pairs;
    "g": (G (R, m_pad) of x.dtype, sum G * x y^T, sum G), unscaled sums;
    "max": the largest |G| (float32 scalar).
  """
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
  common.check_inputs(x, y, block_q, block_k, block_d)
  r_rows, d_pad = x.shape
  m_pad = y.shape[0]
  if groups is not None:
    if group_mode not in GROUP_MODES:
      raise ValueError(f"group_mode must be one of {GROUP_MODES}, got "
                       f"{group_mode!r}")
    common.check_groups(groups, x, y)
  ni, nj2, nd = r_rows // block_q, m_pad // (2 * block_k), d_pad // block_d
  num_tiles = ni * nj2
  nprog = max(1, min(num_programs or _device.num_sms(), num_tiles))
  if num_stages is None:
    num_stages = 3 if mode == "g" else 4
  ring = common.ring_scratch(x.dtype, bq=block_q, bk=block_k, bd=block_d,
                             stages=num_stages, split_rings=False)
  scratch = ring[:2]
  if mode == "g":
    scratch.append(plgpu.SMEM((common.NUM_CONSUMERS, block_q, block_k),
                              x.dtype,
                              transforms=common.smem_transforms(x.dtype,
                                                                block_k)))
  scratch += ring[2:]
  out_type = []
  if mode == "g":
    out_type.append(jax.ShapeDtypeStruct((r_rows, m_pad), x.dtype))
  out_type.append(jax.ShapeDtypeStruct(
      (nprog, common.NUM_CONSUMERS, 2, block_q), F32))
  kernel = functools.partial(
      _kernel, mode=mode, m=m, mask=mask, has_diagonal=has_diagonal,
      scaled=scaled, group_mode=None if groups is None else group_mode,
      bq=block_q, bk=block_k, bd=block_d, nd=nd, ni=ni,
      num_tiles=num_tiles, nprog=nprog, stages=num_stages)
  ins = (params.astype(F32), x, y, row_ids.astype(jnp.int32))
  if groups is not None:
    ins += tuple(g.astype(jnp.int32) for g in groups)
  outs = common.launch(kernel, operands=ins, out_type=out_type,
                       scratch=scratch, nprog=nprog,
                       name=f"infcl_mosaic_sigmoid_{mode}",
                       interpret=interpret, split_rings=False)
  part = outs[-1]
  if mode == "sum":
    return jnp.sum(part[:, :, 0])
  if mode == "max":
    return jnp.max(part[:, :, 0])
  return outs[0], jnp.sum(part[:, :, 0]), jnp.sum(part[:, :, 1])
