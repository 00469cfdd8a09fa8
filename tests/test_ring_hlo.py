"""benchmarks/ring_hlo.py on hand-written GPU-format HLO (no device needed).

The fixtures follow the text XLA prints for a scheduled GPU module
(``compiled.as_text()``): nested tuple types, ``token[]``, layouts with
memory spaces and tiles, ``/*index=N*/`` comments, backend configs with
braces, the FileNames / StackFrames sections jax 0.11 adds, and the
spellings of an asynchronous collective-permute: ``collective-permute-start``
/ ``-done`` (single, combined, with the in-place-update operands) and a
generic ``async-start`` / ``async-update`` / ``async-done`` wrapping one.
"""
import re

import pytest

from benchmarks import ring_hlo

GPU_HLO = r"""HloModule jit_step, is_scheduled=true, entry_computation_layout={(bf16[8192,768]{1,0}, bf16[8192,768]{1,0}, f32[])->(f32[], bf16[8192,768]{1,0})}, num_partitions=2

FileNames
1 "infcl_jax/losses/softmax.py"

FunctionNames
1 "_fwd"

FileLocations
1 {file_name_id=1 function_name_id=1 line=97 end_line=97 column=4 end_column=30}

StackFrames
1 {file_location_id=1 parent_frame_id=0}

%fused_computation (param_0.1: f32[8192]) -> f32[8192] {
  %param_0.1 = f32[8192]{0} parameter(0)
  ROOT %negate.1 = f32[8192]{0} negate(%param_0.1)
}

%fused_merge (param_0.2: f32[8192], param_1.2: f32[8192]) -> f32[8192] {
  %param_0.2 = f32[8192]{0} parameter(0)
  %param_1.2 = f32[8192]{0} parameter(1)
  ROOT %add.2 = f32[8192]{0} add(%param_0.2, %param_1.2)
}

%command_buffer (p0: f32[8192], p1: f32[8192]) -> f32[8192] {
  %p0 = f32[8192]{0} parameter(0)
  %p1 = f32[8192]{0} parameter(1)
  %loop_negate_fusion = f32[8192]{0} fusion(%p0), kind=kLoop, calls=%fused_computation
  ROOT %loop_add_fusion = f32[8192]{0} fusion(%loop_negate_fusion, %p1), kind=kLoop, calls=%fused_merge
}

%wrapped_collective_permute_computation (param_0.9: bf16[8192,768]) -> bf16[8192,768] {
  %param_0.9 = bf16[8192,768]{1,0} parameter(0)
  ROOT %collective-permute.9 = bf16[8192,768]{1,0} collective-permute(%param_0.9), channel_id=9, source_target_pairs={{0,1},{1,0}}
}

%region_body.3 (arg_tuple.4: (s32[], bf16[8192,768], f32[8192], /*index=3*/f32[8192])) -> (s32[], bf16[8192,768], f32[8192], /*index=3*/f32[8192]) {
  %arg_tuple.4 = (s32[], bf16[8192,768]{1,0}, f32[8192]{0}, /*index=3*/f32[8192]{0}) parameter(0)
  %get-tuple-element.5 = bf16[8192,768]{1,0:S(1)} get-tuple-element(%arg_tuple.4), index=1
  %get-tuple-element.6 = f32[8192]{0} get-tuple-element(%arg_tuple.4), index=2
  %get-tuple-element.7 = f32[8192]{0} get-tuple-element(%arg_tuple.4), index=3
  %collective-permute-start.3 = ((bf16[8192,768]{1,0:S(1)}, f32[8192]{0}), (bf16[8192,768]{1,0:S(1)}, f32[8192]{0}), u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%get-tuple-element.5, %get-tuple-element.6), channel_id=3, source_target_pairs={{0,1},{1,0}}, backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],"collective_backend_config":{"is_sync":false,"no_parallel_custom_call":false},"force_earliest_schedule":false}
  %custom-call.4 = (f32[8192]{0}, f32[8192]{0}) custom-call(%get-tuple-element.5, %get-tuple-element.5), custom_call_target="__gpu$xla.gpu.triton", api_version=API_VERSION_TYPED_FFI, metadata={op_name="jit(step)/pallas_call" stack_frame_id=1}, backend_config={"name":"lse_tile","grid_x":"64"}
  %get-tuple-element.8 = f32[8192]{0} get-tuple-element(%custom-call.4), index=0
  %call.5 = f32[8192]{0} call(%get-tuple-element.8, %get-tuple-element.7), to_apply=%command_buffer
  %collective-permute-done.3 = (bf16[8192,768]{1,0:S(1)}, f32[8192]{0}) collective-permute-done(%collective-permute-start.3)
  %get-tuple-element.9 = bf16[8192,768]{1,0} get-tuple-element(%collective-permute-done.3), index=0
  %constant.10 = s32[] constant(1)
  %add.11 = s32[] add(%constant.10, %constant.10)
  ROOT %tuple.12 = (s32[], bf16[8192,768]{1,0}, f32[8192]{0}, /*index=3*/f32[8192]{0}) tuple(%add.11, %get-tuple-element.9, %call.5, %get-tuple-element.7)
}

%region_cond.13 (arg_tuple.14: (s32[], bf16[8192,768], f32[8192], /*index=3*/f32[8192])) -> pred[] {
  %arg_tuple.14 = (s32[], bf16[8192,768]{1,0}, f32[8192]{0}, /*index=3*/f32[8192]{0}) parameter(0)
  %get-tuple-element.15 = s32[] get-tuple-element(%arg_tuple.14), index=0
  %constant.16 = s32[] constant(3)
  ROOT %compare.17 = pred[] compare(%get-tuple-element.15, %constant.16), direction=LT
}

ENTRY %main.20_spmd (param.1: bf16[8192,768], param.2: bf16[8192,768], param.3: f32[]) -> (f32[], bf16[8192,768]) {
  %param.1 = bf16[8192,768]{1,0} parameter(0), sharding={manual}
  %param.2 = bf16[8192,768]{1,0} parameter(1), sharding={manual}
  %param.3 = f32[] parameter(2), sharding={replicated}
  %after-all.1 = token[] after-all()
  %collective-permute-start = (bf16[8192,768]{1,0}, bf16[8192,768]{1,0}, u32[], u32[]) collective-permute-start(bf16[8192,768]{1,0} %param.2), channel_id=1, source_target_pairs={{0,1},{1,0}}, metadata={op_name="jit(step)/ppermute"}, backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],"collective_backend_config":{"is_sync":false}}
  %custom-call.21 = (f32[8192]{0}, f32[8192]{0}) custom-call(bf16[8192,768]{1,0} %param.1, bf16[8192,768]{1,0} %param.2), custom_call_target="__gpu$xla.gpu.triton", backend_config={"name":"lse_tile"}
  %get-tuple-element.22 = f32[8192]{0} get-tuple-element(%custom-call.21), index=0
  %get-tuple-element.23 = f32[8192]{0} get-tuple-element(%custom-call.21), index=1
  %collective-permute-done = bf16[8192,768]{1,0} collective-permute-done((bf16[8192,768]{1,0}, bf16[8192,768]{1,0}, u32[], u32[]) %collective-permute-start), metadata={op_name="jit(step)/ppermute"}
  %collective-permute-start.1 = (f32[8192]{0}, f32[8192]{0}, u32[], u32[]) collective-permute-start(%get-tuple-element.23), channel_id=2, source_target_pairs={{0,1},{1,0}}, backend_config={"collective_backend_config":{"is_sync":true}}
  %collective-permute-done.1 = f32[8192]{0} collective-permute-done(%collective-permute-start.1)
  %tuple.24 = (s32[], bf16[8192,768]{1,0}, f32[8192]{0}, /*index=3*/f32[8192]{0}) tuple(%constant.0, %collective-permute-done, %get-tuple-element.22, %collective-permute-done.1)
  %async-start.25 = ((bf16[8192,768]{1,0}), bf16[8192,768]{1,0}, u32[]) async-start(%param.1), calls=%wrapped_collective_permute_computation, backend_config={"collective_backend_config":{"is_sync":false}}
  %while.26 = (s32[], bf16[8192,768]{1,0}, f32[8192]{0}, /*index=3*/f32[8192]{0}) while(%tuple.24), condition=%region_cond.13, body=%region_body.3, backend_config={"known_trip_count":{"n":"1"}}
  %async-update.27 = ((bf16[8192,768]{1,0}), bf16[8192,768]{1,0}, u32[]) async-update(%async-start.25), calls=%wrapped_collective_permute_computation
  %loop_fusion.28 = f32[8192]{0} fusion(%get-tuple-element.22), kind=kLoop, calls=%fused_computation
  %async-done.29 = bf16[8192,768]{1,0} async-done(%async-update.27), calls=%wrapped_collective_permute_computation
  %collective-permute.30 = f32[8192]{0} collective-permute(%loop_fusion.28), channel_id=5, source_target_pairs={{0,1},{1,0}}
  %collective-permute-start.31 = (bf16[8192,768]{1,0}, bf16[8192,768]{1,0}, u32[], u32[]) collective-permute-start(%async-done.29), channel_id=6, source_target_pairs={{0,1},{1,0}}
  %weird.32 = some<unknown>type frobnicate(%param.1)
  %reduce.33 = f32[] reduce(%collective-permute.30, %param.3), dimensions={0}, to_apply=%fused_merge
  ROOT %tuple.34 = (f32[], bf16[8192,768]{1,0}) tuple(%reduce.33, %async-done.29)
}
"""

