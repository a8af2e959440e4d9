//! Run-time compilation of the kernels with NVRTC, with a disk cache of CUBINs.
//!
//! The kernel sources (`src/kernels`) are embedded in the binary. A module is compiled from a
//! root source that includes the others, handed to NVRTC as in-memory headers named by their
//! path under `src/kernels` ([`KERNEL_HEADERS`]). What a module holds and how it is compiled is
//! its [`ModuleKind`]: the attention kernels of one (dtype, head dim) with their parameters as
//! `-D` defines, or the auxiliary kernels of one dtype. Each is compiled for the architecture of
//! the GPU found (`sm_90a` on Hopper) by [`compile_module`]; every module's source ends with
//! assertions that the kernels' parameter structs have the host's layouts (`src/params.rs`).
//! CUBINs are cached on disk under `DISTATTN_CACHE_DIR` (default `~/.cache/distattn`), keyed by a
//! hash of (sources, options, arch, NVRTC version), so a second run starts without compiling.

use crate::params;
use distattn_core::{DType, Error, Result};
use std::ffi::{c_char, CString};
use std::path::{Path, PathBuf};

/// The root of the attention kernels' module: the portable kernels (`mma.sync`, sm_80+)
/// followed by the Hopper ones (`wgmma`, compiled only for sm_90a).
const FLASH_ROOT: &str = include_str!("kernels/flash.cu");
/// The root of the auxiliary kernels' module (row delta, conversion, piece copies and adds, LSE
/// merge, random fill).
const AUX_ROOT: &str = include_str!("kernels/aux.cu");

/// Every file a root may include, by the name it is included as.
pub const KERNEL_HEADERS: &[(&str, &str)] = &[
    ("common.cuh", include_str!("kernels/common.cuh")),
    ("params.cuh", include_str!("kernels/params.cuh")),
    ("sm80/forward.cu", include_str!("kernels/sm80/forward.cu")),
    ("sm80/backward.cu", include_str!("kernels/sm80/backward.cu")),
    ("sm90/primitives.cuh", include_str!("kernels/sm90/primitives.cuh")),
    ("sm90/forward.cu", include_str!("kernels/sm90/forward.cu")),
    ("sm90/forward_e4m3.cu", include_str!("kernels/sm90/forward_e4m3.cu")),
    ("sm90/backward_loads.cuh", include_str!("kernels/sm90/backward_loads.cuh")),
    ("sm90/backward.cu", include_str!("kernels/sm90/backward.cu")),
    ("sm90/backward_wide.cu", include_str!("kernels/sm90/backward_wide.cu")),
    ("decode.cu", include_str!("kernels/decode.cu")),
];

pub(crate) fn backend_err(reason: impl Into<String>) -> Error {
    Error::Backend { backend: "cuda", reason: reason.into() }
}

/// Keys per block of the FP8 forward's transposed V: a block of `transpose_v_e4m3` and a TMA box
/// of the forward's V^T tiles (which are whole blocks).
pub const E4M3_VT_KEYS: usize = 64;

/// A block shape of the FP8 forward (`FwdE4m3` in `sm90/forward_e4m3.cu`): query rows (64 per
/// consumer warpgroup) x keys per tile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct E4m3Tiling {
    pub rows: usize,
    pub keys: usize,
}

impl E4m3Tiling {
    /// Three consumers over 64-key tiles (as many keys as their 160 registers a thread hold):
    /// the faster per block.
    pub const TALL: E4m3Tiling = E4m3Tiling { rows: 192, keys: 64 };
    /// Two consumers over 128-key tiles: more, smaller blocks for short grids.
    pub const SHORT: E4m3Tiling = E4m3Tiling { rows: 128, keys: 128 };
    /// The tiling for a forward of `blocks_of(rows)` blocks on `sms` multiprocessors: SHORT
    /// on a short grid of TALL blocks ([`short_grid`]; H100, 2026-11-27: 4k, 2.7 waves, SHORT
    /// 8-16% faster; 16k, 10 waves and more, TALL 3-7% faster).
    pub fn for_grid(sms: usize, blocks_of: impl Fn(usize) -> usize) -> E4m3Tiling {
        if short_grid(sms, blocks_of(Self::TALL.rows)) {
            Self::SHORT
        } else {
            Self::TALL
        }
    }
    /// The tiling whose blocks have `rows` query rows (128 or 192), if any.
    pub fn of_rows(rows: usize) -> Option<E4m3Tiling> {
        [Self::TALL, Self::SHORT].into_iter().find(|t| t.rows == rows)
    }
    /// The kernel's name (`flash_fwd_e4m3_192x64`, `flash_fwd_e4m3_128x128`).
    pub fn kernel(&self) -> String {
        format!("flash_fwd_e4m3_{}x{}", self.rows, self.keys)
    }
    /// Threads per block: a producer warpgroup and the consumers.
    pub fn threads(&self) -> usize {
        128 * (1 + self.rows / 64)
    }
    /// Dynamic shared memory at head dim `d`, bytes: Q; K and V^T in 2 stages (one byte an
    /// element); 1 KB to align the base; 9 mbarriers.
    pub fn smem(&self, d: usize) -> usize {
        (self.rows + 4 * self.keys) * d + 1024 + 9 * 8
    }
}

/// Below this many waves of the FP8 forward's blocks in its tiling for long grids (one block an
/// SM), the last wave's idle SMs cost more than the slower blocks of its tiling for short grids
/// ([`E4m3Tiling`]: taller blocks, fewer of them, are the faster per block). (The bf16/f16
/// forward weighs its two tilings' waves instead: [`KernelConfig::fwd_for_grid`].)
pub const SHORT_GRID_WAVES: usize = 6;

/// Whether a forward grid of `blocks` blocks (of its long-grid tiling) on `sms` multiprocessors
/// makes fewer than [`SHORT_GRID_WAVES`] waves.
pub fn short_grid(sms: usize, blocks: usize) -> bool {
    blocks < SHORT_GRID_WAVES * sms
}

/// Head dimensions the kernels support, forward and backward.
pub const HEAD_DIMS: [usize; 5] = [64, 96, 128, 192, 256];

