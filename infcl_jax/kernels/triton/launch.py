"""Running a Triton-language kernel on JAX arrays: the one launch path.

``call`` is what every kernel wrapper of this package uses:

* On the GPU: ``jax_triton.triton_call``, which compiles the kernel for the
  device and emits it as an XLA custom call (so it runs inside ``jit``).
* Off the GPU: Triton's own interpreter, through ``jax.pure_callback``. The
  interpreter needs ``TRITON_INTERPRET=1`` in the environment when the
  kernel modules are imported (``triton.jit`` reads it then); it executes
  the same kernel source on host numpy buffers, one program after another,
  exact in float32. This is how the CPU tests run the kernels.

Two properties the losses need from a tile op, that ``triton_call`` does
not have on its own:

* ``vmap`` (a batch-of-problems axis): ``triton_call`` refuses to be
  batched, so each launch is wrapped in ``jax.custom_batching
  .sequential_vmap``: a batch of problems runs one problem after another
  (``lax.map``), each the unbatched kernel.
* ``shard_map`` with ``check_vma=True``: ``triton_call``'s outputs are
  typed without varying mesh axes, as if replicated; they are per-device
  results of their inputs, so they get their inputs' varying axes
  (``_axes.vary_like``, no data movement).

Every launch is first written down as a ``Launch`` (the kernel, its
argument types, grid, compiler options and compile-time constants): the
one description that ``triton_call`` gets on the GPU and that ``aot``
compiles for a CUDA target on a machine without one. ``record()`` collects
the launches of a traced computation instead of running them, so that a
CPU test can compile exactly what the GPU would.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np

from infcl_jax import _axes

import triton  # pylint: disable=g-bad-import-order
import triton.language as tl  # noqa: F401  (kernels share this import)

# The pointer types jax-triton gives an array argument
# (``jax_triton.triton_lib.get_triton_type``).
TRITON_TYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32",
                "int32": "i32"}


@dataclasses.dataclass(frozen=True)
class Launch:
  """One kernel launch: what ``triton_call`` is given, and all of it."""
  kernel: object
  ins: tuple  # jax.ShapeDtypeStruct of each array argument, in order
  outs: tuple  # jax.ShapeDtypeStruct of each output, in order
  grid: tuple
  num_warps: int
  num_stages: int
  name: str
  constexprs: dict

  def signature(self) -> dict:
    """The kernel's signature as jax-triton compiles it: a pointer per
    array, inputs then outputs, then the compile-time constants."""
    fn = getattr(self.kernel, "fn", self.kernel)
    names = list(getattr(self.kernel, "arg_names", None)
                 or fn.__code__.co_varnames[:fn.__code__.co_argcount])
    arrays = [*self.ins, *self.outs]
    sig = {n: "*" + TRITON_TYPES[np.dtype(a.dtype).name]
           for n, a in zip(names, arrays)}
    missing = [n for n in names[len(arrays):] if n not in self.constexprs]
    if len(names) < len(arrays) or missing:
      raise ValueError(f"{self.name}: {len(arrays)} arrays and constants "
                       f"{sorted(self.constexprs)} do not fill {names}")
    sig.update({n: "constexpr" for n in self.constexprs})
    return sig

  def triton_call_kwargs(self) -> dict:
    return dict(kernel=self.kernel, out_shape=list(self.outs),
                grid=self.grid, num_warps=self.num_warps,
                num_stages=self.num_stages, name=self.name,
                **self.constexprs)


_RECORDS: list[list[Launch]] = []


@contextlib.contextmanager
def record():
  """Collects the launches of what runs inside (a list, filled in order)
  instead of running them: their outputs are zeros. Meant for tracing
  (``jax.eval_shape``) a loss to compile its kernels ahead of time. JAX's
  caches are cleared first: a cached trace would launch nothing."""
  jax.clear_caches()
  launches: list[Launch] = []
  _RECORDS.append(launches)
  try:
    yield launches
  finally:
    _RECORDS.pop()


def recording() -> bool:
  return bool(_RECORDS)


def interpreting() -> bool:
  """Whether the kernels run in Triton's interpreter (never while
  recording: the recorded launches are the GPU's)."""
  if _RECORDS:
    return False
  knobs = getattr(triton, "knobs", None)
  if knobs is not None:
    return bool(knobs.runtime.interpret)
  return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def call(kernel, *arrays, out_shape, grid, num_warps, num_stages, name,
         **constexprs):
  """``kernel[grid](*arrays, *outputs, **constexprs)`` on JAX arrays.

  Args:
    kernel: a ``triton.jit`` function whose pointer arguments are the
      ``arrays`` then the outputs, followed by its ``tl.constexpr`` ones.
    arrays: contiguous JAX arrays (scalars travel as a small float32 array,
      so that nothing traced becomes a compile-time constant).
    out_shape: a list of ``jax.ShapeDtypeStruct``.
    grid: up to three program counts.
    num_warps, num_stages: Triton compiler options (ignored when
      interpreted).
    name: the launch's name in profiles.
    constexprs: the kernel's compile-time arguments (Python ints, floats,
      bools, strings).

  Returns:
    The list of outputs.
  """
  spec = Launch(
      kernel=kernel,
      ins=tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays),
      outs=tuple(jax.ShapeDtypeStruct(s.shape, s.dtype) for s in out_shape),
      grid=tuple(int(g) for g in grid), num_warps=num_warps,
      num_stages=num_stages, name=name, constexprs=dict(constexprs))
  spec.signature()  # a kernel / argument mismatch fails here, on any host
  if _RECORDS:
    _RECORDS[-1].append(spec)
    return [jnp.zeros(s.shape, s.dtype) for s in spec.outs]

  if interpreting():
    def run(*xs):
      return _interpret(kernel, xs, list(spec.outs), spec.grid, constexprs)
  else:
    def run(*xs):
      import jax_triton  # pylint: disable=g-import-not-at-top
      return list(jax_triton.triton_call(*xs, **spec.triton_call_kwargs()))

  outs = jax.custom_batching.sequential_vmap(run)(*arrays)
  # Per-device results of per-device inputs (see the module docstring).
  return list(_axes.vary_like(list(outs), *arrays))