# The wrapped form of the XLA test corpus: no '%', an instruction over two
# lines, an async computation with an execution thread.
WRAPPED_HLO = """HloModule module, is_scheduled=true

async_computation {
  p0 = f32[64,32]{1,0} parameter(0)
  ROOT cp = f32[64,32]{1,0} collective-permute(p0), source_target_pairs={{0,1},{1,0}}
}, execution_thread="main"

ENTRY entry {
  a = f32[64,32]{1,0} parameter(0)
  b = f32[64,64]{1,0} parameter(1)
  start = ((f32[64,32]{1,0}), f32[64,32]{1,0}, u32[]) async-start(a),
    calls=async_computation
  d = f32[64,64]{1,0} dot(b, b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT done = f32[64,32]{1,0} async-done(start), calls=async_computation
}
"""


def _by_name(found):
  return {r["name"]: r for r in found}


def test_parse_instr_spellings():
  typ, op, operands, called, _ = ring_hlo.parse_instr(
      "((bf16[8192,768]{1,0:S(1)}, f32[8192]{0}), (bf16[8192,768]{1,0:S(1)}, "
      "f32[8192]{0}), u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start("
      "%a, %b), channel_id=3, backend_config={\"x\":{\"is_sync\":false}}")
  assert op == "collective-permute-start" and operands == ["a", "b"]
  assert typ.startswith("((bf16") and called == []
  # Long-form operands carry their types; comments are dropped.
  _, op, operands, _, _ = ring_hlo.parse_instr(
      "(s32[], f32[8]{0}, /*index=2*/f32[8]{0}) tuple(s32[] %x, "
      "f32[8]{0} %y, /*index=2*/f32[8]{0} %z)")
  assert op == "tuple" and operands == ["x", "y", "z"]
  assert ring_hlo.parse_instr("token[] after-all()")[1] == "after-all"
  _, op, _, called, _ = ring_hlo.parse_instr(
      "(s32[]) conditional(%p, %a, %b), branch_computations={%br0, %br1}")
  assert op == "conditional" and called == ["br0", "br1"]
  for junk in ("", "???", "f32[8]{0}", "((( unbalanced", "x y z(",
               "some<unknown>type frobnicate(%q)"):
    ring_hlo.parse_instr(junk)  # Never raises.


