//! Tensor maps for the TMA loads of the warp-specialized Hopper kernels.
//!
//! A `[batch][rows][heads][head_dim]` tensor is described to the TMA unit as the 4-d tensor
//! `{head_dim, rows, heads, batch}` (innermost first), moved in boxes of 128 bytes of columns
//! (64 bf16/f16, or 32 f32) x `box_rows` rows with the 128-byte swizzle that `wgmma` reads; rows
//! past `rows` read as zeros and are not written, so tiles that overhang the end of a sequence
//! need no bounds checks in the kernel.

use crate::compile::{backend_err, E4M3_VT_KEYS};
use crate::params::StructLayout;
use cudarc::driver::{sys, DeviceRepr};
use distattn_core::{AttnShape, DType, Result};
use std::mem::{offset_of, size_of};

/// An encoded `CUtensorMap`, passed to kernels by value (`__grid_constant__`).
#[repr(transparent)]
#[derive(Clone, Copy)]
pub(crate) struct TensorMap(sys::CUtensorMap);
// SAFETY: `repr(transparent)` over the driver's CUtensorMap: 16 u64 of plain data, 128 bytes,
// no padding, as the kernels' `TmaMap` parameter (size and field offset asserted against
// params.cuh at every compile, TMA_MAP_LAYOUT); its bytes are what cuTensorMapEncodeTiled wrote.
unsafe impl DeviceRepr for TensorMap {}

/// The host layout of the kernels' `TmaMap` (their 16 words are the driver's `CUtensorMap`).
pub(crate) const TMA_MAP_LAYOUT: StructLayout =
    StructLayout { name: "TmaMap", size: size_of::<TensorMap>(), fields: &[("v", offset_of!(TensorMap, 0.opaque))] };

/// The shape of a row-major `[batch][rows][heads][head_dim]` tensor.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RowsTensor {
    pub batch: usize,
    pub rows: usize,
    pub heads: usize,
    pub head_dim: usize,
}

impl RowsTensor {
    /// Q, O or dO of an attention call.
    pub fn of_queries(s: &AttnShape) -> Self {
        RowsTensor { batch: s.batch, rows: s.q_len, heads: s.heads, head_dim: s.head_dim }
    }
    /// K or V of an attention call.
    pub fn of_keys(s: &AttnShape) -> Self {
        RowsTensor { batch: s.batch, rows: s.k_len, heads: s.kv_heads, head_dim: s.head_dim }
    }
}

impl TensorMap {
    /// Encodes the map of the tensor of `dtype` elements at device address `ptr` (16-byte
    /// aligned), for boxes of 128 bytes of columns x `box_rows` rows.
    pub(crate) fn rows(ptr: u64, t: RowsTensor, dtype: DType, box_rows: u32) -> Result<Self> {
        use sys::CUtensorMapDataType as Ty;
        let ty = match dtype {
            DType::BF16 => Ty::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            DType::F16 => Ty::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
            DType::F32 => Ty::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
        };
        Self::rows_of(ptr, t, ty, dtype.size(), box_rows)
    }

    /// The map of a tensor of bytes (FP8 elements), as [`TensorMap::rows`].
    pub(crate) fn rows_u8(ptr: u64, t: RowsTensor, box_rows: u32) -> Result<Self> {
        Self::rows_of(ptr, t, sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, box_rows)
    }

    /// The map of V transposed for the FP8 forward, bytes `[batch][kv heads][head_dim][k_pad]`,
    /// in boxes of `E4M3_VT_KEYS` (64) keys x all `head_dim` rows, with the swizzle of rows that wide
    /// (the kernel's V^T descriptor reads the 64-byte one).
    pub(crate) fn transposed_u8(ptr: u64, t: RowsTensor, k_pad: usize) -> Result<Self> {
        let dims = [k_pad as u64, t.head_dim as u64, t.heads as u64, t.batch as u64];
        let strides = [k_pad as u64, (t.head_dim * k_pad) as u64, (t.heads * t.head_dim * k_pad) as u64];
        let boxes = [E4M3_VT_KEYS as u32, t.head_dim as u32, 1, 1];
        let sw = sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_64B;
        Self::encode(ptr, sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8, dims, strides, boxes, sw)
            .map_err(|r| backend_err(format!("encoding a tensor map (V^T of {t:?}, {k_pad} keys): {r:?}")))
    }

    fn rows_of(ptr: u64, t: RowsTensor, ty: sys::CUtensorMapDataType, e: usize, box_rows: u32) -> Result<Self> {
        let e = e as u64;
        let dims = [t.head_dim as u64, t.rows as u64, t.heads as u64, t.batch as u64];
        // Byte strides of dims 1..3 (dim 0 is contiguous).
        let row = (t.heads * t.head_dim) as u64 * e;
        let strides = [row, t.head_dim as u64 * e, t.rows as u64 * row];
        let boxes = [128 / e as u32, box_rows, 1, 1];
        Self::encode(ptr, ty, dims, strides, boxes, sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B)
            .map_err(|r| backend_err(format!("encoding a tensor map ({t:?}, box {box_rows} rows): {r:?}")))
    }

    /// A 4-d tiled map with the swizzle `sw`: `dims` innermost first, byte `strides` of dims
    /// 1..3, `boxes` in elements.
    fn encode(
        ptr: u64,
        ty: sys::CUtensorMapDataType,
        dims: [u64; 4],
        strides: [u64; 3],
        boxes: [u32; 4],
        sw: sys::CUtensorMapSwizzle,
    ) -> std::result::Result<Self, sys::CUresult> {
        let elem_strides = [1u32; 4];
        let mut map = sys::CUtensorMap { opaque: [0; 16] };
        // SAFETY: every pointer refers to a live local array of the length the rank (4) implies;
        // the driver only writes `map`.
        let r = unsafe {
            sys::cuTensorMapEncodeTiled(
                &mut map,
                ty,
                4,
                ptr as *mut std::ffi::c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                elem_strides.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                sw,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(r);
        }
        Ok(TensorMap(map))
    }
}