# ------------------------------------------------------------ interpreter

class _HostBuffer:
  """A numpy array as Triton's interpreter takes a tensor argument.

  The interpreter reads a tensor argument through ``data_ptr()`` and its
  dtype, and "copies it to the host" through the torch storage methods
  below; a numpy array is on the host already, so those are identities.
  """

  def __init__(self, a):
    self.a = a
    self.dtype = a.dtype

  def data_ptr(self):
    return self.a.ctypes.data

  def untyped_storage(self):
    return self

  def cpu(self):
    return self

  def new_empty(self, *args, **kwargs):
    del args, kwargs
    return _HostBuffer(self.a)

  def set_(self, storage, offset, size, stride):
    del offset, size, stride
    self.a = storage.a
    return self

  def storage_offset(self):
    return 0

  def size(self):
    return self.a.shape

  def stride(self):
    return tuple(s // self.a.itemsize for s in self.a.strides)

  def copy_(self, other):
    del other  # Same memory.


_PATCHED = []


def _patch_bf16_dot():
  """The interpreter stores bfloat16 as uint16 and multiplies those ints in
  ``tl.dot``; widen them to the float32 values they encode first."""
  if _PATCHED:
    return
  from triton.runtime import interpreter  # pylint: disable=g-import-not-at-top
  builder = interpreter.InterpreterBuilder
  original = builder.create_dot

  def widen(h):
    if h.dtype.scalar == tl.bfloat16:
      bits = h.data.astype(np.uint32) << 16
      return interpreter.TensorHandle(bits.view(np.float32), tl.float32)
    return h

  def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    return original(self, widen(a), widen(b), d, input_precision,
                    max_num_imprecise_acc)

  builder.create_dot = create_dot
  _PATCHED.append(True)


# The interpreter keeps process-wide state (the grid being run, the patched
# language); the callbacks of several devices (shard_map on a multi-device
# CPU) run on different threads, so they take turns.
_LOCK = threading.Lock()


def _interpret(kernel, xs, out_shape, grid, constexprs):
  _patch_bf16_dot()

  def host(*arrays):
    ins = [_HostBuffer(np.ascontiguousarray(a)) for a in arrays]
    outs = [np.zeros(s.shape, s.dtype) for s in out_shape]
    with _LOCK:
      kernel[grid](*ins, *[_HostBuffer(o) for o in outs], **constexprs)
    return outs

  return list(jax.pure_callback(host, out_shape, *xs))