/// Compile-time parameters of one module (one dtype, one head dim).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KernelConfig {
    pub dtype: DType,
    pub head_dim: usize,
    pub fwd_warps: usize,
    /// 16-row MMA tiles per warp in the forward.
    pub fwd_mr: usize,
    pub fwd_bn: usize,
    pub bwd_warps: usize,
    pub bwd_bm: usize,
    /// Backward with every GEMM tiled over the 8 warps (`flash_bwd_dkdv2`; sm_90+, d 64/128).
    pub bwd_v2: bool,
    /// Backward on warpgroup MMAs, warp-specialized with TMA loads (`flash_bwd_ws`; sm_90a,
    /// every head dim: 128-key tiles up to d 128; above, 64-key tiles and dQ as a second job of
    /// the launch, `bwd_dq_by_query`).
    pub bwd_wg: bool,
    /// Stages of each item's Q and dO (with its LSE and delta rows) in the warpgroup backward
    /// up to d 128 (`flash_bwd_ws`).
    pub bwd_stages: usize,
    /// Forward on warpgroup MMAs, warp-specialized with TMA loads (`flash_fwd_ws`; sm_90a,
    /// every head dim): a producer warp and consumer warpgroups of 64 rows (`fwd_warps / 4`:
    /// 3 at d 64 and 96, else 2), 128-key tiles (96 at d 96, 192 at d 128, 96 at d 192, 80 at
    /// d 256).
    pub fwd_wg: bool,
    /// The warps and keys per tile of the warp-specialized forward's second tiling, for short
    /// grids (`flash_fwd_ws_short`, see [`KernelConfig::fwd_short`]), or 0 where it has none.
    pub fwd_short_warps: usize,
    pub fwd_short_bn: usize,
    /// That tiling's time per query row where quantization does not matter (long grids), in %
    /// of this one's: what [`KernelConfig::fwd_for_grid`] weighs the waves of each by.
    pub fwd_short_cost: usize,
    /// Whether each block of the warp-specialized forward prefetches into the L2 the Q tile of
    /// the block a wave later in the launch order (`FwdParams::prefetch`; `fwd_prefetch=0` in
    /// `DISTATTN_KCFG` turns it off).
    pub fwd_prefetch: bool,
    /// Warps of the decode kernel (`flash_decode`), 16 keys of each K/V tile each.
    pub dec_warps: usize,
    /// K/V tile stages of the decode kernel: as many as fit the arch's shared memory, 2 to 6.
    pub dec_stages: usize,
}

/// Tuning overrides from `DISTATTN_KCFG` ("key=value,..." with numeric values, e.g.
/// "fwd_warps=8,fwd_mr=1,bwd_bm=64" or "fwd_wg=0,bwd_wg=0"; `e4m3_rows=128` or `192` fixes the
/// FP8 forward's tiling, see `CudaBackend::set_e4m3_tiling`; `fwd_short=0` or `1` whether the
/// bf16/f16 forward takes its short-grid tiling, see `CudaBackend::set_fwd_short`, and
/// `fwd_short_warps` / `fwd_short_bn` set that tiling, 0 for none, and `fwd_short_cost` its cost
/// per row); malformed entries are ignored.
pub(crate) fn kcfg_overrides() -> std::collections::HashMap<String, usize> {
    std::env::var("DISTATTN_KCFG")
        .unwrap_or_default()
        .split(',')
        .filter_map(|kv| {
            let (k, v) = kv.split_once('=')?;
            Some((k.trim().to_string(), v.trim().parse().ok()?))
        })
        .collect()
}

impl KernelConfig {
    /// The tuned configuration for a dtype and head dim.
    pub fn new(dtype: DType, head_dim: usize) -> Result<Self> {
        if !matches!(dtype, DType::BF16 | DType::F16) {
            return Err(unsupported_dtype(dtype));
        }
        let (fwd_warps, fwd_mr, fwd_bn) = match head_dim {
            64 | 128 => (4, 2, 64),
            96 => (4, 2, 32),
            192 | 256 => (4, 1, 32),
            _ => {
                return Err(Error::UnsupportedHeadDim {
                    head_dim,
                    backend: "cuda",
                    supported: "64, 96, 128, 192, 256".into(),
                })
            }
        };
        // 64 query rows where the head dim splits into parts of 48 columns per dQ warp
        // (flash_bwd_dkdv's DQ_DC), else 32.
        let bwd_bm = if matches!(head_dim, 96 | 192) { 64 } else { 32 };
        let mut c = KernelConfig {
            dtype,
            head_dim,
            fwd_warps,
            fwd_mr,
            fwd_bn,
            // Above d 128, 4 warps (64 keys) fit the backward's K, V, Q and dO tiles into sm_80's
            // shared memory; for_arch takes 8 where there is more.
            bwd_warps: if head_dim > 128 { 4 } else { 8 },
            bwd_bm,
            bwd_v2: false,
            bwd_wg: false,
            bwd_stages: 2,
            fwd_wg: false,
            fwd_short_warps: 0,
            fwd_short_bn: 0,
            fwd_short_cost: 100,
            fwd_prefetch: false,
            dec_warps: if head_dim > 128 { 4 } else { 8 },
            dec_stages: 2,
        };
        c.dec_stages = c.decode_stages_within(160 * 1024);
        let o = kcfg_overrides();
        for (key, field) in [
            ("fwd_warps", &mut c.fwd_warps),
            ("fwd_mr", &mut c.fwd_mr),
            ("fwd_bn", &mut c.fwd_bn),
            ("bwd_warps", &mut c.bwd_warps),
            ("bwd_bm", &mut c.bwd_bm),
            ("dec_warps", &mut c.dec_warps),
            ("bwd_stages", &mut c.bwd_stages),
        ] {
            if let Some(&v) = o.get(key) {
                *field = v;
            }
        }
        c.bwd_v2 = o.get("bwd_v2").is_some_and(|&v| v != 0);
        Ok(c)
    }

