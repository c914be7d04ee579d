"""The HLO collective parser on the line shapes XLA prints."""

from zero_jax import analysis

_TEXT = """
  %all-reduce = (f32[2,64]{1,0}, /*index=1*/f32[16]{0}, f32[]) all-reduce(%a, %b, %c), channel_id=1, to_apply=%add
  %reduce-scatter.3 = f32[4,8]{1,0} reduce-scatter(%g), channel_id=2, dimensions={0}
  %all-gather-start = (bf16[4,8]{1,0}, bf16[32,8]{1,0}) all-gather-start(%p), dimensions={0}
  %all-gather-done = bf16[32,8]{1,0} all-gather-done(%all-gather-start)
  %add.1 = f32[4,8]{1,0} add(%reduce-scatter.3, %x)
"""


def test_parses_tuples_async_and_dtypes():
  ops = analysis.collectives(_TEXT)
  assert [c.kind for c in ops] == ["all-reduce", "reduce-scatter",
                                   "all-gather"]
  assert ops[0].shapes == ((2, 64), (16,), ())
  assert ops[0].elements == 128 + 16 + 1
  assert ops[1].bytes == 32 * 4
  # async start: only the result (not the operand) is counted.
  assert ops[2].shapes == ((32, 8),) and ops[2].bytes == 256 * 2
  s = analysis.summarize(_TEXT)
  assert s["all-reduce"] == {"count": 1, "elements": 145, "bytes": 580}


_LOOP = """
%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ag = f32[64]{0} all-gather(%x), dimensions={0}
  %inner = (s32[], f32[8]) while(%t), condition=%cond2, body=%body2, backend_config={"known_trip_count":{"n":"3"}}
}

%body2 (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %rs = f32[8]{0} reduce-scatter(%y), dimensions={0}
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %ar = f32[4]{0} all-reduce(%a), to_apply=%add
  %loop = (s32[], f32[8]) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
}
"""


def test_loop_trip_counts_multiply():
  s = analysis.summarize(_LOOP)
  assert s["all-reduce"] == {"count": 1, "elements": 4, "bytes": 16}
  assert s["all-gather"] == {"count": 4, "elements": 256, "bytes": 1024}
  assert s["reduce-scatter"] == {"count": 12, "elements": 96, "bytes": 384}
