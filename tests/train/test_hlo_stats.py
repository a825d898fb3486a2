"""hlo_stats on a hand-written compiled-HLO module: loop trip counts multiply, async wrappers count once."""

import pytest

from k2jax.train import hlo_stats

HLO = """HloModule jit_step, is_scheduled=true

%async_computation (p0: f32[12,16], p1: f32[40,16], p2: s32[4], p3: s32[4], p4: s32[4], p5: s32[4]) -> f32[40,16] {
  %p0 = f32[12,16]{1,0} parameter(0)
  %p1 = f32[40,16]{1,0} parameter(1)
  %p2 = s32[4]{0} parameter(2)
  %p3 = s32[4]{0} parameter(3)
  %p4 = s32[4]{0} parameter(4)
  %p5 = s32[4]{0} parameter(5)
  ROOT %ragged-all-to-all.1 = f32[40,16]{1,0} ragged-all-to-all(%p0, %p1, %p2, %p3, %p4, %p5), replica_groups={{0,1,2,3}}
}

%body (param.1: (s32[], bf16[8,32], bf16[32,64])) -> (s32[], bf16[8,32], bf16[32,64]) {
  %param.1 = (s32[], bf16[8,32]{1,0}, bf16[32,64]{1,0}) parameter(0)
  %gte.0 = s32[] get-tuple-element(%param.1), index=0
  %gte.1 = bf16[8,32]{1,0} get-tuple-element(%param.1), index=1
  %gte.2 = bf16[32,64]{1,0} get-tuple-element(%param.1), index=2
  %all-gather-start.1 = (bf16[8,32]{1,0}, bf16[32,32]{1,0}) all-gather-start(%gte.1), dimensions={0}
  %all-gather-done.1 = bf16[32,32]{1,0} all-gather-done(%all-gather-start.1)
  %dot.1 = bf16[32,64]{1,0} dot(%all-gather-done.1, %gte.2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %kernel.1 = bf16[32,64]{1,0} custom-call(%dot.1), custom_call_target="tpu_custom_call", backend_config={"custom_call_config":{"body":"x","cost_estimate":{"bytes_accessed":"8192","flops":"5000","transcendentals":"0"}}}
  %all-reduce.1 = bf16[32,64]{1,0} all-reduce(%dot.1), replica_groups={{0,1,2,3}}, to_apply=%add
  %constant.1 = s32[] constant(1)
  %add.1 = s32[] add(%gte.0, %constant.1)
  ROOT %tuple.1 = (s32[], bf16[8,32]{1,0}, bf16[32,64]{1,0}) tuple(%add.1, %gte.1, %all-reduce.1)
}

%cond (param.2: (s32[], bf16[8,32], bf16[32,64])) -> pred[] {
  %param.2 = (s32[], bf16[8,32]{1,0}, bf16[32,64]{1,0}) parameter(0)
  %gte.3 = s32[] get-tuple-element(%param.2), index=0
  %constant.2 = s32[] constant(7)
  ROOT %lt.1 = pred[] compare(%gte.3, %constant.2), direction=LT
}

%add (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %sum = bf16[] add(%a, %b)
}

ENTRY %main (Arg_0: bf16[8,32], Arg_1: bf16[32,64], Arg_2: f32[12,16], Arg_3: s32[4]) -> f32[40,16] {
  %Arg_0 = bf16[8,32]{1,0} parameter(0)
  %Arg_1 = bf16[32,64]{1,0} parameter(1)
  %Arg_2 = f32[12,16]{1,0} parameter(2)
  %Arg_3 = s32[4]{0} parameter(3)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[8,32]{1,0}, bf16[32,64]{1,0}) tuple(%zero, %Arg_0, %Arg_1)
  %while.1 = (s32[], bf16[8,32]{1,0}, bf16[32,64]{1,0}) while(%init), condition=%cond, body=%body
  %buf = f32[40,16]{1,0} broadcast(%zero), dimensions={}
  %async-start.1 = ((f32[12,16]{1,0}, f32[40,16]{1,0}, s32[4]{0}, s32[4]{0}, s32[4]{0}, s32[4]{0}), f32[40,16]{1,0}) async-start(%Arg_2, %buf, %Arg_3, %Arg_3, %Arg_3, %Arg_3), calls=%async_computation
  ROOT %async-done.1 = f32[40,16]{1,0} async-done(%async-start.1), calls=%async_computation
}
"""


def test_collective_bytes_and_flops_count_each_execution():
  s = hlo_stats.hlo_stats(HLO)
  assert s["unknown_trip_counts"] == 0
  # 7 iterations: all-gather result 32x32 bf16 (the start's operand half excluded), all-reduce 32x64 bf16.
  assert s["all-gather_bytes"] == 7 * 32 * 32 * 2
  assert s["all-reduce_bytes"] == 7 * 32 * 64 * 2
  # The async pair names its computation twice; it runs once. min(operand 12 rows, buffer 40 rows).
  assert s["ragged-all-to-all_bytes"] == 12 * 16 * 4
  assert s["all-to-all_bytes"] == s["reduce-scatter_bytes"] == s["collective-permute_bytes"] == 0
  assert s["matmul_flops"] == 7 * 2 * 32 * 64 * 32
  assert s["custom_call_flops"] == 7 * 5000  # a Mosaic kernel's own cost estimate, per execution


def test_peeled_and_unrolled_loop_counts_its_real_trips():
  # XLA peels the first iteration (counter starts at 1) and unrolls by 2: ceil((7 - 1) / 2) = 3 trips.
  text = HLO.replace("%zero = s32[] constant(0)", "%zero = s32[] constant(1)")
  s = hlo_stats.hlo_stats(text.replace("%constant.1 = s32[] constant(1)", "%constant.1 = s32[] constant(2)"))
  assert s["unknown_trip_counts"] == 0 and s["all-reduce_bytes"] == 3 * 32 * 64 * 2


