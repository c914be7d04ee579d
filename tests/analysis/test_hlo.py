"""The HLO collective parser on the line shapes XLA prints."""

import pytest

from zero_jax import analysis
from zero_jax.analysis._hlo import replica_groups

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


@pytest.mark.parametrize("text,groups", [
    ("replica_groups={{0,2,4,6},{1,3,5,7}}", ((0, 2, 4, 6), (1, 3, 5, 7))),
    ("replica_groups=[4,2]<=[8]", ((0, 1), (2, 3), (4, 5), (6, 7))),
    ("replica_groups=[2,4]<=[4,2]T(1,0)", ((0, 2, 4, 6), (1, 3, 5, 7))),
    ("replica_groups=mesh['data'=4,'model'=2] {'data'}",
     ((0, 2, 4, 6), (1, 3, 5, 7))),
    ("replica_groups=mesh['axis_0'=1,'axis_1'=2,'axis_2'=4], "
     "device_ids=([4,2]T(1,0)) {'axis_1'}", ((0, 1), (2, 3), (4, 5),
                                             (6, 7))),
    # Shardy's sub-axes (jax 0.12): 'data':(1)4 is the major 4 of 'data'
    # (after sub-axes of product 1), as the same all-to-all's groups read
    # with Shardy off: mesh['axis_0'=4,'axis_1'=2] {'axis_0'}.
    ("replica_groups=mesh['data'=8] {'data':(1)4}",
     ((0, 2, 4, 6), (1, 3, 5, 7))),
    ("replica_groups=mesh['data'=8] {'data':(4)2}",
     ((0, 1), (2, 3), (4, 5), (6, 7))),
    ("replica_groups=mesh['data'=8,'model'=2] {'data':(2)4}",
     ((0, 2, 4, 6), (1, 3, 5, 7), (8, 10, 12, 14), (9, 11, 13, 15))),
])
def test_replica_groups_in_every_form_xla_prints(text, groups):
  line = f"%ag = f32[8]{{0}} all-gather(%p), channel_id=1, {text}, dims"
  assert replica_groups(line) == groups


def test_unreadable_sub_axes_give_no_groups():
  line = ("%ag = f32[8]{0} all-gather(%p), replica_groups=mesh['data'=8] "
          "{'data':(3)2}, dims")
  assert replica_groups(line) is None


def test_collectives_name_the_mesh_axes_they_run_along():
  import zero_jax as zj
  mesh = zj.make_mesh(model=2)  # (data 4, model 2)
  hlo = ("%a = f32[8]{0} all-gather(%p), replica_groups={{0,2,4,6},"
         "{1,3,5,7}}, dimensions={0}\n"
         "%b = f32[8]{0} all-reduce(%p), replica_groups=[4,2]<=[8]\n"
         "%c = f32[8]{0} all-reduce(%p), replica_groups={{0,1,2,3,4,5,6,7}}"
         "\n%d = f32[8]{0} all-reduce(%p), replica_groups={{0,3},{1,2}}")
  axes = [op.axes(mesh) for op in analysis.collectives(hlo)]
  assert axes == [("data",), ("model",), ("data", "model"), None]
