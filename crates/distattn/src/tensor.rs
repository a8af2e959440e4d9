//! Dtype-erased host tensors, and (feature `npy`) `.npy` input/output.
//!
//! `.npy` files hold f32 (`<f4`), f64 (`<f8`, read as f32) or f16 (`<f2`) arrays. NumPy has no
//! bfloat16, so 2-byte integer or void arrays (`<u2`, `<i2`, `|V2`, e.g. a bf16 torch tensor
//! saved through `.view(torch.int16)`) are read as bf16 bit patterns.

use distattn_core::{AttnShape, DType, Error, HostData, Result};
#[cfg(feature = "npy")]
use half::{bf16, f16};
#[cfg(feature = "npy")]
use std::io::{BufReader, BufWriter, Read};
#[cfg(feature = "npy")]
use std::path::Path;

/// A host tensor: a shape (row-major) and its elements in one of the storage dtypes.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    pub shape: Vec<usize>,
    pub data: HostData,
}

#[cfg(feature = "npy")]
fn bad_file(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::InvalidFile { path: path.display().to_string(), reason: e.to_string() }
}

impl HostTensor {
    pub fn dtype(&self) -> DType {
        self.data.dtype()
    }

    pub fn len(&self) -> usize {
        self.data.len()
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// The elements as f32.
    pub fn to_f32(&self) -> Vec<f32> {
        self.data.to_f32()
    }

    /// A tensor of `dtype` holding the given f32 values, rounded to nearest.
    pub fn from_f32(shape: Vec<usize>, values: &[f32], dtype: DType) -> Self {
        HostTensor { shape, data: HostData::from_f32(values, dtype) }
    }

    /// This tensor converted to `dtype` (a copy; no conversion when the dtype matches).
    pub fn cast(&self, dtype: DType) -> Self {
        if dtype == self.dtype() {
            return self.clone();
        }
        Self::from_f32(self.shape.clone(), &self.to_f32(), dtype)
    }

    /// Fails with [`Error::NonFinite`] naming `name` if any element is NaN or infinite.
    pub fn check_finite(&self, name: &str) -> Result<()> {
        let bad = match &self.data {
            HostData::F32(v) => v.iter().position(|x| !x.is_finite()),
            HostData::BF16(v) => v.iter().position(|x| !x.is_finite()),
            HostData::F16(v) => v.iter().position(|x| !x.is_finite()),
        };
        match bad {
            Some(index) => Err(Error::NonFinite { tensor: name.to_string(), index }),
            None => Ok(()),
        }
    }

    /// Reads a `.npy` file (C order).
    #[cfg(feature = "npy")]
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
            (npyz::TypeChar::Float, 4) => HostData::F32(npy.into_vec::<f32>().map_err(read_err)?),
            (npyz::TypeChar::Float, 8) => {
                HostData::F32(npy.into_vec::<f64>().map_err(read_err)?.into_iter().map(|x| x as f32).collect())
            }
            (npyz::TypeChar::Float, 2) => HostData::F16(npy.into_vec::<f16>().map_err(read_err)?),
            (npyz::TypeChar::Uint | npyz::TypeChar::Int | npyz::TypeChar::RawData, 2) => {
                let n: usize = shape.iter().product();
                let raw = &bytes[bytes.len() - 2 * n..];
                let little = ts.endianness() != npyz::Endianness::Big;
                HostData::BF16(
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

    /// Writes f32 values as a `.npy` file, atomically: the data goes to a temporary file in the
    /// same directory, synced, then renamed over `path`. So an existing file is only ever replaced
    /// by a complete one; on error (a full disk, say) it is left as it was and the temporary file
    /// is removed. A symbolic link at `path` is written through, as `File::create` would.
    #[cfg(feature = "npy")]
    pub fn write_npy_f32(path: impl AsRef<Path>, shape: &[usize], values: &[f32]) -> Result<()> {
        use npyz::WriterBuilder;
        let path = path.as_ref();
        // Rename over the link's target, not the link itself.
        let target = match std::fs::symlink_metadata(path) {
            Ok(m) if m.file_type().is_symlink() => std::fs::canonicalize(path).map_err(|e| Error::io(path, e))?,
            _ => path.to_path_buf(),
        };
        let Some(name) = target.file_name() else {
            return Err(Error::io(path, std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a file name")));
        };
        let dir = match target.parent() {
            Some(dir) if !dir.as_os_str().is_empty() => dir,
            _ => Path::new("."),
        };
        let mut prefix = std::ffi::OsString::from(".");
        prefix.push(name);
        prefix.push(".");
        let mut builder = tempfile::Builder::new();
        builder.prefix(&prefix).suffix(".tmp");
        // The mode `File::create` gives (0o666 less the umask), not the temporary file's 0o600.
        #[cfg(unix)]
        builder.permissions(std::os::unix::fs::PermissionsExt::from_mode(0o666));
        let staged = builder.tempfile_in(dir).map_err(|e| Error::io(path, e))?;
        let shape: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
        let mut w = npyz::WriteOptions::new()
            .default_dtype()
            .shape(&shape)
            .writer(BufWriter::new(staged.as_file()))
            .begin_nd()
            .map_err(|e| Error::io(path, e))?;
        w.extend(values.iter().copied()).map_err(|e| Error::io(path, e))?;
        // `finish` flushes the buffer; the sync makes the data durable before the rename.
        w.finish().map_err(|e| Error::io(path, e))?;
        staged.as_file().sync_all().map_err(|e| Error::io(path, e))?;
        // On failure the `PersistError` drops the temporary file, which removes it.
        staged.persist(&target).map_err(|e| Error::io(path, e.error))?;
        Ok(())
    }
}

/// Infers the attention shape from Q `[batch, q_len, heads, d]` (or packed `[tokens, heads, d]`)
/// and K, V of the same rank with `kv_heads` heads.
pub fn infer_shape(q: &HostTensor, k: &HostTensor, v: &HostTensor) -> Result<AttnShape> {
    let mismatch = |tensor: &str, expected: String, got: &[usize]| Error::ShapeMismatch {
        tensor: tensor.to_string(),
        expected,
        got: format!("{got:?}"),
    };
    let dims4 = |t: &HostTensor, name: &str| -> Result<[usize; 4]> {
        match t.shape[..] {
            [b, n, h, d] => Ok([b, n, h, d]),
            [n, h, d] => Ok([1, n, h, d]),
            _ => Err(mismatch(name, "[batch, seq, heads, head_dim] or [tokens, heads, head_dim]".into(), &t.shape)),
        }
    };
    let [b, nq, h, d] = dims4(q, "q")?;
    let [bk, nk, hk, dk] = dims4(k, "k")?;
    if q.shape.len() != k.shape.len() || bk != b || dk != d {
        return Err(mismatch("k", format!("[{b}, seq, kv_heads, {d}] (batch and head_dim of q)"), &k.shape));
    }
    if v.shape != k.shape {
        return Err(mismatch("v", format!("{:?} (the shape of k)", k.shape), &v.shape));
    }
    AttnShape::new(b, nq, nk, h, hk, d)
}

#[cfg(all(test, feature = "npy"))]
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
        assert_eq!(t.data, HostData::F32(vals.to_vec()));
        assert_eq!(t.cast(DType::BF16).dtype(), DType::BF16);
        assert_eq!(t.cast(DType::BF16).to_f32()[1], -2.5);
        assert!(matches!(HostTensor::read_npy(dir.path().join("missing.npy")), Err(Error::Io { .. })));
        std::fs::write(dir.path().join("junk.npy"), b"not numpy").unwrap();
        assert!(matches!(HostTensor::read_npy(dir.path().join("junk.npy")), Err(Error::InvalidFile { .. })));
        let nan = HostTensor::from_f32(vec![2], &[1.0, f32::NAN], DType::F32);
        assert_eq!(nan.check_finite("q"), Err(Error::NonFinite { tensor: "q".into(), index: 1 }));
    }
}