def test_unreadable_trip_count_counts_once_and_is_reported():
  s = hlo_stats.hlo_stats(HLO.replace("constant(7)", "parameter(1)"))
  assert s["unknown_trip_counts"] == 1 and s["all-reduce_bytes"] == 32 * 64 * 2
  with pytest.raises(ValueError, match="no ENTRY"):
    hlo_stats.hlo_stats("HloModule empty\n")


CONV = """HloModule jit_conv, is_scheduled=true

ENTRY %main (a: f32[8,16,1], w: f32[4,32,16], x: f32[8,16,10], v: f32[3,32,16], b: f32[8,16,4]) -> (f32[8,4,32], f32[8,8,32], f32[8,4,32]) {
  %a = f32[8,16,1]{2,1,0} parameter(0)
  %w = f32[4,32,16]{2,1,0} parameter(1)
  %x = f32[8,16,10]{2,1,0} parameter(2)
  %v = f32[3,32,16]{2,1,0} parameter(3)
  %convolution.1 = f32[8,4,32]{2,1,0} convolution(%a, %w), window={size=4 pad=3_3 rhs_reversal=1}, dim_labels=bf0_0oi->b0f
  %convolution.2 = f32[8,8,32]{2,1,0} convolution(%x, %v), window={size=3}, dim_labels=bf0_0oi->b0f
  %b = f32[8,16,4]{2,1,0} parameter(4)
  %convolution.3 = f32[8,4,32]{2,1,0} convolution(%b, %w), window={size=4 stride=3 lhs_dilate=4}, dim_labels=bf0_0oi->b0f
  ROOT %t = (f32[8,4,32]{2,1,0}, f32[8,8,32]{2,1,0}, f32[8,4,32]{2,1,0}) tuple(%convolution.1, %convolution.2, %convolution.3)
}
"""


def test_convolution_counts_only_taps_on_the_input():
  # .1: a batched dot XLA:TPU writes as a 4-tap window over a size-1 input padded by 3 on both sides: one
  # real tap per output position (counting all 4 overstated it 4x). .2: a plain valid convolution, 8 x 3 taps.
  # .3: the other form, a size-4 input dilated by 4 under a stride-3 window: again one real tap per output.
  s = hlo_stats.hlo_stats(CONV)
  assert s["matmul_flops"] == 2 * 8 * 32 * 16 * 4 + 2 * 8 * 32 * 16 * 8 * 3 + 2 * 8 * 32 * 16 * 4


DCN_HLO = """HloModule m

ENTRY %main (p0: f32[1024]) -> f32[1024] {
  %p0 = f32[1024]{0} parameter(0)
  %rs = f32[512]{0} reduce-scatter(%p0), replica_groups={{0,1},{2,3}}, dimensions={0}, to_apply=%add
  %ar = f32[512]{0} all-reduce(%rs), replica_groups=[2,2]<=[2,2]T(1,0), to_apply=%add
  %ag = f32[1024]{0} all-gather(%ar), replica_groups={{0,1},{2,3}}, dimensions={0}
  ROOT %cp = f32[1024]{0} collective-permute(%ag), source_target_pairs={{0,1},{1,0},{2,3},{3,2}}
}
"""


def test_dcn_bytes_count_the_collectives_whose_groups_span_slices():
  """Two slices of two devices: the hierarchical gradient reduction's middle step (groups {0,2}, {1,3}, the iota
  form) crosses slices; the in-slice reduce-scatter, all-gather and permute do not."""
  assert hlo_stats.device_groups("replica_groups=[2,2]<=[2,2]T(1,0)", 4) == [[0, 2], [1, 3]]
  assert hlo_stats.device_groups("replica_groups={}", 3) == [[0, 1, 2]]
  out = hlo_stats.hlo_stats(DCN_HLO, slice_of=[0, 0, 1, 1])
  assert out["dcn_bytes"] == out["dcn_all-reduce_bytes"] == 512 * 4
  assert out["all-reduce_bytes"] == 512 * 4 and out["reduce-scatter_bytes"] == 1024 * 4
  assert out["dcn_reduce-scatter_bytes"] == out["dcn_all-gather_bytes"] == out["dcn_collective-permute_bytes"] == 0
  # Slices {0, 2} and {1, 3}: now the reduce-scatter, all-gather and permute cross, the all-reduce does not.
  assert hlo_stats.hlo_stats(DCN_HLO, slice_of=[0, 1, 0, 1])["dcn_bytes"] == 3 * 1024 * 4
  assert "dcn_bytes" not in hlo_stats.hlo_stats(DCN_HLO)


MEGASCALE_HLO = """HloModule m

ENTRY %main (p0: f32[256]) -> f32[256] {
  %p0 = f32[256]{0} parameter(0)
  %after-all = token[] after-all()
  %send = (f32[256]{0}, u32[], token[]) send(%p0, %after-all), channel_id=4, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_megascale_reduce_operation="SUM",_xla_megascale_transfer_type="ALL_REDUCE"}
  %send-done = token[] send-done(%send), channel_id=4, is_host_transfer=true
  ROOT %r = f32[256]{0} copy(%p0)
}
"""


def test_dcn_bytes_count_the_megascale_sends_of_per_slice_programs():
  """XLA:TPU's multislice programs are per slice: the cross-slice reduction is a host-transfer send."""
  out = hlo_stats.hlo_stats(MEGASCALE_HLO, slice_of=[0, 0, 1, 1])
  assert out["dcn_bytes"] == out["dcn_megascale_all_reduce_bytes"] == 256 * 4
  assert "dcn_bytes" not in hlo_stats.hlo_stats(MEGASCALE_HLO)
