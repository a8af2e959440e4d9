//! Storage dtypes. Inputs are stored as f32, bf16 or f16; every kernel accumulates in f32.
//! [`HostData`] is a host vector of any of them, the one dtype-erased buffer of the workspace.

use crate::{Error, Result};
use half::{bf16, f16};
use std::fmt;

/// A storage dtype of Q, K, V and dO.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    BF16,
    F16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
        }
    }

    /// All storage dtypes.
    pub const ALL: [DType; 3] = [DType::F32, DType::BF16, DType::F16];
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
        })
    }
}

impl std::str::FromStr for DType {
    type Err = crate::Error;
    fn from_str(s: &str) -> crate::Result<Self> {
        match s {
            "f32" | "float32" => Ok(DType::F32),
            "bf16" | "bfloat16" => Ok(DType::BF16),
            "f16" | "float16" | "half" => Ok(DType::F16),
            other => Err(crate::Error::UnsupportedDType(other.to_string())),
        }
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}

/// A storage element: converts to and from the f32 used for accumulation. Implemented for
/// f32, bf16 and f16 only (sealed), so `DTYPE` names the type exactly.
pub trait Element: sealed::Sealed + bytemuck::Pod + Send + Sync + Default + PartialEq + fmt::Debug + 'static {
    const DTYPE: DType;
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;

    /// Converts a run of elements to f32 (overridden where a vectorised conversion exists).
    fn convert_to_f32(src: &[Self], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = s.to_f32();
        }
    }

    /// Converts a run of f32 values to this dtype, rounding to nearest even.
    fn convert_from_f32(src: &[f32], dst: &mut [Self]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = Self::from_f32(*s);
        }
    }
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
    fn convert_to_f32(src: &[Self], dst: &mut [f32]) {
        dst[..src.len()].copy_from_slice(src);
    }
    fn convert_from_f32(src: &[f32], dst: &mut [Self]) {
        dst[..src.len()].copy_from_slice(src);
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn convert_to_f32(src: &[Self], dst: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        src.convert_to_f32_slice(&mut dst[..src.len()]);
    }
    fn convert_from_f32(src: &[f32], dst: &mut [Self]) {
        use half::slice::HalfFloatSliceExt;
        dst[..src.len()].convert_from_f32_slice(src);
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    fn convert_to_f32(src: &[Self], dst: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        src.convert_to_f32_slice(&mut dst[..src.len()]);
    }
    fn convert_from_f32(src: &[f32], dst: &mut [Self]) {
        use half::slice::HalfFloatSliceExt;
        dst[..src.len()].convert_from_f32_slice(src);
    }
}

/// A host vector of one of the storage dtypes.
#[derive(Debug, Clone, PartialEq)]
pub enum HostData {
    F32(Vec<f32>),
    BF16(Vec<bf16>),
    F16(Vec<f16>),
}

impl HostData {
    /// `len` values of `dtype`, every one `fill` (rounded to the dtype).
    pub fn filled(dtype: DType, len: usize, fill: f32) -> HostData {
        match dtype {
            DType::F32 => HostData::F32(vec![fill; len]),
            DType::BF16 => HostData::BF16(vec![bf16::from_f32(fill); len]),
            DType::F16 => HostData::F16(vec![f16::from_f32(fill); len]),
        }
    }

    /// A copy of `values` in their own dtype.
    pub fn from_slice<T: Element>(values: &[T]) -> HostData {
        match T::DTYPE {
            DType::F32 => HostData::F32(bytemuck::cast_slice(values).to_vec()),
            DType::BF16 => HostData::BF16(bytemuck::cast_slice(values).to_vec()),
            DType::F16 => HostData::F16(bytemuck::cast_slice(values).to_vec()),
        }
    }

    /// `values` converted to `dtype`, rounding to nearest even.
    pub fn from_f32(values: &[f32], dtype: DType) -> HostData {
        fn conv<T: Element>(v: &[f32]) -> Vec<T> {
            let mut out = vec![T::default(); v.len()];
            T::convert_from_f32(v, &mut out);
            out
        }
        match dtype {
            DType::F32 => HostData::F32(values.to_vec()),
            DType::BF16 => HostData::BF16(conv(values)),
            DType::F16 => HostData::F16(conv(values)),
        }
    }

    pub fn dtype(&self) -> DType {
        match self {
            HostData::F32(_) => DType::F32,
            HostData::BF16(_) => DType::BF16,
            HostData::F16(_) => DType::F16,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            HostData::F32(v) => v.len(),
            HostData::BF16(v) => v.len(),
            HostData::F16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values as f32.
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            HostData::F32(v) => v.clone(),
            HostData::BF16(v) => to_f32_vec(v),
            HostData::F16(v) => to_f32_vec(v),
        }
    }

    /// The values as a slice of `T`, which must be the data's dtype.
    pub fn as_slice<T: Element>(&self) -> Result<&[T]> {
        match self {
            HostData::F32(v) if T::DTYPE == DType::F32 => Ok(bytemuck::cast_slice(v)),
            HostData::BF16(v) if T::DTYPE == DType::BF16 => Ok(bytemuck::cast_slice(v)),
            HostData::F16(v) if T::DTYPE == DType::F16 => Ok(bytemuck::cast_slice(v)),
            other => Err(other.mismatch(T::DTYPE)),
        }
    }

    /// The values as a mutable slice of `T`, which must be the data's dtype.
    pub fn as_mut_slice<T: Element>(&mut self) -> Result<&mut [T]> {
        let dtype = self.dtype();
        match self {
            HostData::F32(v) if T::DTYPE == DType::F32 => Ok(bytemuck::cast_slice_mut(v)),
            HostData::BF16(v) if T::DTYPE == DType::BF16 => Ok(bytemuck::cast_slice_mut(v)),
            HostData::F16(v) if T::DTYPE == DType::F16 => Ok(bytemuck::cast_slice_mut(v)),
            _ => Err(Error::DTypeMismatch {
                a: "buffer".into(),
                a_dtype: dtype.to_string(),
                b: "expected".into(),
                b_dtype: T::DTYPE.to_string(),
            }),
        }
    }

    /// The values' bytes (native order).
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            HostData::F32(v) => bytemuck::cast_slice(v),
            HostData::BF16(v) => bytemuck::cast_slice(v),
            HostData::F16(v) => bytemuck::cast_slice(v),
        }
    }

    /// The values' bytes (native order), writable.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        match self {
            HostData::F32(v) => bytemuck::cast_slice_mut(v),
            HostData::BF16(v) => bytemuck::cast_slice_mut(v),
            HostData::F16(v) => bytemuck::cast_slice_mut(v),
        }
    }

    fn mismatch(&self, want: DType) -> Error {
        Error::DTypeMismatch {
            a: "buffer".into(),
            a_dtype: self.dtype().to_string(),
            b: "expected".into(),
            b_dtype: want.to_string(),
        }
    }
}

