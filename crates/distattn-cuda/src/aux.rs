//! The auxiliary kernels (`kernels/aux.cu`), one module per element type: the backward's row
//! delta D = rowsum(dO ∘ O) (O in the element type or f32) and dQ conversion, piece copies and
//! adds, the LSE merge of partial results by token pieces, a deterministic random fill, and the
//! decode step's plan and KV cache append (launched by [`crate::decode`]).
//!
//! The launchers take raw device addresses and counts (the callers own the buffers: device
//! slices here, typed buffers of the multi-GPU executor), so they are `unsafe`: each says what
//! its addresses must hold.

use crate::compile::{self, backend_err, ModuleKind};
use crate::driver_err as drv;
use crate::params::{DeltaParams, MergeParams};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg};
use distattn_core::{AttnShape, DType, Error, Result};
use std::sync::Arc;

/// What the piece kernel does with each piece's rows (offsets, lengths and strides in the
/// units the op moves).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PieceOp {
    /// `dst[d..d+n] = src[s..s+n]` in units of `unit_bytes` bytes (2, 4, 8 or 16).
    Copy { unit_bytes: usize },
    /// `dst[d..d+n] += src[s..s+n]` into f32, from f32 or the module's element type.
    Add { src: DType },
    /// `dst[d..d+n] = src[s..s+n]` from f32 to the module's element type, in units of two values.
    Narrow,
    /// `dst[d..d+n] = src[s..s+n]` from the module's element type to f32, in units of two values.
    Widen,
}

/// A list of pieces on the device: `len` `(src, dst, len, rows, src stride, dst stride)` i64
/// sextuples at `ptr`, the largest piece `max_units` units (it sizes the grid; every piece is
/// moved whole).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PieceList {
    pub ptr: u64,
    pub len: usize,
    pub max_units: usize,
}

/// The device addresses of an (O, LSE) pair, both f32: O `[b, tokens, heads, head_dim]`, LSE
/// `[b, heads, tokens]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OLse {
    pub o: u64,
    pub lse: u64,
}

/// The compact spec of a merge of a partial (O, LSE) into accumulators, whose `n_pieces`
/// `(src token, dst token, len, start)` quads are on the device: rows `(b, h, t)` for `b <
/// batch`, `h < heads`, `t < total` (the pieces' tokens in order, `start` the running sum of the
/// lengths); source head `hs0 + h` of `hs` and token of `ns`, accumulator head `hd0 + h` of `hd`
/// and token of `nd`; rows of `head_dim` values. O is `[b, tokens, heads, head_dim]` and LSE
/// `[b, heads, tokens]`, both f32, on each side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MergeDims {
    pub batch: usize,
    pub heads: usize,
    pub hs: usize,
    pub hd: usize,
    pub hs0: usize,
    pub hd0: usize,
    pub ns: usize,
    pub nd: usize,
    pub head_dim: usize,
    pub n_pieces: usize,
    pub total: usize,
}

/// The auxiliary kernels of one element type, loaded in one context.
pub struct AuxKernels {
    dtype: DType,
    _module: Arc<CudaModule>,
    delta_o_elem: CudaFunction,
    delta_o_f32: CudaFunction,
    convert_f32: CudaFunction,
    copy_u16: CudaFunction,
    copy_u32: CudaFunction,
    copy_u64: CudaFunction,
    copy_u128: CudaFunction,
    narrow_f32: CudaFunction,
    widen_elem: CudaFunction,
    add_f32: CudaFunction,
    add_elem: CudaFunction,
    merge_pieces: CudaFunction,
    rand_fill: CudaFunction,
    pub(crate) decode_plan: CudaFunction,
    pub(crate) append_kv: CudaFunction,
}

/// Row groups each warp of the row delta takes, every load issued before the first product
/// (`DELTA_GROUPS` in aux.cu, defined from this).
pub(crate) const DELTA_GROUPS: usize = 4;

/// Lanes of the row delta's warps that read one row of `head_dim` values, 8 each: head_dim / 8
/// rounded up to a power of two; the kernel takes multiples of 8 up to 256.
fn delta_lanes(head_dim: usize) -> Result<usize> {
    if head_dim == 0 || !head_dim.is_multiple_of(8) || head_dim > 256 {
        return Err(backend_err(format!(
            "the row delta reads rows of 8-value chunks, up to 256 values; head dim {head_dim} is not one"
        )));
    }
    Ok((head_dim / 8).next_power_of_two())
}