def test_describe_size():
  assert ring_hlo.describe_size("bf16[8192,768]{1,0}") == (
      "bf16[8192,768] (12.6 MB)")
  assert ring_hlo.describe_size(
      "(bf16[8192,768]{1,0:S(1)}, f32[8192]{0})") == (
          "bf16[8192,768] + f32[8192] (12.6 MB)")
  assert ring_hlo.describe_size("f32[65536,768]{1,0}").endswith("(201 MB)")
  assert ring_hlo.describe_size("token[]") == "?"
  assert ring_hlo.describe_size("f32[<=8]{0}") == "?"
  assert ring_hlo.describe_size("") == "?"


def test_gpu_module():
  comps = ring_hlo.computations(GPU_HLO)
  assert "main.20_spmd" in comps and "region_body.3" in comps
  assert "FileNames" not in comps and "StackFrames" not in comps
  found = _by_name(ring_hlo.analyze(GPU_HLO))
  assert set(found) == {"collective-permute-start", "collective-permute-start.1",
                        "collective-permute-start.3", "async-start.25",
                        "collective-permute.30", "collective-permute-start.31"}
  # The wrapped computation's collective-permute is the async op's, not a
  # synchronous one.
  assert "collective-permute.9" not in found

  first = found["collective-permute-start"]  # The local tile between.
  assert first["kind"] == "async" and first["done"] == "collective-permute-done"
  assert first["size"] == "bf16[8192,768] (12.6 MB)"
  assert first["between_direct"] == {"custom-call": 1}
  assert first["overlapped"] and not first["is_sync"] and not first["in_loop"]

  stats = found["collective-permute-start.1"]  # Nothing between, is_sync.
  assert stats["is_sync"] and not stats["overlapped"]
  assert stats["size"] == "f32[8192] (32.8 kB)"

  body = found["collective-permute-start.3"]  # Combined, in a loop body,
  assert body["in_loop"] and body["done"] == "collective-permute-done.3"
  assert body["size"] == "bf16[8192,768] + f32[8192] (12.6 MB)"
  # ... a Pallas kernel, then a command buffer call of two fusions.
  assert body["between_direct"] == {"custom-call": 1}
  assert body["between_nested"] == {"fusion": 2}

  wrapped = found["async-start.25"]  # async-start/update/done, a loop and a
  assert wrapped["spelling"] == "async-start/done(collective-permute)"
  assert wrapped["done"] == "async-done.29"  # fusion between.
  assert wrapped["size"] == "bf16[8192,768] (12.6 MB)"
  assert wrapped["between_direct"] == {"fusion": 1}
  # The while's body and condition, recursively (the body's call too).
  assert wrapped["between_nested"] == {"custom-call": 1, "fusion": 2}
  assert wrapped["colls_between"] == {"collective-permute-start": 1,
                                      "collective-permute-done": 1}

  assert found["collective-permute.30"]["kind"] == "sync"
  assert found["collective-permute.30"]["size"] == "f32[8192] (32.8 kB)"
  lost = found["collective-permute-start.31"]
  assert lost["done"] is None and lost["size"] == "?"

  lines = []
  assert ring_hlo.report(GPU_HLO, out=lines.append) == (5, 3, 1)
  text = "\n".join(lines)
  assert "done not found" in text and "is_sync" in text
  assert "summary: 5 async" in text