    /// The configuration for an NVRTC target: the v2 backward on sm_90 and newer (it needs
    /// 173 KB of shared memory at d 128), unless `DISTATTN_KCFG` says `bwd_v2=0`, and 8-warp
    /// blocks above d 128; on sm_90a the warpgroup-MMA kernels (forward and backward at every
    /// head dim), unless it says `bwd_wg=0` / `fwd_wg=0`.
    pub fn for_arch(mut self, arch: &str) -> Self {
        let major: u32 = arch
            .trim_start_matches("sm_")
            .chars()
            .take_while(|c| c.is_ascii_digit())
            .collect::<String>()
            .parse()
            .unwrap_or(0);
        let o = kcfg_overrides();
        let off = |key: &str| o.get(key) == Some(&0);
        if major >= 90 && matches!(self.head_dim, 64 | 128) && !off("bwd_v2") {
            self.bwd_v2 = true;
            self.bwd_bm = 64;
            self.bwd_warps = 8;
        }
        if major >= 90 && self.head_dim > 128 {
            // Room for 8-warp blocks: 128 keys backward; the mma.sync forward (where the
            // warpgroup one below does not run) 128 query rows x 64 keys (on an H100, 16 heads x
            // 16k causal: d 192 -16 %, d 256 -4 % against 4 warps x 32 keys).
            for (key, field, v) in [
                ("fwd_warps", &mut self.fwd_warps, 8),
                ("fwd_bn", &mut self.fwd_bn, 64),
                ("bwd_warps", &mut self.bwd_warps, 8),
            ] {
                if !o.contains_key(key) {
                    *field = v;
                }
            }
        }
        self.dec_stages = self.decode_stages_within(match major {
            90.. => 220 * 1024,
            80 => 160 * 1024,
            _ => 96 * 1024,
        });
        if let Some(&n) = o.get("dec_stages") {
            self.dec_stages = n;
        }
        let hopper = arch == "sm_90a";
        // (`bwd_v2=0` keeps the mma.sync v1 backward, as it does off Hopper.)
        self.bwd_wg = hopper && !off("bwd_v2") && !off("bwd_wg");
        if self.bwd_wg {
            // Its tile plan: 128 keys (64 above d 128, bwd_bn) x 64 query rows (128 at d 64,
            // where 64-row items left too little tensor-core work between the consumers'
            // waits); 8 consumer warps. Two stages of Q and dO: at d 128, 3 were 0.4-4% slower
            // and 4 do not fit; at d 64 with 128-row items 3 do not fit.
            self.bwd_bm = if self.head_dim == 64 { 128 } else { 64 };
            self.bwd_warps = 8;
        }
        if hopper && !off("fwd_wg") {
            self.fwd_wg = true;
            // At d 64 and 96 a third consumer warpgroup: two leave the tensor cores idle
            // through their softmax (a d 64 profile: tensor pipe 45%, MUFU 48%, no eligible
            // warp in 59% of cycles; d 96 on an H100 at 16k, 5.0-6.7% faster).
            if !o.contains_key("fwd_warps") {
                self.fwd_warps = if matches!(self.head_dim, 64 | 96) { 12 } else { 8 };
            }
            self.fwd_mr = 1;
            // From d 128, as many keys as two stages of K and V fit beside Q in the shared
            // memory (227 KB), in whole 16-key steps (192 against 128 keys, 16k: d 128 2.5%
            // faster without a mask, 1.5% causal). Three consumers' registers (160 a thread)
            // take no more than 128 keys at d 64 and 96 at d 96.
            if !o.contains_key("fwd_bn") {
                self.fwd_bn = match self.head_dim {
                    96 | 192 => 96,
                    128 => 192,
                    256 => 80,
                    _ => 128,
                };
            }
            // Where three consumers' blocks of 192 rows leave the last wave's SMs idle, a second
            // tiling (H100, kernel time, against the long-grid tiling on long grids):
            // - d 96: two consumers over 192 keys (128-row blocks; 4k and 8k with 16 heads 3-7%
            //   faster, 16k 3.6-5.9% slower);
            // - d 64: four over 64 keys (256-row blocks, 112 registers a consumer thread, which
            //   hold no more keys; 4k-8k full masks 5-13.5% faster, 16k 4-7% slower).
            let (warps, bn, cost) = match self.head_dim {
                64 => (16, 64, 108),
                96 => (8, 192, 105),
                _ => (0, 0, 100),
            };
            self.fwd_short_warps = o.get("fwd_short_warps").copied().unwrap_or(warps);
            self.fwd_short_bn = o.get("fwd_short_bn").copied().unwrap_or(bn);
            self.fwd_short_cost = o.get("fwd_short_cost").copied().unwrap_or(cost);
            self.fwd_prefetch = !off("fwd_prefetch");
        }
        self
    }

    /// The warp-specialized forward's tiling for short grids (`flash_fwd_ws_short`), as a
    /// configuration whose `fwd_warps` and `fwd_bn` are that tiling's, where the module has one
    /// (d 64 and 96 on sm_90a). A launch takes it where [`KernelConfig::fwd_for_grid`] says;
    /// both compute the same result.
    pub fn fwd_short(&self) -> Option<KernelConfig> {
        (self.fwd_wg && self.fwd_short_warps > 0 && self.fwd_short_bn > 0).then_some(KernelConfig {
            fwd_warps: self.fwd_short_warps,
            fwd_bn: self.fwd_short_bn,
            fwd_short_warps: 0,
            fwd_short_bn: 0,
            fwd_short_cost: 100,
            ..*self
        })
    }

    /// The configuration a forward of `q_len` query rows for each of `pairs` (batch entry,
    /// query head) runs on `sms` multiprocessors: its tiling for short grids where it has one
    /// and that takes less time by the waves each makes (a wave's time: its block's rows times
    /// the tiling's cost per row, `fwd_short_cost`), or as `fixed` says (`Some(true)`: the
    /// short tiling wherever there is one), else this one. (The last wave of a grid takes as
    /// long as a full one, so the tiling with the taller blocks can win where it fills its
    /// waves better, as d 64's does at 4k and 8k.)
    pub fn fwd_for_grid(&self, sms: usize, q_len: usize, pairs: usize, fixed: Option<bool>) -> KernelConfig {
        let Some(short) = self.fwd_short() else { return *self };
        let waves_time =
            |c: &KernelConfig, cost: usize| (q_len.div_ceil(c.fwd_bm()) * pairs).div_ceil(sms) * c.fwd_bm() * cost;
        if fixed.unwrap_or_else(|| waves_time(&short, self.fwd_short_cost) < waves_time(self, 100)) {
            short
        } else {
            *self
        }
    }

