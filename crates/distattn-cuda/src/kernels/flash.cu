// distattn CUDA kernels: flash attention forward and backward (dK/dV + dQ accumulation), the
// FP8 forward (sm_90a, d 128), and decode over a paged KV cache (decode.cu: the step's split
// plan and the cache appends are in aux.cu). The backward's row delta and dQ conversion and the LSE merge of partial results are in the
// auxiliary kernels' module (aux.cu).
//
// Compiled at run time by NVRTC, one module per (dtype, head dim, arch), from this root and the
// files it includes (NVRTC in-memory headers, named by their path under src/kernels). The host
// passes the compile-time parameters as defines:
//   DA_BF16 (1 for bf16, 0 for f16), HEAD_DIM, FWD_WARPS, FWD_MR, FWD_BN, FWD_SHORT_WARPS,
//   FWD_SHORT_BN, BWD_WARPS, BWD_BM, BWD_V2, BWD_WG, FWD_WG, DEC_STAGES.
// The portable kernels (`mma.sync`, sm_80+) come first, then the Hopper ones (`wgmma`, compiled
// only for sm_90a).
#include "common.cuh"
#include "params.cuh"
#include "sm80/forward.cu"
#include "sm80/backward.cu"
#include "sm90/backward.cu"
#include "sm90/backward_wide.cu"
#include "sm90/forward.cu"
#include "sm90/forward_e4m3.cu"
#include "decode.cu"
