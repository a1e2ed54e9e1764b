"""benchmarks/triton_static.py up to the Triton compiler (which is not a dependency):
the GPU kernels' IR comes out of the CUDA lowering as plain MLIR with its launch
options, for every arm of the device sweep."""
import re

from benchmarks import attention, triton_static


def test_kernel_ir_is_plain_mlir_with_the_launch_options():
  kernels = triton_static.kernel_ir(dict(num_warps_bwd=8, num_stages_bwd=3, dq_atomic=True),
                                    shape=(1, 256, 4, 64))
  by_name = {k["kernel"]: k for k in kernels}
  assert sorted(by_name) == ["flash_attention_dkv", "flash_attention_fwd"]  # no dq kernel
  assert (by_name["flash_attention_dkv"]["num_warps"],
          by_name["flash_attention_dkv"]["num_stages"]) == (8, 3)
  assert (by_name["flash_attention_fwd"]["num_warps"],
          by_name["flash_attention_fwd"]["num_stages"]) == (4, 3)  # head_dim 64: 4 warps
  for k in kernels:
    ir = k["ir"]
    assert ir.startswith(f"module @{k['kernel']} {{") and ir.rstrip().endswith("}")
    assert "#loc" not in ir and "[unknown]" not in ir
    assert ir.count("tt.func public") == 1
  assert "tt.atomic_rmw" in by_name["flash_attention_dkv"]["ir"]


def test_clean_ir_drops_locations_only():
  printed = ('module @k {\n  %0 = arith.constant 1 : i32 [unknown]\n'
             '  %1 = arith.addi %0, %0 : i32 "add:"(#loc3)\n}\n#loc3 = loc("x.py":1:2)\n')
  assert triton_static.clean_ir(printed) == (
      "module @k {\n  %0 = arith.constant 1 : i32\n  %1 = arith.addi %0, %0 : i32\n}\n")


def test_arms_are_the_default_and_the_device_sweep():
  arms = triton_static.arms("default,sweep")
  assert arms[0] == ("default", {})
  assert [options for _, options in arms[1:]] == list(attention.GPU_BWD_SWEEP)
  assert all(re.fullmatch(r"[\w=,]+", name) for name, _ in arms)