def test_wrapped_lines_without_percent():
  found = ring_hlo.analyze(WRAPPED_HLO)
  assert len(found) == 1
  (r,) = found
  assert r["name"] == "start" and r["done"] == "done"
  assert r["between_direct"] == {"dot": 1} and r["overlapped"]
  assert r["size"] == "f32[64,32] (8.19 kB)"


def test_cpu_module_is_sync():
  """The CPU runtime's real HLO: synchronous collective-permutes only."""
  jax = pytest.importorskip("jax")
  if len(jax.devices()) < 2:
    pytest.skip("needs 2 host devices (conftest.py sets XLA_FLAGS)")
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax import lax  # pylint: disable=import-outside-toplevel
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))
  f = jax.jit(jax.shard_map(
      lambda a: lax.ppermute(a, "d", [(0, 1), (1, 0)]) * 2, mesh=mesh,
      in_specs=P("d"), out_specs=P("d")))
  hlo = f.lower(jax.ShapeDtypeStruct((16, 8), np.float32)).compile().as_text()
  n_async, n_overlapped, n_sync = ring_hlo.report(hlo, out=lambda _: None)
  assert n_sync >= 1 and n_async == n_overlapped == 0


def test_garbage_gives_counts_not_exceptions():
  """Truncated or mangled HLO is reported on as far as it parses: the
  counts (async, overlapped, sync) of what was found, no exception. A
  start with no done (the module cut off) is async but not overlapped."""
  cases = [("", (0, 0, 0)), ("}", (0, 0, 0)), ("ENTRY e {\n", (0, 0, 0)),
           ("ENTRY e {\n  x = \n}\n", (0, 0, 0)),
           ("ENTRY e {\n  %s = (f32[2] collective-permute-start(%q)\n}\n",
            (1, 0, 0)),
           (GPU_HLO[: len(GPU_HLO) // 2], (1, 1, 1)),
           (GPU_HLO.replace("{", ""), (0, 0, 0))]
  for text, want in cases:
    lines = []
    assert ring_hlo.report(text, out=lines.append) == want, text[:40]
    assert len(ring_hlo.analyze(text)) == sum(want[::2]), text[:40]


def _gpu_ring_hlo(family, b, d=768):
  """The optimized, scheduled HLO of one ring fwd+bwd step on 2 GPUs."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel
  import infcl_jax  # pylint: disable=import-outside-toplevel
  gpus = [dv for dv in jax.devices() if dv.platform == "gpu"]
  if len(gpus) < 2:
    pytest.skip("needs 2 GPUs")
  mesh = jax.sharding.Mesh(np.array(gpus[:2]), ("data",))
  if family == "softmax":
    loss = lambda x, y, t: infcl_jax.contrastive_loss(
        x, y, t, axis_name="data", strategy="ring")
  else:
    loss = lambda x, y, t: infcl_jax.sigmoid_loss(
        x, y, t, jnp.float32(-10.0), axis_name="data")
  step = jax.jit(jax.shard_map(
      jax.value_and_grad(loss, argnums=(0, 1, 2)), mesh=mesh,
      in_specs=(P("data"), P("data"), P()),
      out_specs=(P(), (P("data"), P("data"), P()))))
  x = jax.ShapeDtypeStruct((2 * b, d), jnp.bfloat16)
  t = jax.ShapeDtypeStruct((), jnp.float32)
  return step.lower(x, x, t).compile().as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("family,b", [("softmax", 8192), ("softmax", 65536),
                                      ("sigmoid", 8192)])
def test_gpu_ring_transfers_overlap_tiles(family, b):
  """On 2 GPUs every collective-permute of the ring is asynchronous and
  every large one (a shard or a gradient accumulator) has a kernel
  scheduled between its start and done. Before ``Ring.tie`` XLA combined
  the key shard's send with the home tile's column statistics at b = 8192
  (the shard then waited for the tile) and ran the key gradient's send
  synchronously."""
  found = ring_hlo.analyze(_gpu_ring_hlo(family, b))
  assert found, "no collective-permute found"
  assert not [r for r in found if r["kind"] == "sync" or r["is_sync"]], found
  big = [r for r in found
         if re.search(r"\(([\d.]+) MB\)", r["size"])
         and float(re.search(r"\(([\d.]+) MB\)", r["size"]).group(1)) >= 1]
  assert big, found
  exposed = [r for r in big if not r["overlapped"]]
  assert not exposed, exposed


@pytest.mark.gpu
@pytest.mark.parametrize("b", [8192, 65536])
def test_gpu_ring_accumulator_send_overlaps_a_tile(b):
  """The key-gradient accumulator's send (float32, b x D) has a tile kernel
  (custom-call) scheduled between its start and done, under the ring's
  recommended flags (``infcl_jax.xla_flags``, set by conftest). With XLA's
  default of one async collective in flight the last send is started after
  the home tile, behind the loss + scale-gradient all-reduce (2 H200s, jax
  0.11.2), and this fails."""
  import os  # pylint: disable=import-outside-toplevel
  from infcl_jax import xla_flags  # pylint: disable=import-outside-toplevel
  assert xla_flags.recommended(os.environ.get("XLA_FLAGS", "")).split() == \
      os.environ.get("XLA_FLAGS", "").split()
  found = ring_hlo.analyze(_gpu_ring_hlo("softmax", b))
  acc = [r for r in found if r["size"].startswith(f"f32[{b},768]")]
  assert acc, found
  for r in acc:
    tiles = (r["between_direct"].get("custom-call", 0)
             + r["between_nested"].get("custom-call", 0))
    assert tiles, r