/// Blocks of 256 threads, `per_block` items each, over `items`; `None` for no items (a grid of
/// no blocks is a launch error: a rank holding no rows of a step has nothing to launch).
fn blocks_of_256(items: usize, per_block: usize) -> Option<LaunchConfig> {
    (items > 0).then(|| LaunchConfig {
        grid_dim: (items.div_ceil(per_block) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    })
}

impl AuxKernels {
    /// Compiles (or loads from the disk cache) and loads the kernels of `dtype` (bf16 or f16) for
    /// the GPU of `ctx`.
    pub fn load(ctx: &Arc<CudaContext>, dtype: DType) -> Result<AuxKernels> {
        let cc = ctx.compute_capability().map_err(drv("compute capability"))?;
        let compiled = compile::compile_module(&ModuleKind::Aux(dtype), &compile::arch_for(cc), false)?;
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(compiled.cubin))
            .map_err(drv("loading the auxiliary kernels"))?;
        let f = |name: &str| module.load_function(name).map_err(drv("loading an auxiliary kernel"));
        Ok(AuxKernels {
            dtype,
            delta_o_elem: f("delta_o_elem")?,
            delta_o_f32: f("delta_o_f32")?,
            convert_f32: f("convert_f32")?,
            copy_u16: f("copy_u16")?,
            copy_u32: f("copy_u32")?,
            copy_u64: f("copy_u64")?,
            copy_u128: f("copy_u128")?,
            narrow_f32: f("narrow_f32")?,
            widen_elem: f("widen_elem")?,
            add_f32: f("add_f32")?,
            add_elem: f("add_elem")?,
            merge_pieces: f("merge_pieces")?,
            rand_fill: f("rand_fill")?,
            decode_plan: f("decode_plan")?,
            append_kv: f("append_kv")?,
            _module: module,
        })
    }

    /// The element type of the kernels.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    fn check_elem(&self, what: &str, dtype: DType) -> Result<()> {
        if dtype == self.dtype {
            return Ok(());
        }
        Err(Error::DTypeMismatch {
            a: what.into(),
            a_dtype: dtype.to_string(),
            b: "auxiliary kernels".into(),
            b_dtype: self.dtype.to_string(),
        })
    }

    /// Row delta `delta = rowsum(dO ∘ O)` (`[b, h, nq]`, f32) of O and dO (`[b, nq, h, d]`), O
    /// of `o_dtype` (f32 or the module's type) and dO of the module's type. The kernel reads
    /// rows in 16-byte chunks of 8 values, so a head dim that is not a multiple of 8, or above
    /// 256, is an error.
    ///
    /// # Safety
    /// `o`, `dout` and `delta` are addresses, in the context of `s`, of buffers holding that
    /// many elements of those types (O and dO 16-byte aligned), not written by another stream
    /// while the kernel runs.
    pub unsafe fn row_delta(
        &self,
        s: &CudaStream,
        o: u64,
        o_dtype: DType,
        dout: u64,
        delta: u64,
        shape: &AttnShape,
    ) -> Result<()> {
        let f = if o_dtype == DType::F32 {
            &self.delta_o_f32
        } else {
            self.check_elem("row delta's O", o_dtype)?;
            &self.delta_o_elem
        };
        let lanes = delta_lanes(shape.head_dim)?;
        let rows = shape.batch * shape.q_len * shape.heads;
        let p = DeltaParams {
            o,
            dout,
            delta,
            rows: rows as i64,
            head_dim: shape.head_dim as i32,
            q_len: shape.q_len as i32,
            heads: shape.heads as i32,
            lanes: lanes as i32,
        };
        // 8 warps a block, each DELTA_GROUPS groups of 32 / lanes rows.
        let Some(cfg) = blocks_of_256(rows, 8 * DELTA_GROUPS * (32 / lanes)) else { return Ok(()) };
        // SAFETY: the kernels take one DeltaParams by value (its layout is asserted against
        // params.cuh at every compile); `lanes` lanes read one row of head_dim values (a
        // multiple of 8 up to 256: checked by delta_lanes) of O and dO in 16-byte loads, the
        // rows 16-byte aligned (as the buffers are, under this function's contract), and one
        // writes its f32 of delta, rows < `rows` only (the grid covers them).
        unsafe { s.launch_builder(f).arg(&p).launch(cfg) }.map_err(drv("launching the row delta"))?;
        Ok(())
    }

    /// Converts `n` (even) f32 values at `src` to the module's type at `dst`.
    ///
    /// # Safety
    /// `src` and `dst` are addresses, in the context of `s`, of buffers of at least `n` values of
    /// those types (8- and 4-byte aligned).
    pub unsafe fn convert_f32(&self, s: &CudaStream, src: u64, dst: u64, n: usize) -> Result<()> {
        if !n.is_multiple_of(2) {
            return Err(backend_err(format!("convert_f32 converts pairs; {n} values given")));
        }
        let n2 = (n / 2) as i64;
        let Some(cfg) = blocks_of_256(n / 2, 256) else { return Ok(()) };
        // SAFETY: the arguments are the kernel's (src, dst, number of pairs): u64 addresses for
        // its two pointers and an i64; thread i < n / 2 reads f32 pair i of `src` and writes pair
        // i of `dst`, within the caller's n values (n even, checked above; alignment and sizes
        // under this function's contract).
        unsafe { s.launch_builder(&self.convert_f32).arg(&src).arg(&dst).arg(&n2).launch(cfg) }
            .map_err(drv("launching convert_f32"))?;
        Ok(())
    }

    /// Copies or adds the pieces of `list` (`op`) from `src` to `dst`.
    ///
    /// # Safety
    /// `list.ptr` holds `6 list.len` i64 in the context of `s`, in `op`'s units; `src` and `dst`
    /// are addresses there of buffers of `op`'s types (an add's destination is f32), aligned to
    /// its unit and covering every piece.
    pub unsafe fn pieces(&self, s: &CudaStream, op: PieceOp, src: u64, dst: u64, list: PieceList) -> Result<()> {
        let PieceList { ptr: pieces, len: n_pieces, max_units } = list;
        let f = match op {
            PieceOp::Copy { unit_bytes: 2 } => &self.copy_u16,
            PieceOp::Copy { unit_bytes: 4 } => &self.copy_u32,
            PieceOp::Copy { unit_bytes: 8 } => &self.copy_u64,
            PieceOp::Copy { unit_bytes: 16 } => &self.copy_u128,
            PieceOp::Copy { unit_bytes } => {
                return Err(backend_err(format!("piece copies move 2-, 4-, 8- or 16-byte units, not {unit_bytes}")))
            }
            PieceOp::Narrow => &self.narrow_f32,
            PieceOp::Widen => &self.widen_elem,
            PieceOp::Add { src: DType::F32 } => &self.add_f32,
            PieceOp::Add { src } => {
                self.check_elem("piece source", src)?;
                &self.add_elem
            }
        };
        if n_pieces == 0 || max_units == 0 {
            return Ok(());
        }
        let y = max_units.div_ceil(256 * 4).clamp(1, 65535) as u32;
        let mut left = n_pieces;
        let mut first = 0usize;
        while left > 0 {
            let n = left.min(i32::MAX as usize);
            let first_piece = pieces + (first * 6 * 8) as u64;
            let cfg = LaunchConfig { grid_dim: (n as u32, y, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: the arguments are the kernels' (src, dst, pieces), three u64 addresses; block
            // x < n reads sextuple first + x of the list, within its n_pieces (first + n ≤
            // n_pieces), and moves that piece, inside src and dst under this function's contract.
            unsafe { s.launch_builder(f).arg(&src).arg(&dst).arg(&first_piece).launch(cfg) }
                .map_err(drv("launching a piece copy"))?;
            left -= n;
            first += n;
        }
        Ok(())
    }

    /// Merges a partial `part` into the accumulators `acc` by a compact spec whose quads are on
    /// the device at `quads`. A row whose partial LSE is −inf is left as it is; an accumulator
    /// row at −inf takes the partial's values.
    ///
    /// # Safety
    /// All four buffers are f32 in the context of `s`, covering the rows `dims` describes;
    /// `quads` holds `4 dims.n_pieces` i64 there.
    pub unsafe fn merge(&self, s: &CudaStream, part: OLse, acc: OLse, dims: &MergeDims, quads: u64) -> Result<()> {
        let rows = dims.batch * dims.heads * dims.total;
        if rows == 0 {
            return Ok(());
        }
        let a = MergeParams {
            o: part.o,
            lse: part.lse,
            oacc: acc.o,
            lacc: acc.lse,
            tp: quads,
            total: dims.total as i64,
            ns: dims.ns as i64,
            nd: dims.nd as i64,
            n_pieces: dims.n_pieces as i32,
            batch: dims.batch as i32,
            nh: dims.heads as i32,
            hs: dims.hs as i32,
            hd: dims.hd as i32,
            hs0: dims.hs0 as i32,
            hd0: dims.hd0 as i32,
            d: dims.head_dim as i32,
        };
        let Some(cfg) = blocks_of_256(rows, 8) else { return Ok(()) };
        // SAFETY: the kernel takes one MergeParams by value (its layout is asserted against
        // params.cuh at every compile); one warp per row of the `rows` that `dims` describes
        // (rows beyond them return), each inside the four buffers and reading the quads under
        // this function's contract.
        unsafe { s.launch_builder(&self.merge_pieces).arg(&a).launch(cfg) }.map_err(drv("launching merge_pieces"))?;
        Ok(())
    }

    /// Fills `n` values of the module's type at `dst` with deterministic uniform values in
    /// [-a, a) (the same for the same seed).
    ///
    /// # Safety
    /// `dst` is the address, in the context of `s`, of a buffer of at least `n` such values.
    pub unsafe fn rand_fill(&self, s: &CudaStream, dst: u64, n: usize, seed: u64, a: f32) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let n = n as i64;
        let cfg = LaunchConfig { grid_dim: (1024, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: the arguments are the kernel's (dst, n, seed, a): a u64 address, an i64, a u64
        // and an f32; the grid-stride loop writes indices below n only, inside the caller's
        // buffer of n values under this function's contract.
        unsafe { s.launch_builder(&self.rand_fill).arg(&dst).arg(&n).arg(&seed).arg(&a).launch(cfg) }
            .map_err(drv("launching rand_fill"))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_delta_lanes_cover_each_head_dim() {
        for (d, lanes) in [(8, 1), (64, 8), (96, 16), (128, 16), (192, 32), (256, 32)] {
            assert_eq!(delta_lanes(d).unwrap(), lanes, "d {d}");
            assert!(8 * lanes >= d && 32 % lanes == 0);
        }
        for d in [0, 4, 100, 264, 512] {
            assert!(delta_lanes(d).is_err(), "d {d}");
        }
    }

    #[test]
    #[ignore = "needs NVRTC: .ci/nvrtc.sh runs it"]
    fn aux_kernels_compile_with_nvrtc() {
        assert!(compile::nvrtc_available(), "NVRTC does not load");
        for dtype in [DType::BF16, DType::F16] {
            let c = compile::compile_module(&ModuleKind::Aux(dtype), "sm_80", true).unwrap();
            let names: Vec<String> = compile::parse_ptxas(&c.log).into_iter().map(|r| r.name).collect();
            for k in [
                "delta_o_elem",
                "delta_o_f32",
                "convert_f32",
                "copy_u16",
                "copy_u32",
                "copy_u64",
                "copy_u128",
                "narrow_f32",
                "widen_elem",
                "add_f32",
                "add_elem",
                "merge_pieces",
                "rand_fill",
            ] {
                assert!(names.iter().any(|n| n == k), "{k} missing from the {dtype} module: {names:?}");
            }
        }
    }

    #[test]
    fn launches_cover_their_items_and_none_for_no_items() {
        assert!(blocks_of_256(0, 8).is_none(), "a grid of no blocks is a launch error");
        for (items, per_block, blocks) in [(1, 8, 1), (8, 8, 1), (9, 8, 2), (257, 256, 2)] {
            let cfg = blocks_of_256(items, per_block).expect("items to launch");
            assert_eq!(cfg.grid_dim, (blocks, 1, 1), "{items} items, {per_block} a block");
        }
    }
}