/// `x` as a slice of `U`, which must be `T` itself (the same dtype): for code generic over
/// [`Element`] that dispatches on `T::DTYPE` to a typed kernel.
pub fn reinterpret<T: Element, U: Element>(x: &[T]) -> Result<&[U]> {
    if T::DTYPE != U::DTYPE {
        return Err(Error::DTypeMismatch {
            a: "slice".into(),
            a_dtype: T::DTYPE.to_string(),
            b: "expected".into(),
            b_dtype: U::DTYPE.to_string(),
        });
    }
    // Same dtype, so the same type (Element is sealed): a cast of a slice to itself.
    Ok(bytemuck::cast_slice(x))
}

/// `values` widened to f32.
pub fn to_f32_vec<T: Element>(values: &[T]) -> Vec<f32> {
    let mut out = vec![0f32; values.len()];
    T::convert_to_f32(values, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_names() {
        assert_eq!(bf16::from_f32(1.5).to_f32(), 1.5);
        assert_eq!(<f16 as Element>::from_f32(-2.25).to_f32(), -2.25);
        for d in DType::ALL {
            assert_eq!(d.to_string().parse::<DType>().unwrap(), d);
        }
        assert!("f64".parse::<DType>().is_err());
        let mut out = [0f32; 3];
        bf16::convert_to_f32(&[bf16::from_f32(1.0), bf16::from_f32(-3.0), bf16::from_f32(0.5)], &mut out);
        assert_eq!(out, [1.0, -3.0, 0.5]);
    }

    #[test]
    fn host_data_views_check_the_dtype() {
        let mut d = HostData::from_f32(&[1.0, -2.0, 0.5], DType::BF16);
        assert_eq!(d.as_slice::<bf16>().unwrap()[1], bf16::from_f32(-2.0));
        assert!(matches!(d.as_slice::<f32>(), Err(Error::DTypeMismatch { .. })));
        d.as_mut_slice::<bf16>().unwrap()[0] = bf16::from_f32(4.0);
        assert_eq!(d.to_f32(), vec![4.0, -2.0, 0.5]);
        assert_eq!(d.as_bytes().len(), 6);
        assert_eq!(HostData::from_slice(&[1.5f32]), HostData::F32(vec![1.5]));
        assert_eq!(HostData::filled(DType::F16, 2, f32::NEG_INFINITY).to_f32(), vec![f32::NEG_INFINITY; 2]);
    }
}
