//! Dtype-erased host tensors and `.npy` input/output.
//!
//! `.npy` files hold f32 (`<f4`), f64 (`<f8`, read as f32) or f16 (`<f2`) arrays. NumPy has no
//! bfloat16, so 2-byte integer or void arrays (`<u2`, `<i2`, `|V2`, e.g. a bf16 torch tensor
//! saved through `.view(torch.int16)`) are read as bf16 bit patterns.

use distattn_core::{DType, Element, Error, Result};
use half::{bf16, f16};
use std::io::{BufReader, BufWriter, Read};
use std::path::Path;

/// The elements of a host tensor, in one of the storage dtypes.
#[derive(Debug, Clone, PartialEq)]
pub enum TensorData {
    F32(Vec<f32>),
    BF16(Vec<bf16>),
    F16(Vec<f16>),
}

/// A host tensor: a shape (row-major) and its elements.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    pub shape: Vec<usize>,
    pub data: TensorData,
}

fn bad_file(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::InvalidFile { path: path.display().to_string(), reason: e.to_string() }
}

impl HostTensor {
    pub fn dtype(&self) -> DType {
        match self.data {
            TensorData::F32(_) => DType::F32,
            TensorData::BF16(_) => DType::BF16,
            TensorData::F16(_) => DType::F16,
        }
    }

    pub fn len(&self) -> usize {
        match &self.data {
            TensorData::F32(v) => v.len(),
            TensorData::BF16(v) => v.len(),
            TensorData::F16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements as f32.
    pub fn to_f32(&self) -> Vec<f32> {
        fn conv<T: Element>(v: &[T]) -> Vec<f32> {
            let mut out = vec![0f32; v.len()];
            T::convert_to_f32(v, &mut out);
            out
        }
        match &self.data {
            TensorData::F32(v) => v.clone(),
            TensorData::BF16(v) => conv(v),
            TensorData::F16(v) => conv(v),
        }
    }

    /// A tensor of `dtype` holding the given f32 values, rounded to nearest.
    pub fn from_f32(shape: Vec<usize>, values: &[f32], dtype: DType) -> Self {
        fn conv<T: Element>(v: &[f32]) -> Vec<T> {
            let mut out = vec![T::default(); v.len()];
            T::convert_from_f32(v, &mut out);
            out
        }
        let data = match dtype {
            DType::F32 => TensorData::F32(values.to_vec()),
            DType::BF16 => TensorData::BF16(conv(values)),
            DType::F16 => TensorData::F16(conv(values)),
        };
        HostTensor { shape, data }
    }

    /// This tensor converted to `dtype` (a copy; no-op conversion when the dtype matches).
    pub fn cast(&self, dtype: DType) -> Self {
        if dtype == self.dtype() {
            return self.clone();
        }
        Self::from_f32(self.shape.clone(), &self.to_f32(), dtype)
    }

    /// Fails with [`Error::NonFinite`] naming `name` if any element is NaN or infinite.
    pub fn check_finite(&self, name: &str) -> Result<()> {
        let bad = match &self.data {
            TensorData::F32(v) => v.iter().position(|x| !x.is_finite()),
            TensorData::BF16(v) => v.iter().position(|x| !x.is_finite()),
            TensorData::F16(v) => v.iter().position(|x| !x.is_finite()),
        };
        match bad {
            Some(index) => Err(Error::NonFinite { tensor: name.to_string(), index }),
            None => Ok(()),
        }
    }

    /// Reads a `.npy` file (C order).
    pub fn read_npy(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        let mut bytes = Vec::new();
        BufReader::new(file).read_to_end(&mut bytes).map_err(|e| Error::io(path, e))?;
        let npy = npyz::NpyFile::new(&bytes[..]).map_err(|e| bad_file(path, format!("not a valid .npy file ({e})")))?;
        if npy.order() != npyz::Order::C {
            return Err(bad_file(path, "Fortran-order arrays are not supported; save with np.ascontiguousarray"));
        }
        let shape: Vec<usize> = npy.shape().iter().map(|&d| d as usize).collect();
        let descr = npy.dtype().descr();
        let bad_type = || {
            bad_file(
                path,
                format!("unsupported dtype '{descr}' (expected f32, f64, f16, or bf16 bits as 2-byte int/void)"),
            )
        };
        let npyz::DType::Plain(ts) = npy.dtype() else { return Err(bad_type()) };
        let read_err = |e: std::io::Error| bad_file(path, format!("the data does not match the header ({e})"));
        let data = match (ts.type_char(), ts.size_field()) {
            (npyz::TypeChar::Float, 4) => TensorData::F32(npy.into_vec::<f32>().map_err(read_err)?),
            (npyz::TypeChar::Float, 8) => {
                TensorData::F32(npy.into_vec::<f64>().map_err(read_err)?.into_iter().map(|x| x as f32).collect())
            }
            (npyz::TypeChar::Float, 2) => TensorData::F16(npy.into_vec::<f16>().map_err(read_err)?),
            (npyz::TypeChar::Uint | npyz::TypeChar::Int | npyz::TypeChar::RawData, 2) => {
                let n: usize = shape.iter().product();
                let raw = &bytes[bytes.len() - 2 * n..];
                let little = ts.endianness() != npyz::Endianness::Big;
                TensorData::BF16(
                    raw.chunks_exact(2)
                        .map(|c| {
                            bf16::from_bits(if little {
                                u16::from_le_bytes([c[0], c[1]])
                            } else {
                                u16::from_be_bytes([c[0], c[1]])
                            })
                        })
                        .collect(),
                )
            }
            _ => return Err(bad_type()),
        };
        let t = HostTensor { shape, data };
        if t.len() != t.shape.iter().product::<usize>() {
            return Err(bad_file(path, "file is shorter than its header says"));
        }
        Ok(t)
    }

    /// Writes f32 values as a `.npy` file.
    pub fn write_npy_f32(path: impl AsRef<Path>, shape: &[usize], values: &[f32]) -> Result<()> {
        use npyz::WriterBuilder;
        let path = path.as_ref();
        let file = std::fs::File::create(path).map_err(|e| Error::io(path, e))?;
        let shape: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
        let mut w = npyz::WriteOptions::new()
            .default_dtype()
            .shape(&shape)
            .writer(BufWriter::new(file))
            .begin_nd()
            .map_err(|e| Error::io(path, e))?;
        w.extend(values.iter().copied()).map_err(|e| Error::io(path, e))?;
        w.finish().map_err(|e| Error::io(path, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn npy_round_trip_and_errors() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.npy");
        let vals = [1.0f32, -2.5, 3.25, 0.0, 7.0, 1e-3];
        HostTensor::write_npy_f32(&p, &[2, 3], &vals).unwrap();
        let t = HostTensor::read_npy(&p).unwrap();
        assert_eq!(t.shape, vec![2, 3]);
        assert_eq!(t.data, TensorData::F32(vals.to_vec()));
        assert_eq!(t.cast(DType::BF16).dtype(), DType::BF16);
        assert_eq!(t.cast(DType::BF16).to_f32()[1], -2.5);
        assert!(HostTensor::read_npy(dir.path().join("missing.npy")).is_err());
        std::fs::write(dir.path().join("junk.npy"), b"not numpy").unwrap();
        assert!(matches!(HostTensor::read_npy(dir.path().join("junk.npy")), Err(Error::InvalidFile { .. })));
        let nan = HostTensor::from_f32(vec![2], &[1.0, f32::NAN], DType::F32);
        assert_eq!(nan.check_finite("q"), Err(Error::NonFinite { tensor: "q".into(), index: 1 }));
    }
}
