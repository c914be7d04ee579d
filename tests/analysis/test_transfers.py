"""Host <-> device bytes read off compiled HLO (offload's PCIe traffic)."""

from zero_jax import analysis

# A loop of 3 trips that slices a host array onto the device and writes a
# device row back into another, plus a whole copy of a host array before
# it, and a fusion that computes on the device only. Shapes as the GPU
# compiler prints them; S(5) is host memory.
_HLO = """\
HloModule m, entry_computation_layout={(f32[8,4]{1,0:S(5)}, f32[8,4]{1,0:S(5)}, f32[16]{0})->(f32[8,4]{1,0:S(5)}, f32[16]{0}, bf16[2]{0})}

%wrapped_ds (param_0: f32[8,4], param_1: s32[]) -> f32[1,4] {
  %param_0 = f32[8,4]{1,0:S(5)} parameter(0)
  %param_1 = s32[] parameter(1)
  ROOT %ds = f32[1,4]{1,0} dynamic-slice(%param_0, %param_1, %param_1), dynamic_slice_sizes={1,4}
}

%wrapped_dus (param_0: f32[8,4], param_1: f32[1,4], param_2: s32[]) -> f32[8,4] {
  %param_0 = f32[8,4]{1,0:S(5)} parameter(0)
  %param_1 = f32[1,4]{1,0} parameter(1)
  %param_2 = s32[] parameter(2)
  ROOT %dus = f32[8,4]{1,0:S(5)} dynamic-update-slice(%param_0, %param_1, %param_2, %param_2)
}

%body (p: (s32[], f32[8,4], f32[8,4])) -> (s32[], f32[8,4], f32[8,4]) {
  %p = (s32[], f32[8,4]{1,0:S(5)}, f32[8,4]{1,0:S(5)}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %src = f32[8,4]{1,0:S(5)} get-tuple-element(%p), index=1
  %dst = f32[8,4]{1,0:S(5)} get-tuple-element(%p), index=2
  %ds-start = ((f32[8,4]{1,0:S(5)}, s32[]), f32[1,4]{1,0}, u32[]) fusion-start(%src, %i), kind=kLoop, calls=%wrapped_ds
  %ds-done = f32[1,4]{1,0} fusion-done(%ds-start)
  %dus-start = ((f32[8,4]{1,0:S(5)}, f32[1,4]{1,0}, s32[]), f32[8,4]{1,0:S(5)}, u32[]) fusion-start(%dst, %ds-done, %i), kind=kLoop, calls=%wrapped_dus
  %dus-done = f32[8,4]{1,0:S(5)} fusion-done(%dus-start)
  ROOT %t = (s32[], f32[8,4]{1,0:S(5)}, f32[8,4]{1,0:S(5)}) tuple(%i, %src, %dus-done)
}

%cond (p: (s32[], f32[8,4], f32[8,4])) -> pred[] {
  %p = (s32[], f32[8,4]{1,0:S(5)}, f32[8,4]{1,0:S(5)}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[8,4], b: f32[8,4], c: f32[16]) -> (f32[8,4], f32[16], bf16[2]) {
  %a = f32[8,4]{1,0:S(5)} parameter(0)
  %b = f32[8,4]{1,0:S(5)} parameter(1)
  %c = f32[16]{0} parameter(2)
  %copy-start = (f32[8,4]{1,0}, f32[8,4]{1,0:S(5)}, u32[]) copy-start(%a)
  %copy-done = f32[8,4]{1,0} copy-done(%copy-start)
  %twice = f32[16]{0} fusion(%c), kind=kLoop, calls=%wrapped_ds
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,4]{1,0:S(5)}, f32[8,4]{1,0:S(5)}) tuple(%zero, %a, %b)
  %while = (s32[], f32[8,4]{1,0:S(5)}, f32[8,4]{1,0:S(5)}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %out = f32[8,4]{1,0:S(5)} get-tuple-element(%while), index=2
  %half = bf16[2]{0} constant({0, 0})
  ROOT %r = (f32[8,4]{1,0:S(5)}, f32[16]{0}, bf16[2]{0}) tuple(%out, %twice, %half)
}
"""


def test_copies_slices_and_updates_count_once_per_execution():
  t = analysis.host_transfers(_HLO)
  # The whole copy (8 x 4 fp32) and one 4-element row slice per trip.
  assert t.to_device == 8 * 4 * 4 + 3 * 4 * 4
  # One row written back per trip; the indices it takes are device
  # scalars too (4 bytes each).
  assert t.to_host == 3 * (4 * 4 + 4)
  assert t.total == t.to_device + t.to_host
  ops = sorted((op, kind, times) for _, op, kind, _, times in t.instructions)
  assert ops == [("copy-start", "to_device", 1),
                 ("fusion-start", "to_device", 3),
                 ("fusion-start", "to_host", 3)]
  # The fused computations' own instructions are not counted again.
  assert all(name not in ("ds", "dus") for name, *_ in t.instructions)


def test_a_program_without_host_memory_moves_nothing():
  t = analysis.host_transfers(_HLO.replace(":S(5)", ""))
  assert (t.to_device, t.to_host, t.instructions) == (0, 0, ())
  assert (t + t).total == 0