    /// Name of the forward kernel of this configuration.
    pub fn fwd_kernel(&self) -> &'static str {
        if self.fwd_wg {
            "flash_fwd_ws"
        } else {
            "flash_fwd"
        }
    }

    /// Name of the dK/dV kernel of this configuration.
    pub fn dkdv_kernel(&self) -> &'static str {
        if self.bwd_wg {
            "flash_bwd_ws"
        } else if self.bwd_v2 {
            "flash_bwd_dkdv2"
        } else {
            "flash_bwd_dkdv"
        }
    }

    /// Whether the backward's launch computes dQ as a second job, by query tile, after the
    /// dK/dV blocks (the warpgroup backward above d 128, `sm90/backward_wide.cu`).
    pub fn bwd_dq_by_query(&self) -> bool {
        self.bwd_wg && self.head_dim > 128
    }
    /// Query rows x keys of the dQ job's tiles.
    pub fn dq_tile(&self) -> (usize, usize) {
        (128, 32)
    }

    /// Threads per block of the forward kernel (the warp-specialized one adds a producer
    /// warpgroup).
    pub fn fwd_threads(&self) -> usize {
        32 * self.fwd_warps + if self.fwd_wg { 128 } else { 0 }
    }
    pub fn fwd_bm(&self) -> usize {
        16 * self.fwd_mr * self.fwd_warps
    }
    /// Threads per block of the dK/dV kernel (the warp-specialized one adds a producer
    /// warpgroup).
    pub fn bwd_threads(&self) -> usize {
        32 * self.bwd_warps + if self.bwd_wg { 128 } else { 0 }
    }
    /// Keys per tile of the dK/dV kernel: a warp's 16 (mma.sync), or the warp-specialized
    /// kernel's 128 (64 above d 128, where its consumers split the columns instead).
    pub fn bwd_bn(&self) -> usize {
        if self.bwd_wg && self.head_dim > 128 {
            64
        } else {
            16 * self.bwd_warps
        }
    }
    /// Blocks per key tile of the dK/dV kernel: above d 128, flash_bwd_dkdv splits dK and dV
    /// (which a warp holds in registers) into column halves, one block each.
    pub fn bwd_parts(&self) -> usize {
        if self.head_dim > 128 && !self.bwd_wg {
            2
        } else {
            1
        }
    }
    fn lds(&self) -> usize {
        self.head_dim + 8
    }
    /// Dynamic shared memory of the forward kernel, bytes.
    pub fn fwd_smem(&self) -> usize {
        if self.fwd_wg {
            // Q; K and V in 2 stages (tiles of whole 64-column blocks: d 96 pads to 128); 1 KB
            // to align the base; 9 mbarriers.
            return (self.fwd_bm() + 4 * self.fwd_bn) * self.head_dim.next_multiple_of(64) * 2 + 1024 + 128;
        }
        (self.fwd_bm() + 4 * self.fwd_bn) * self.lds() * 2 + 4 * self.fwd_mr * 32 * self.fwd_warps * 4
    }
    /// Whether the module has the FP8 forward (`flash_fwd_e4m3_*`, with `transpose_v_e4m3`): the
    /// warp-specialized forward's pipeline at head dim 128, whose rows are one 128-byte
    /// swizzled block in 8 bits.
    pub fn has_e4m3_forward(&self) -> bool {
        self.fwd_wg && self.head_dim == 128
    }
    /// Dynamic shared memory of the dK/dV kernel (with a dQ job, of either job's block), bytes.
    pub fn bwd_smem(&self) -> usize {
        if self.bwd_dq_by_query() {
            // dK/dV: 64 rows of K, V and of Q, dO in 2 stages (256 columns); P and dS twice; LSE
            // and delta in 2 stages. dQ: Q and dO of a query tile, K and V in 3 stages; the
            // tile's LSE and delta. Either: 1 KB to align the base, at most 7 mbarriers.
            let (qm, qn) = self.dq_tile();
            let dkdv = (6 * 64 * 256 + 4 * 64 * 64) * 2 + 4 * 64 * 4;
            let dq = (2 * qm + 3 * 2 * qn) * 256 * 2 + 2 * qm * 4;
            return dkdv.max(dq) + 1024 + 128;
        }
        if self.bwd_wg {
            // K, V; Q, dO in stages (tiles of whole 64-column blocks); dS^T twice; dQ (f32) of
            // both consumers; LSE and delta in stages; 1 KB to align the base; the mbarriers (K/V,
            // 2 per stage, 2 per consumer).
            let (d, s, bm) = (self.head_dim.next_multiple_of(64), self.bwd_stages, self.bwd_bm);
            return (2 * 128 * d + 2 * s * bm * d + 2 * 128 * bm) * 2
                + 2 * 64 * 64 * 4
                + 2 * s * bm * 4
                + 1024
                + 8 * (5 + 2 * s);
        }
        // dS^T (v1); P^T and dS^T, double-buffered (v2)
        let staged = if self.bwd_v2 { 4 } else { 1 };
        (2 * self.bwd_bn() + 4 * self.bwd_bm) * self.lds() * 2
            + staged * self.bwd_bn() * (self.bwd_bm + 8) * 2
            + 4 * self.bwd_bm * 4
    }
    /// Keys per K/V tile of the decode kernel.
    pub fn decode_bn(&self) -> usize {
        16 * self.dec_warps
    }
    /// Threads per block of the decode kernel.
    pub fn decode_threads(&self) -> usize {
        32 * self.dec_warps
    }
    /// Bytes of one decode stage (a K and a V tile) and of the decode's query block.
    fn decode_stage_bytes(&self) -> (usize, usize) {
        (2 * self.decode_bn() * self.lds() * 2, 16 * self.lds() * 2)
    }
    fn decode_stages_within(&self, budget: usize) -> usize {
        let (stage, q) = self.decode_stage_bytes();
        (budget.saturating_sub(q) / stage).clamp(2, 6)
    }
    /// Dynamic shared memory of the decode kernel, bytes.
    pub fn decode_smem(&self) -> usize {
        let (stage, q) = self.decode_stage_bytes();
        q + self.dec_stages * stage
    }
    /// The most blocks a decode launch may have: a merge keeps a weight per (piece, row) and a
    /// slot per piece beside the warps' states in the stages' memory, and a segment has at most
    /// one piece per block.
    pub fn decode_max_blocks(&self) -> usize {
        let (stage, _) = self.decode_stage_bytes();
        let states = self.dec_warps * 16 * self.head_dim * 4 + 2 * self.dec_warps * 16 * 4;
        ((self.dec_stages * stage - states) / (16 * 4 + 4)).saturating_sub(1).min(1024)
    }
    /// The `-D` options of this variant.
    pub fn defines(&self) -> Vec<String> {
        vec![
            dtype_define(self.dtype),
            format!("-DHEAD_DIM={}", self.head_dim),
            format!("-DFWD_WARPS={}", self.fwd_warps),
            format!("-DFWD_MR={}", self.fwd_mr),
            format!("-DFWD_BN={}", self.fwd_bn),
            format!("-DFWD_SHORT_WARPS={}", self.fwd_short().map_or(0, |c| c.fwd_warps)),
            format!("-DFWD_SHORT_BN={}", self.fwd_short().map_or(0, |c| c.fwd_bn)),
            format!("-DBWD_WARPS={}", self.bwd_warps),
            format!("-DBWD_BM={}", self.bwd_bm),
            format!("-DBWD_V2={}", self.bwd_v2 as u8),
            format!("-DBWD_WG={}", self.bwd_wg as u8),
            format!("-DBWD_STAGES={}", self.bwd_stages),
            format!("-DFWD_WG={}", self.fwd_wg as u8),
            format!("-DDEC_WARPS={}", self.dec_warps),
            format!("-DDEC_STAGES={}", self.dec_stages),
        ]
    }
    /// Every variant the library may compile.
    pub fn all() -> Vec<KernelConfig> {
        let mut v = Vec::new();
        for dt in [DType::BF16, DType::F16] {
            for d in HEAD_DIMS {
                v.push(KernelConfig::new(dt, d).expect("listed head dims are supported"));
            }
        }
        v
    }
}

