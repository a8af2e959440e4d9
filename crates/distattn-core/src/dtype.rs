//! Storage dtypes. Inputs are stored as f32, bf16 or f16; every kernel accumulates in f32.

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

/// A storage element: converts to and from the f32 used for accumulation.
pub trait Element: Copy + Send + Sync + Default + PartialEq + fmt::Debug + 'static {
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
}
