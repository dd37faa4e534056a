"""What a compiled program says about itself (loopjax/compiled.py): the
collectives of an HLO text counted by hand, and XLA's stderr captured
without holding back what the terminal would have shown."""

import os
import tempfile
import time

from loopjax import compiled

# An HLO module's collectives as XLA:TPU and XLA:GPU print them: async
# all-gather and collective-permute starts return (operand, output[,
# contexts]), the async wrapper of a reduce-scatter or all-to-all
# ((operands), output), all-reduce-start its output; a done repeats its
# start; a layout may nest commas and parentheses ({1,0:T(8,128)}).
HLO = """
  %ag-start = (f32[8,128]{1,0}, f32[64,128]{1,0}) all-gather-start(f32[8,128]{1,0} %p0), dimensions={0}
  %ag-done = f32[64,128]{1,0} all-gather-done((f32[8,128]{1,0}, f32[64,128]{1,0}) %ag-start)
  %ag2-start = ((f32[8]{0}, bf16[4]{0}), (f32[64]{0}, bf16[32]{0})) all-gather-start(f32[8]{0} %p1, bf16[4]{0} %p2)
  %ag3-start = (f32[8,128]{1,0:T(8,128)}, f32[32,128]{1,0:T(8,128)}) all-gather-start(f32[8,128]{1,0:T(8,128)} %p3)
  %cp-start = (bf16[4,16]{1,0}, bf16[4,16]{1,0}, u32[], u32[]) collective-permute-start(bf16[4,16]{1,0} %p4), source_target_pairs={{0,1},{1,0}}
  %cp-done = bf16[4,16]{1,0} collective-permute-done((bf16[4,16]{1,0}, bf16[4,16]{1,0}, u32[], u32[]) %cp-start)
  %ar = f32[1024]{0} all-reduce(f32[1024]{0} %p5), to_apply=%add
  %ar2 = (f32[], f32[]) all-reduce(f32[] %p6, f32[] %p7), to_apply=%add
  %ar-start = f32[256]{0} all-reduce-start(f32[256]{0} %p8), to_apply=%add
  %ar-done = f32[256]{0} all-reduce-done(f32[256]{0} %ar-start)
  %rs = f32[16]{0} reduce-scatter(f32[128]{0} %p9), dimensions={0}, to_apply=%add
  %rs-start = ((f32[128]{0}), f32[16]{0}) reduce-scatter-start(f32[128]{0} %p10), calls=%rs.1
  %rs-done = f32[16]{0} reduce-scatter-done(((f32[128]{0}), f32[16]{0}) %rs-start)
  %a2a-start = ((bf16[8,4]{1,0}), bf16[8,4]{1,0}) all-to-all-start(bf16[8,4]{1,0} %p11), calls=%a2a.1
  %gte = f32[] get-tuple-element((f32[], f32[]) %ar2), index=0
"""  # noqa: E501


def test_collectives_count_each_outputs_bytes_once():
  """Counted by hand: the all-gathers' outputs 64x128 f32, 64 f32 + 32
  bf16, 32x128 f32; the permute's 4x16 bf16 (not its operand and contexts
  too, which doubled it); the all-reduces' 1024, 2 and 256 f32; the
  reduce-scatters' 16 f32 each (not the 128 the async one reads); the
  all-to-all's 8x4 bf16."""
  assert compiled.collectives(HLO) == {
    "all-gather": {
      "count": 3,
      "bytes": 64 * 128 * 4 + (64 * 4 + 32 * 2) + 32 * 128 * 4,
    },
    "collective-permute": {"count": 1, "bytes": 4 * 16 * 2},
    "all-reduce": {"count": 3, "bytes": (1024 + 2 + 256) * 4},
    "reduce-scatter": {"count": 2, "bytes": 2 * 16 * 4},
    "all-to-all": {"count": 1, "bytes": 8 * 4 * 2},
  }


def test_xla_stderr_is_passed_on_as_it_comes_and_the_descriptor_restored():
  """What native code writes to descriptor 2 inside the block reaches the
  real stderr while the block runs (a compile takes minutes on a target,
  and a crash inside it would lose what was held back), is recorded for
  the caller, and the descriptor is the real stderr again after."""
  with tempfile.TemporaryFile() as terminal:
    real = os.dup(2)
    os.dup2(terminal.fileno(), 2)
    try:
      with compiled.logged() as lines:
        os.write(2, f"W0 spmd_partitioner.cc:656] [SPMD] {compiled.REMAT}.\n".encode())
        deadline = time.monotonic() + 10
        while os.fstat(terminal.fileno()).st_size == 0 and time.monotonic() < deadline:
          time.sleep(0.01)
        seen = os.pread(terminal.fileno(), 4096, 0).decode()
      os.write(2, b"after\n")
    finally:
      os.dup2(real, 2)
      os.close(real)
    shown = os.pread(terminal.fileno(), 4096, 0).decode()
  assert compiled.REMAT in seen  # before the block ended
  assert [x for x in lines if compiled.REMAT in x]
  assert shown.count(compiled.REMAT) == 1 and shown.endswith("after\n")


def test_xla_stderr_kept_back_is_still_recorded():
  with compiled.logged(echo=False) as lines:
    os.write(2, b'no field named "x"\n')
  assert lines == ['no field named "x"']