/// Whether the NVRTC shared library can be loaded.
pub fn nvrtc_available() -> bool {
    // SAFETY: only opens libnvrtc by the names cudarc knows, to see whether it loads, and drops
    // the handle; opening it runs its initialisers, as the first NVRTC call would.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// NVRTC's (major, minor) version.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    if !nvrtc_available() {
        return Err(no_nvrtc());
    }
    let (mut a, mut b) = (0, 0);
    // SAFETY: NVRTC loads (checked above) and writes two ints into the locals `a` and `b`.
    let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut a, &mut b) };
    if r != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(backend_err(format!("nvrtcVersion failed: {r:?}")));
    }
    Ok((a, b))
}

fn no_nvrtc() -> Error {
    backend_err(
        "NVRTC not found: libnvrtc.so (CUDA 13) could not be loaded; install the CUDA toolkit or the \
         `nvidia-cuda-nvrtc` wheel and put its lib directory on LD_LIBRARY_PATH",
    )
}

/// The NVRTC target for a compute capability: `sm_90a` on Hopper (wgmma/setmaxnreg available),
/// `sm_XY` elsewhere.
pub fn arch_for(cc: (i32, i32)) -> String {
    match cc {
        (9, 0) => "sm_90a".into(),
        (10, 0) => "sm_100a".into(),
        (a, b) => format!("sm_{a}{b}"),
    }
}

/// Include directories of a CUDA 13 toolkit (`include` and `include/cccl`), searched in
/// `DISTATTN_CUDA_INCLUDE` (colon-separated), `CUDA_HOME`, `CUDA_PATH`, the `include` beside each
/// `LD_LIBRARY_PATH` entry (pip wheels: `nvidia/cu13/{lib,include}`), `/usr/local/cuda` and
/// `/opt/cuda`. The kernels themselves need no header; the directories are passed to NVRTC
/// when found, and a compile failure reports what was missing.
pub fn find_cuda_includes() -> Result<Vec<PathBuf>> {
    let mut bases: Vec<PathBuf> = Vec::new();
    if let Ok(v) = std::env::var("DISTATTN_CUDA_INCLUDE") {
        bases.extend(v.split(':').filter(|s| !s.is_empty()).map(PathBuf::from));
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Ok(v) = std::env::var(var) {
            bases.push(Path::new(&v).join("include"));
        }
    }
    if let Ok(v) = std::env::var("LD_LIBRARY_PATH") {
        for d in v.split(':').filter(|s| !s.is_empty()) {
            if let Some(parent) = Path::new(d).parent() {
                bases.push(parent.join("include"));
            }
        }
    }
    bases.push("/usr/local/cuda/include".into());
    bases.push("/opt/cuda/include".into());
    let mut looked = Vec::new();
    let mut found: Option<PathBuf> = None;
    let mut found_cccl: Option<PathBuf> = None;
    for b in &bases {
        looked.push(b.display().to_string());
        if found.is_none() && b.join("cuda_fp16.h").is_file() {
            found = Some(b.clone());
        }
        if found_cccl.is_none() {
            for c in [b.join("cccl"), b.clone()] {
                if c.join("nv").join("target").is_file() {
                    found_cccl = Some(c);
                    break;
                }
            }
        }
    }
    match (found, found_cccl) {
        (Some(inc), Some(cccl)) => {
            let mut v = vec![inc];
            if !v.contains(&cccl) {
                v.push(cccl);
            }
            Ok(v)
        }
        (inc, cccl) => {
            let mut missing = Vec::new();
            if inc.is_none() {
                missing.push("CUDA headers (cuda_fp16.h: toolkit `include` or the nvidia-cuda-runtime wheel)");
            }
            if cccl.is_none() {
                missing.push("CCCL headers (nv/target: toolkit `include/cccl` or the nvidia-cuda-cccl wheel)");
            }
            Err(backend_err(format!(
                "missing {}; looked in: {}; set CUDA_HOME or DISTATTN_CUDA_INCLUDE",
                missing.join(" and "),
                looked.join(", ")
            )))
        }
    }
}

