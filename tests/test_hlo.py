"""The HLO collective parser on the line shapes XLA prints."""

from zero_jax import hlo

_TEXT = """
  %all-reduce = (f32[2,64]{1,0}, /*index=1*/f32[16]{0}, f32[]) all-reduce(%a, %b, %c), channel_id=1, to_apply=%add
  %reduce-scatter.3 = f32[4,8]{1,0} reduce-scatter(%g), channel_id=2, dimensions={0}
  %all-gather-start = (bf16[4,8]{1,0}, bf16[32,8]{1,0}) all-gather-start(%p), dimensions={0}
  %all-gather-done = bf16[32,8]{1,0} all-gather-done(%all-gather-start)
  %add.1 = f32[4,8]{1,0} add(%reduce-scatter.3, %x)
"""


def test_parses_tuples_async_and_dtypes():
  ops = hlo.collectives(_TEXT)
  assert [c.kind for c in ops] == ["all-reduce", "reduce-scatter",
                                   "all-gather"]
  assert ops[0].shapes == ((2, 64), (16,), ())
  assert ops[0].elements == 128 + 16 + 1
  assert ops[1].bytes == 32 * 4
  # async start: only the result (not the operand) is counted.
  assert ops[2].shapes == ((32, 8),) and ops[2].bytes == 256 * 2
  s = hlo.summarize(_TEXT)
  assert s["all-reduce"] == {"count": 1, "elements": 145, "bytes": 580}
