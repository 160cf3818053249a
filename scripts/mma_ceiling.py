"""The ceiling of mma.sync.m16n8k16 (bf16 in, fp32 accumulate) on this GPU: the rate the tensor-core kernels'
instruction can reach at all, to compare their measured mma rate with (docs/kernels.md, banded tensor-core kernels).

Each warp runs a long loop of independent mma.sync on register operands (no memory traffic), with CHAINS
independent accumulators per warp, for several warps per SM; the best rate over the configurations is the ceiling.
Usage on a GPU machine: python scripts/mma_ceiling.py
"""
from __future__ import annotations

import torch
from torch.utils.cpp_extension import load_inline

from lkcnn import timing

SOURCE = r"""
#include <torch/extension.h>
#include <cstdint>

template <int CHAINS>
__global__ void mma_loop(float* out, int iters) {
  float acc[CHAINS][4] = {};
  uint32_t a0 = threadIdx.x, a1 = a0 * 3u, a2 = a0 * 5u, a3 = a0 * 7u, b0 = a0 * 11u, b1 = a0 * 13u;
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int c = 0; c < CHAINS; ++c)
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                   "{%8, %9}, {%0, %1, %2, %3};\n"
                   : "+f"(acc[c][0]), "+f"(acc[c][1]), "+f"(acc[c][2]), "+f"(acc[c][3])
                   : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
  float s = 0.f;
#pragma unroll
  for (int c = 0; c < CHAINS; ++c) s += acc[c][0] + acc[c][1] + acc[c][2] + acc[c][3];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

void run(torch::Tensor out, int64_t blocks, int64_t threads, int64_t chains, int64_t iters) {
  float* p = out.data_ptr<float>();
  switch (chains) {
    case 1: mma_loop<1><<<blocks, threads>>>(p, int(iters)); break;
    case 2: mma_loop<2><<<blocks, threads>>>(p, int(iters)); break;
    case 4: mma_loop<4><<<blocks, threads>>>(p, int(iters)); break;
    default: mma_loop<8><<<blocks, threads>>>(p, int(iters)); break;
  }
}
"""


def main() -> None:
    ext = load_inline("lkcnn_mma_ceiling", cpp_sources="void run(torch::Tensor out, int64_t blocks, int64_t threads, "
                      "int64_t chains, int64_t iters);", cuda_sources=SOURCE, functions=["run"],
                      extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90"])
    props = torch.cuda.get_device_properties(0)
    sms, iters = props.multi_processor_count, 4096
    print(f"{props.name}: mma.sync.m16n8k16 bf16 -> fp32, independent chains per warp x warps per SM")
    print("chains  warps/SM  mma per SM per ns  TFLOP/s")
    for chains in (1, 2, 4, 8):
        for warps in (4, 8, 16, 24, 32):
            blocks, threads = sms * warps // 4, 128
            out = torch.empty(blocks * threads, device="cuda")
            ext.run(out, blocks, threads, chains, 64)  # warm-up
            seconds = timing.mean_ms(lambda: ext.run(out, blocks, threads, chains, iters), reps=1) / 1e3
            mmas = blocks * threads // 32 * chains * iters
            tflops = mmas * 2 * 16 * 8 * 16 / seconds / 1e12
            print(f"{chains:6d}  {warps:8d}  {mmas / seconds / sms / 1e9:17.3f}  {tflops:7.1f}")


if __name__ == "__main__":
    main()