/// A compiled module and NVRTC's log (which holds ptxas' resource report when asked for).
#[derive(Debug, Clone)]
pub struct Compiled {
    pub cubin: Vec<u8>,
    pub log: String,
    pub from_cache: bool,
}

/// FNV-1a 64 over `parts`, each followed by a separator byte (stable across runs and builds:
/// the disk cache's keys).
pub fn fnv64(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for p in parts {
        for &b in *p {
            h ^= b as u64;
            h = h.wrapping_mul(0x100000001b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}

/// Cache directory: `DISTATTN_CACHE_DIR`, else `~/.cache/distattn`.
pub fn cache_dir() -> Option<PathBuf> {
    if let Ok(d) = std::env::var("DISTATTN_CACHE_DIR") {
        return Some(PathBuf::from(d));
    }
    std::env::var("HOME").ok().map(|h| Path::new(&h).join(".cache").join("distattn"))
}

/// The `-D` option selecting the kernels' element type (`elem_t`): bf16 or f16.
fn dtype_define(dtype: DType) -> String {
    format!("-DDA_BF16={}", (dtype == DType::BF16) as u8)
}

/// The dtype error of the CUDA backend, for types other than bf16 and f16.
fn unsupported_dtype(dtype: DType) -> Error {
    Error::UnsupportedDType(format!("{dtype} (the CUDA backend takes bf16 and f16)"))
}

/// What a module holds, and so which root, defines and options it is compiled with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ModuleKind {
    /// The attention kernels of one configuration (`kernels/flash.cu`).
    Flash(KernelConfig),
    /// The auxiliary kernels of one element type, bf16 or f16 (`kernels/aux.cu`).
    Aux(DType),
}

impl ModuleKind {
    /// The name (as NVRTC reports it) and text of the module's root source.
    pub fn root(&self) -> (&'static str, &'static str) {
        match self {
            ModuleKind::Flash(_) => ("flash.cu", FLASH_ROOT),
            ModuleKind::Aux(_) => ("aux.cu", AUX_ROOT),
        }
    }

    /// The source NVRTC compiles: the root, then the assertions that the parameter structs it
    /// declares have the host's layouts.
    pub fn source(&self) -> String {
        format!("{}{}", self.root().1, params::layout_asserts(&params::layouts()))
    }

    /// The element type of the module's kernels.
    pub fn dtype(&self) -> DType {
        match self {
            ModuleKind::Flash(cfg) => cfg.dtype,
            ModuleKind::Aux(dtype) => *dtype,
        }
    }

    /// The name of the module in cache files and messages (`flash-bf16-d128`, `aux-f16`).
    pub fn label(&self) -> String {
        match self {
            ModuleKind::Flash(cfg) => format!("flash-{}-d{}", cfg.dtype, cfg.head_dim),
            ModuleKind::Aux(dtype) => format!("aux-{dtype}"),
        }
    }

    /// Options passed to NVRTC for this module and `arch`. The attention kernels are compiled
    /// with fast math; the auxiliary ones are not (the merge's exp and log stay accurate).
    pub fn options(&self, arch: &str, includes: &[PathBuf], verbose: bool) -> Vec<String> {
        let mut o = vec![format!("--gpu-architecture={arch}"), "-std=c++17".into()];
        match self {
            ModuleKind::Flash(cfg) => {
                o.push("--use_fast_math".into());
                o.extend(cfg.defines());
            }
            ModuleKind::Aux(dtype) => {
                o.push(dtype_define(*dtype));
                o.push(format!("-DDELTA_GROUPS={}", crate::aux::DELTA_GROUPS));
            }
        }
        for i in includes {
            o.push(format!("--include-path={}", i.display()));
        }
        if verbose {
            o.push("--ptxas-options=-v".into());
        }
        // Extra defines for experiments (part of the cache key through the options).
        if let Ok(extra) = std::env::var("DISTATTN_EXTRA_DEFINES") {
            o.extend(extra.split_whitespace().map(String::from));
        }
        o
    }
}

/// Compiles one module to a CUBIN for `arch`, using the disk cache unless `verbose` (a
/// verbose compile always runs NVRTC, to get the ptxas report).
pub fn compile_module(kind: &ModuleKind, arch: &str, verbose: bool) -> Result<Compiled> {
    if !matches!(kind.dtype(), DType::BF16 | DType::F16) {
        return Err(unsupported_dtype(kind.dtype()));
    }
    let includes = find_cuda_includes();
    let inc = includes.as_ref().map(|v| v.as_slice()).unwrap_or(&[]);
    let opts = kind.options(arch, inc, verbose);
    let ver = nvrtc_version()?;
    let (name, _) = kind.root();
    let src = kind.source();
    // The include paths are not part of the key: the kernels include no system header.
    let key_opts = kind.options(arch, &[], false).join(" ");
    let mut key_parts: Vec<&[u8]> = vec![src.as_bytes()];
    for (header, text) in KERNEL_HEADERS {
        key_parts.extend([header.as_bytes(), text.as_bytes()]);
    }
    let ver = format!("{ver:?}");
    key_parts.extend([key_opts.as_bytes(), ver.as_bytes()]);
    let key = fnv64(&key_parts);
    let cache_file = cache_dir().map(|d| d.join(format!("{}-{arch}-{key:016x}.cubin", kind.label())));
    if !verbose {
        if let Some(f) = &cache_file {
            if let Ok(bytes) = std::fs::read(f) {
                if !bytes.is_empty() {
                    return Ok(Compiled { cubin: bytes, log: String::new(), from_cache: true });
                }
            }
        }
    }
    let out = nvrtc_compile(&src, name, KERNEL_HEADERS, &opts).map_err(|e| match &includes {
        Err(inc_err) => backend_err(format!("{e}; note: {inc_err}")),
        Ok(_) => e,
    })?;
    if let Some(f) = &cache_file {
        // A cache that cannot be written only costs a recompile next time.
        if let Some(dir) = f.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let tmp = f.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, &out.cubin).is_ok() {
            let _ = std::fs::rename(&tmp, f);
        }
    }
    Ok(out)
}

/// Runs NVRTC on `src`, whose `#include "name"`s resolve to `headers` (name, text), and returns
/// the CUBIN (options must name a real `sm_` architecture).
pub fn nvrtc_compile(src: &str, name: &str, headers: &[(&str, &str)], opts: &[String]) -> Result<Compiled> {
    use cudarc::nvrtc::{result, sys};
    if !nvrtc_available() {
        return Err(no_nvrtc());
    }
    let c_src = CString::new(src).map_err(|_| backend_err("kernel source contains a NUL byte"))?;
    let c_name = CString::new(name).map_err(|_| backend_err("bad program name"))?;
    let c_headers = headers
        .iter()
        .map(|(n, text)| Ok((CString::new(*n)?, CString::new(*text)?)))
        .collect::<std::result::Result<Vec<_>, std::ffi::NulError>>()
        .map_err(|_| backend_err("kernel header contains a NUL byte"))?;
    let header_texts: Vec<*const c_char> = c_headers.iter().map(|(_, t)| t.as_ptr()).collect();
    let header_names: Vec<*const c_char> = c_headers.iter().map(|(n, _)| n.as_ptr()).collect();
    let n_headers = i32::try_from(headers.len()).map_err(|_| backend_err("too many kernel headers"))?;
    let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: every pointer refers to a NUL-terminated string owned by this frame (`c_src`,
    // `c_name`, `c_headers`), and the two header arrays hold `n_headers` entries each; NVRTC
    // copies what it keeps.
    let r = unsafe {
        sys::nvrtcCreateProgram(
            &mut prog,
            c_src.as_ptr(),
            c_name.as_ptr(),
            n_headers,
            header_texts.as_ptr(),
            header_names.as_ptr(),
        )
    };
    if r != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(backend_err(format!("nvrtcCreateProgram: {r:?}")));
    }
    // SAFETY: `prog` was created above (success checked) and is destroyed only at the end of
    // this function; `opts` are Rust strings that cudarc turns into C strings for the call.
    let res = unsafe { result::compile_program(prog, opts) };
    // SAFETY: `prog` is live as above; NVRTC has a log after a compile, failed or not, and
    // cudarc sizes its buffer with nvrtcGetProgramLogSize first.
    let log = unsafe { result::get_program_log(prog) }
        .map(|v| {
            let bytes: Vec<u8> = v.iter().map(|&c| c as u8).take_while(|&c| c != 0).collect();
            String::from_utf8_lossy(&bytes).into_owned()
        })
        .unwrap_or_default();
    let out = match res {
        Err(e) => Err(backend_err(format!("NVRTC compile of {name} failed ({e:?}) with {}:\n{log}", opts.join(" ")))),
        Ok(()) => {
            let mut size = 0usize;
            // SAFETY: `prog` is live and compiled; NVRTC writes one usize into the local `size`.
            let r = unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) };
            if r != sys::nvrtcResult::NVRTC_SUCCESS || size == 0 {
                Err(backend_err(format!("nvrtcGetCUBINSize failed ({r:?}); options must name an sm_ architecture")))
            } else {
                let mut buf = vec![0u8; size];
                // SAFETY: `prog` is live and compiled, and `buf` holds the `size` bytes NVRTC just
                // reported for its CUBIN, all that nvrtcGetCUBIN writes.
                let r = unsafe { sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut _) };
                if r != sys::nvrtcResult::NVRTC_SUCCESS {
                    Err(backend_err(format!("nvrtcGetCUBIN failed ({r:?})")))
                } else {
                    Ok(Compiled { cubin: buf, log, from_cache: false })
                }
            }
        }
    };
    // SAFETY: `prog` is live and not used after this, its only destroy (every path since its
    // creation reaches here once).
    let _ = unsafe { result::destroy_program(prog) };
    out
}

/// Resource usage of one kernel from ptxas' verbose report.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct KernelResources {
    pub name: String,
    pub registers: u32,
    pub spill_stores: u32,
    pub spill_loads: u32,
    pub stack_frame: u32,
    pub smem_static: u32,
}

/// Parses ptxas `-v` output ("Compiling entry function 'X'", "N bytes stack frame, N bytes
/// spill stores, N bytes spill loads", "Used N registers").
pub fn parse_ptxas(log: &str) -> Vec<KernelResources> {
    let mut out: Vec<KernelResources> = Vec::new();
    let num_before = |line: &str, word: &str| -> Option<u32> {
        let idx = line.find(word)?;
        line[..idx].split_whitespace().last()?.parse().ok()
    };
    for line in log.lines() {
        if let Some(i) = line.find("Compiling entry function '") {
            let rest = &line[i + "Compiling entry function '".len()..];
            let name = rest.split('\'').next().unwrap_or("").to_string();
            out.push(KernelResources { name, ..Default::default() });
        } else if let Some(k) = out.last_mut() {
            if line.contains("stack frame") {
                k.stack_frame = num_before(line, "bytes stack frame").unwrap_or(0);
                k.spill_stores = num_before(line, "bytes spill stores").unwrap_or(0);
                k.spill_loads = num_before(line, "bytes spill loads").unwrap_or(0);
            }
            if line.contains("Used") && line.contains("registers") {
                k.registers = num_before(line, "registers").unwrap_or(0);
                k.smem_static = num_before(line, "bytes smem").unwrap_or(0);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configs_and_smem_fit_sm80() {
        for c in KernelConfig::all() {
            assert!(c.fwd_smem() <= 163 * 1024, "{c:?} fwd smem {}", c.fwd_smem());
            assert!(c.bwd_smem() <= 163 * 1024, "{c:?} bwd smem {}", c.bwd_smem());
            let h = c.for_arch("sm_90a");
            assert!(h.fwd_smem() <= 227 * 1024, "{h:?} fwd smem {}", h.fwd_smem());
            assert!(h.bwd_smem() <= 227 * 1024, "{h:?} bwd smem {}", h.bwd_smem());
            assert_eq!(h.bwd_dq_by_query(), c.head_dim > 128);
            assert_eq!(c.fwd_bn % 32, 0);
            // A tiling for short grids at d 64 and 96 on Hopper only, itself without one.
            assert_eq!(h.fwd_short().is_some(), matches!(c.head_dim, 64 | 96), "{h:?}");
            assert!(c.for_arch("sm_80").fwd_short().is_none());
            if let Some(s) = h.fwd_short() {
                assert!(s.fwd_smem() <= 227 * 1024, "{s:?} fwd smem {}", s.fwd_smem());
                assert_eq!(s.fwd_short(), None);
                assert_ne!(s.fwd_bm(), h.fwd_bm());
                assert!(h.fwd_short_cost > 100, "{h:?}: the long grids' tiling is the faster per row");
                assert!(h.defines().contains(&format!("-DFWD_SHORT_WARPS={}", s.fwd_warps)));
            } else {
                assert!(h.defines().contains(&"-DFWD_SHORT_WARPS=0".to_string()));
            }
        }
        assert!(!short_grid(132, 6 * 132) && short_grid(132, 6 * 132 - 1));
        assert!(matches!(KernelConfig::new(DType::BF16, 80), Err(Error::UnsupportedHeadDim { .. })));
        assert!(matches!(KernelConfig::new(DType::F32, 64), Err(Error::UnsupportedDType(_))));
    }

    #[test]
    fn forward_tiling_follows_the_grid_size() {
        let sms = 132;
        let hopper = |d| KernelConfig::new(DType::BF16, d).unwrap().for_arch("sm_90a");
        let (d64, d96) = (hopper(64), hopper(96));
        let (s64, s96) = (d64.fwd_short().expect("d 64 has one"), d96.fwd_short().expect("d 96 has one"));
        assert_eq!((d96.fwd_bm(), d96.fwd_bn, s96.fwd_bm(), s96.fwd_bn), (192, 96, 128, 192));
        assert_eq!((d64.fwd_bm(), d64.fwd_bn, s64.fwd_bm(), s64.fwd_bn), (192, 128, 256, 64));
        // What H100 runs measured: 4k with 16 and 32 heads and 8k with 16 take the short tilings
        // (d 96: 352 blocks of 192 rows, 3 waves, against 512 of 128, 4; d 64 against 256 blocks
        // of 256 rows, 2 waves), 8k with 32 heads and 16k do not.
        for (n, heads, is_short) in
            [(4096, 16, true), (4096, 32, true), (8192, 16, true), (8192, 32, false), (16384, 16, false)]
        {
            for (long, short) in [(d64, s64), (d96, s96)] {
                let want = if is_short { short } else { long };
                assert_eq!(long.fwd_for_grid(sms, n, heads, None), want, "d {} {n} x {heads}", long.head_dim);
            }
        }
        // Taller blocks fill fewer waves here: 2400 rows of 16 heads make 208 blocks of 192 rows
        // (2 waves) and 160 of 256 (2 waves too, of longer blocks).
        assert_eq!(d64.fwd_for_grid(sms, 2400, 16, None), d64);
        assert_eq!(d96.fwd_for_grid(sms, 16384, 16, Some(true)), s96);
        assert_eq!(d96.fwd_for_grid(sms, 4096, 16, Some(false)), d96);
        // Without a short tiling (d 128; d 96 off Hopper) the configuration is its own.
        let d128 = hopper(128);
        assert_eq!(d128.fwd_for_grid(sms, 1, 1, Some(true)), d128);
        let d96_80 = KernelConfig::new(DType::BF16, 96).unwrap().for_arch("sm_80");
        assert_eq!(d96_80.fwd_for_grid(sms, 1, 1, None), d96_80);
    }

    #[test]
    fn e4m3_tiling_follows_the_grid_size() {
        let sms = 132;
        // 16 heads: 4k is 22 TALL blocks a head (352, under 6 waves), 16k 86 (1376).
        let grid = |n: usize| move |rows: usize| n.div_ceil(rows) * 16;
        assert_eq!(E4m3Tiling::for_grid(sms, grid(4096)), E4m3Tiling::SHORT);
        assert_eq!(E4m3Tiling::for_grid(sms, grid(16384)), E4m3Tiling::TALL);
        // At the threshold: 6 waves of TALL blocks take TALL, one block fewer SHORT.
        let exactly = |b: usize| move |_: usize| b;
        assert_eq!(E4m3Tiling::for_grid(sms, exactly(6 * sms)), E4m3Tiling::TALL);
        assert_eq!(E4m3Tiling::for_grid(sms, exactly(6 * sms - 1)), E4m3Tiling::SHORT);
        assert_eq!(E4m3Tiling::of_rows(128), Some(E4m3Tiling::SHORT));
        assert_eq!(E4m3Tiling::of_rows(192), Some(E4m3Tiling::TALL));
        assert_eq!(E4m3Tiling::of_rows(64), None);
        for t in [E4m3Tiling::TALL, E4m3Tiling::SHORT] {
            assert!(t.smem(128) <= 227 * 1024, "{t:?}");
            assert_eq!(t.threads(), 128 * (1 + t.rows / 64));
        }
        assert_eq!(E4m3Tiling::TALL.kernel(), "flash_fwd_e4m3_192x64");
        assert_eq!(E4m3Tiling::SHORT.kernel(), "flash_fwd_e4m3_128x128");
    }

    #[test]
    fn ptxas_report_parses() {
        let log = "ptxas info    : Compiling entry function 'flash_fwd' for 'sm_90a'\n\
                   ptxas info    : Function properties for flash_fwd\n\
                   ptxas         .     8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n\
                   ptxas info    : Used 255 registers, used 1 barriers, 400 bytes cmem[0]\n";
        let r = parse_ptxas(log);
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].name, "flash_fwd");
        assert_eq!(r[0].registers, 255);
        assert_eq!(r[0].spill_stores, 4);
        assert_eq!(r[0].stack_frame, 8);
    }

    #[test]
    fn arch_names() {
        assert_eq!(arch_for((9, 0)), "sm_90a");
        assert_eq!(arch_for((8, 0)), "sm_80");
        assert_eq!(arch_for((8, 9)), "sm_89");
    }
}
