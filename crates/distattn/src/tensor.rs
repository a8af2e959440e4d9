//! Dtype-erased host tensors, and (feature `npy`) `.npy` input/output.
//!
//! `.npy` files hold f32 (`<f4`), f64 (`<f8`, read as f32) or f16 (`<f2`) arrays. NumPy has no
//! bfloat16, so 2-byte integer or void arrays (`<u2`, `<i2`, `|V2`, e.g. a bf16 torch tensor
//! saved through `.view(torch.int16)`) are read as bf16 bit patterns.

use distattn_core::{AttnShape, DType, Error, HostData, Result};
#[cfg(feature = "npy")]
use half::{bf16, f16};
#[cfg(feature = "npy")]
use std::io::BufWriter;
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

    /// Fails with [`Error::NonFinite`] naming `name` and the element's index if any element is
    /// NaN or infinite.
    pub fn check_finite(&self, name: &str) -> Result<()> {
        let bad = match &self.data {
            HostData::F32(v) => v.iter().position(|x| !x.is_finite()),
            HostData::BF16(v) => v.iter().position(|x| !x.is_finite()),
            HostData::F16(v) => v.iter().position(|x| !x.is_finite()),
        };
        match bad {
            Some(flat) => Err(Error::NonFinite { tensor: name.to_string(), index: self.unravel(flat) }),
            None => Ok(()),
        }
    }

    /// The row-major multi-dimensional index of element `flat` (just `[flat]` if the shape does
    /// not describe the data, so an error can still point somewhere).
    pub fn unravel(&self, flat: usize) -> Vec<usize> {
        if self.shape.iter().product::<usize>() != self.len() || self.shape.is_empty() {
            return vec![flat];
        }
        let mut rest = flat;
        let mut index = vec![0; self.shape.len()];
        for (i, &dim) in index.iter_mut().zip(&self.shape).rev() {
            *i = rest % dim;
            rest /= dim;
        }
        index
    }

    /// Reads a `.npy` file (C order).
    ///
    /// Reading is exact: the data starts right after the header and must be exactly as long as
    /// the header's shape and dtype say, else [`Error::InvalidFile`]. Sizes are checked before
    /// anything is allocated for the data, so a corrupt header cannot cause a huge allocation.
    #[cfg(feature = "npy")]
    pub fn read_npy(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        Self::from_npy_bytes(&bytes).map_err(|reason| bad_file(path, reason))
    }

    /// Decodes the contents of a `.npy` file; the error is the one-line reason.
    #[cfg(feature = "npy")]
    fn from_npy_bytes(bytes: &[u8]) -> std::result::Result<Self, String> {
        let header = npy::Header::parse(bytes)?;
        if header.fortran_order {
            return Err("Fortran-order arrays are not supported; save with np.ascontiguousarray".into());
        }
        let descr = &header.descr;
        let (little, element) = npy::parse_descr(descr).ok_or_else(|| {
            format!("unsupported dtype {descr} (expected <f4, <f8, <f2, or bf16 bits as <u2, <i2 or |V2)")
        })?;
        let shape = &header.shape;
        let total_bytes = shape
            .iter()
            .try_fold(element.size(), |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| format!("header says {shape:?} of {descr}, more bytes than can be addressed"))?;
        let data = &bytes[header.data_start..];
        if data.len() != total_bytes {
            return Err(format!(
                "header says {shape:?} of {descr} = {total_bytes} bytes, file has {} bytes after the header",
                data.len()
            ));
        }
        let data = match element {
            npy::Element::F32 => HostData::F32(npy::decode(data, little, f32::from_le_bytes, f32::from_be_bytes)),
            npy::Element::F64 => HostData::F32(
                npy::decode(data, little, f64::from_le_bytes, f64::from_be_bytes)
                    .into_iter()
                    .map(|x| x as f32)
                    .collect(),
            ),
            npy::Element::F16 => HostData::F16(
                npy::decode(data, little, u16::from_le_bytes, u16::from_be_bytes)
                    .into_iter()
                    .map(f16::from_bits)
                    .collect(),
            ),
            npy::Element::Bf16Bits => HostData::BF16(
                npy::decode(data, little, u16::from_le_bytes, u16::from_be_bytes)
                    .into_iter()
                    .map(bf16::from_bits)
                    .collect(),
            ),
        };
        Ok(HostTensor { shape: header.shape, data })
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
        let target = write_target(path).map_err(|e| Error::io(path, e))?;
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

/// The `.npy` header, parsed here rather than through npyz: npyz does not tell where the data
/// starts, and reading exactly (no trailing or missing bytes, no allocation a header asks for)
/// needs that offset; the format is small (magic, version, length, one Python dict literal).
#[cfg(feature = "npy")]
mod npy {
    /// What a header describes: its dtype string, order, shape, and where the data starts.
    pub struct Header {
        pub descr: String,
        pub fortran_order: bool,
        pub shape: Vec<usize>,
        pub data_start: usize,
    }

    /// The element formats read: floats, and 2-byte integers or void read as bf16 bits.
    #[derive(Clone, Copy)]
    pub enum Element {
        F32,
        F64,
        F16,
        Bf16Bits,
    }

    impl Element {
        pub fn size(self) -> usize {
            match self {
                Element::F64 => 8,
                Element::F32 => 4,
                Element::F16 | Element::Bf16Bits => 2,
            }
        }
    }

    /// `(little_endian, element)` for a supported `descr` such as `<f4` or `|V2`.
    pub fn parse_descr(descr: &str) -> Option<(bool, Element)> {
        let mut chars = descr.chars();
        let order = chars.next()?;
        let little = match order {
            '<' | '|' | '=' => true,
            '>' => false,
            _ => return None,
        };
        let element = match chars.as_str() {
            "f4" => Element::F32,
            "f8" => Element::F64,
            "f2" | "e" => Element::F16,
            "u2" | "i2" | "V2" => Element::Bf16Bits,
            _ => return None,
        };
        Some((little, element))
    }

    /// The items of `data` (whose length is a multiple of `N`), in the given byte order.
    pub fn decode<T, const N: usize>(
        data: &[u8],
        little: bool,
        from_le: fn([u8; N]) -> T,
        from_be: fn([u8; N]) -> T,
    ) -> Vec<T> {
        let convert = if little { from_le } else { from_be };
        data.chunks_exact(N)
            .map(|c| {
                let mut item = [0u8; N];
                item.copy_from_slice(c);
                convert(item)
            })
            .collect()
    }

    impl Header {
        /// Parses the magic, version, header length and header dict at the start of `bytes`.
        pub fn parse(bytes: &[u8]) -> Result<Header, String> {
            const MAGIC: &[u8] = b"\x93NUMPY";
            if bytes.len() < MAGIC.len() + 2 || &bytes[..MAGIC.len()] != MAGIC {
                return Err("not a .npy file (no \\x93NUMPY magic)".into());
            }
            let (major, minor) = (bytes[6], bytes[7]);
            let (len_start, len_size) = match major {
                1 => (8, 2),
                2 | 3 => (8, 4),
                _ => return Err(format!("unsupported .npy version {major}.{minor}")),
            };
            let text_start = len_start + len_size;
            let Some(len_bytes) = bytes.get(len_start..text_start) else {
                return Err("the .npy header is cut short".into());
            };
            let header_len = len_bytes.iter().rev().fold(0usize, |acc, &b| (acc << 8) | b as usize);
            let data_start = text_start
                .checked_add(header_len)
                .filter(|&end| end <= bytes.len())
                .ok_or_else(|| format!("the .npy header says it is {header_len} bytes long, the file is shorter"))?;
            // Versions 1 and 2 are latin-1, which maps bytes to the same code points.
            let text: String = match major {
                3 => std::str::from_utf8(&bytes[text_start..data_start])
                    .map_err(|_| "the .npy header is not UTF-8".to_string())?
                    .to_string(),
                _ => bytes[text_start..data_start].iter().map(|&b| b as char).collect(),
            };
            let bad = |what: &str| format!("malformed .npy header ({what}): {}", one_line(&text));
            let mut parser = Parser { rest: text.trim_end() };
            let Value::Dict(entries) = parser.value().map_err(&bad)? else {
                return Err(bad("not a dict"));
            };
            if !parser.rest.trim().is_empty() {
                return Err(bad("text after the dict"));
            }
            let field = |key: &str| {
                entries.iter().find(|(k, _)| k == key).map(|(_, v)| v).ok_or_else(|| bad(&format!("no '{key}'")))
            };
            let Value::Str(descr) = field("descr")? else {
                return Err(bad("'descr' is not a plain dtype string; structured arrays are not supported"));
            };
            let Value::Bool(fortran_order) = field("fortran_order")? else {
                return Err(bad("'fortran_order' is not True or False"));
            };
            let Value::Tuple(dims) = field("shape")? else {
                return Err(bad("'shape' is not a tuple"));
            };
            let shape = dims
                .iter()
                .map(|d| match d {
                    Value::Int(n) => usize::try_from(*n).ok(),
                    _ => None,
                })
                .collect::<Option<Vec<usize>>>()
                .ok_or_else(|| bad("'shape' holds something other than sizes"))?;
            Ok(Header { descr: descr.clone(), fortran_order: *fortran_order, shape, data_start })
        }
    }

    /// At most 200 characters of `text` on one line, for error messages.
    fn one_line(text: &str) -> String {
        let flat: String = text.trim().chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
        match flat.char_indices().nth(200) {
            Some((cut, _)) => format!("{}...", &flat[..cut]),
            None => flat,
        }
    }

    /// The Python literals a header dict holds.
    enum Value {
        Str(String),
        Bool(bool),
        Int(i128),
        Tuple(Vec<Value>),
        Dict(Vec<(String, Value)>),
    }

    /// A recursive-descent parser of those literals; nesting is bounded, so a hostile header
    /// cannot overflow the stack.
    struct Parser<'a> {
        rest: &'a str,
    }

    const MAX_DEPTH: usize = 8;

    impl Parser<'_> {
        fn value(&mut self) -> Result<Value, &'static str> {
            self.value_at(0)
        }

        fn skip_space(&mut self) {
            self.rest = self.rest.trim_start();
        }

        fn eat(&mut self, c: char) -> bool {
            self.skip_space();
            match self.rest.strip_prefix(c) {
                Some(rest) => {
                    self.rest = rest;
                    true
                }
                None => false,
            }
        }

        fn value_at(&mut self, depth: usize) -> Result<Value, &'static str> {
            if depth > MAX_DEPTH {
                return Err("nested too deeply");
            }
            self.skip_space();
            let first = self.rest.chars().next().ok_or("ends early")?;
            match first {
                '\'' | '"' => self.string().map(Value::Str),
                '(' | '[' => {
                    self.rest = &self.rest[1..];
                    let close = if first == '(' { ')' } else { ']' };
                    let mut items = Vec::new();
                    loop {
                        if self.eat(close) {
                            break;
                        }
                        items.push(self.value_at(depth + 1)?);
                        if !self.eat(',') {
                            if self.eat(close) {
                                break;
                            }
                            return Err("expected ',' or a closing bracket");
                        }
                    }
                    Ok(Value::Tuple(items))
                }
                '{' => {
                    self.rest = &self.rest[1..];
                    let mut entries = Vec::new();
                    loop {
                        if self.eat('}') {
                            break;
                        }
                        self.skip_space();
                        let key = self.string()?;
                        if !self.eat(':') {
                            return Err("expected ':' after a key");
                        }
                        entries.push((key, self.value_at(depth + 1)?));
                        if !self.eat(',') {
                            if self.eat('}') {
                                break;
                            }
                            return Err("expected ',' or '}' in the dict");
                        }
                    }
                    Ok(Value::Dict(entries))
                }
                _ => self.word(),
            }
        }

        fn string(&mut self) -> Result<String, &'static str> {
            let quote = self.rest.chars().next().filter(|&c| c == '\'' || c == '"').ok_or("expected a string")?;
            let body = &self.rest[1..];
            let end = body.find(quote).ok_or("unterminated string")?;
            let s = body[..end].to_string();
            self.rest = &body[end + 1..];
            Ok(s)
        }

        /// `True`, `False`, or an integer (with Python 2's `L` suffix allowed).
        fn word(&mut self) -> Result<Value, &'static str> {
            let end = self
                .rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '_'))
                .unwrap_or(self.rest.len());
            let word = &self.rest[..end];
            self.rest = &self.rest[end..];
            match word {
                "True" => Ok(Value::Bool(true)),
                "False" => Ok(Value::Bool(false)),
                _ => word.trim_end_matches('L').parse::<i128>().map(Value::Int).map_err(|_| "expected a value"),
            }
        }
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
    for (name, t) in [("k", k), ("v", v)] {
        if t.shape.len() != q.shape.len() {
            return Err(mismatch(
                name,
                format!(
                    "{} dimensions like q {:?} (q, k and v must have the same number of dimensions)",
                    q.shape.len(),
                    q.shape
                ),
                &t.shape,
            ));
        }
    }
    if bk != b || dk != d {
        return Err(mismatch("k", format!("[{b}, seq, kv_heads, {d}] (batch and head_dim of q)"), &k.shape));
    }
    if v.shape != k.shape {
        return Err(mismatch("v", format!("{:?} (the shape of k)", k.shape), &v.shape));
    }
    AttnShape::new(b, nq, nk, h, hk, d)
}

/// The file a write to `path` lands in: `path`, or where its chain of symbolic links leads,
/// whether or not that file exists yet (a link to a file still to be made is written through,
/// as `File::create` would).
#[cfg(feature = "npy")]
pub fn write_target(path: &Path) -> std::io::Result<std::path::PathBuf> {
    let mut p = path.to_path_buf();
    // Linux's own bound on a chain of links.
    for _ in 0..40 {
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.file_type().is_symlink() => {
                let to = std::fs::read_link(&p)?;
                p = if to.is_absolute() { to } else { p.parent().unwrap_or(Path::new("")).join(to) };
            }
            _ => return Ok(p),
        }
    }
    Err(std::io::Error::other("too many levels of symbolic links"))
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
        let nan = HostTensor::from_f32(vec![2, 3], &[1.0, 0.0, 0.0, 0.0, f32::NAN, 0.0], DType::F32);
        let err = nan.check_finite("q").unwrap_err();
        assert_eq!(err, Error::NonFinite { tensor: "q".into(), index: vec![1, 1] });
        assert!(err.to_string().contains("q[1, 1]"), "{err}");
    }

    /// A `.npy` file: version 1 header holding `dict`, padded as NumPy does, then `data`.
    fn npy_file(dict: &str, data: &[u8]) -> Vec<u8> {
        let pad = (64 - (10 + dict.len() + 1) % 64) % 64;
        let header = format!("{dict}{}\n", " ".repeat(pad));
        let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
        bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend_from_slice(data);
        bytes
    }

    fn dict(descr: &str, shape: &[u64]) -> String {
        let dims: String = shape.iter().map(|d| format!("{d}, ")).collect();
        format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': ({dims}), }}")
    }

    /// The one-line reason `bytes` are refused for.
    fn refused(bytes: &[u8]) -> String {
        let reason = HostTensor::from_npy_bytes(bytes).unwrap_err();
        assert_eq!(reason.lines().count(), 1, "{reason}");
        reason
    }

    #[test]
    fn npy_data_must_be_exactly_as_long_as_the_header_says() {
        let header = dict("<f4", &[2, 3]);
        let data: Vec<u8> = (0..6).flat_map(|i| (i as f32).to_le_bytes()).collect();
        let t = HostTensor::from_npy_bytes(&npy_file(&header, &data)).unwrap();
        assert_eq!(t.data, HostData::F32(vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]));
        let mut trailing = data.clone();
        trailing.extend_from_slice(&[0; 4]);
        let reason = refused(&npy_file(&header, &trailing));
        assert!(reason.contains("[2, 3] of <f4 = 24 bytes, file has 28 bytes after the header"), "{reason}");
        let reason = refused(&npy_file(&header, &data[..22]));
        assert!(reason.contains("file has 22 bytes after the header"), "{reason}");
        // bf16 bits too: the old reader took the file's last bytes, so this read shifted.
        let reason = refused(&npy_file(&dict("<u2", &[2]), &[1, 2, 3, 4, 5, 6]));
        assert!(reason.contains("= 4 bytes, file has 6 bytes"), "{reason}");
        let reason = refused(&npy_file(&dict("<u2", &[4]), &[1, 2]));
        assert!(reason.contains("= 8 bytes, file has 2 bytes"), "{reason}");
    }

    #[test]
    fn npy_bf16_bits_are_read_exactly() {
        let bits = [0x3f80u16, 0xc020, 0x0001, 0x7f7f];
        for descr in ["<u2", "<i2", "|V2"] {
            let data: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
            let t = HostTensor::from_npy_bytes(&npy_file(&dict(descr, &[2, 2]), &data)).unwrap();
            assert_eq!(t.shape, vec![2, 2]);
            assert_eq!(t.data, HostData::BF16(bits.iter().map(|&b| bf16::from_bits(b)).collect()), "{descr}");
        }
        let data: Vec<u8> = bits.iter().flat_map(|b| b.to_be_bytes()).collect();
        let t = HostTensor::from_npy_bytes(&npy_file(&dict(">u2", &[4]), &data)).unwrap();
        assert_eq!(t.data, HostData::BF16(bits.iter().map(|&b| bf16::from_bits(b)).collect()));
    }

    #[test]
    fn npy_huge_header_shape_is_refused_at_once() {
        let started = std::time::Instant::now();
        let reason = refused(&npy_file(&dict("<f4", &[1 << 32, 1 << 32, 1, 1]), &[0; 16]));
        assert!(reason.contains("[4294967296, 4294967296, 1, 1] of <f4"), "{reason}");
        // 2^40 elements claimed by a 100-byte file: refused without allocating for them.
        let reason = refused(&npy_file(&dict("<u2", &[1 << 40]), &[0; 20]));
        assert!(reason.contains("file has 20 bytes after the header"), "{reason}");
        assert!(started.elapsed() < std::time::Duration::from_secs(1));
    }

    #[test]
    fn npy_bad_headers_are_one_line_errors() {
        let reason = refused(&npy_file("{'descr': '<i4', 'fortran_order': False,\n 'shape': (3,), }", &[0; 12]));
        assert!(reason.contains("unsupported dtype <i4 "), "{reason}");
        let reason = refused(&npy_file("{'descr': '<f4', 'fortran_order': False,\n 'shape': (3,", &[0; 12]));
        assert!(reason.starts_with("malformed .npy header"), "{reason}");
        let reason = refused(&npy_file("{'descr': '<f4', 'fortran_order': False, 'shape': (-3,), }", &[]));
        assert!(reason.contains("'shape'"), "{reason}");
        let mut long = npy_file(&dict("<f4", &[1]), &[0; 4]);
        long[8] = 0xff;
        long[9] = 0xff;
        assert!(refused(&long).contains("header says it is 65535 bytes long"));
        assert!(refused(b"\x93NUMPY").contains("not a .npy file"));
        assert!(refused(b"\x93NUMPY\x02\x00\x05").contains("cut short"));
        let nested =
            format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {}1{}}}", "(".repeat(100), ")".repeat(100));
        assert!(refused(&npy_file(&nested, &[])).contains("nested too deeply"));
    }

    #[test]
    fn npy_versions_2_and_3_are_read() {
        let dict = dict("<f2", &[1]);
        for version in [2u8, 3] {
            let mut bytes = vec![0x93, b'N', b'U', b'M', b'P', b'Y', version, 0];
            bytes.extend_from_slice(&(dict.len() as u32).to_le_bytes());
            bytes.extend_from_slice(dict.as_bytes());
            bytes.extend_from_slice(&f16::from_f32(1.5).to_bits().to_le_bytes());
            let t = HostTensor::from_npy_bytes(&bytes).unwrap();
            assert_eq!(t.data, HostData::F16(vec![f16::from_f32(1.5)]));
        }
    }

    #[test]
    fn mixed_ranks_are_named_plainly() {
        let t = |shape: &[usize]| HostTensor::from_f32(shape.to_vec(), &vec![0.0; shape.iter().product()], DType::F32);
        let (q, k) = (t(&[1, 4, 2, 8]), t(&[4, 2, 8]));
        for err in [infer_shape(&q, &k, &k).unwrap_err(), infer_shape(&k, &q, &q).unwrap_err()] {
            let msg = err.to_string();
            assert!(msg.contains("q, k and v must have the same number of dimensions"), "{msg}");
            assert!(msg.contains("[1, 4, 2, 8]") && msg.contains("[4, 2, 8]"), "{msg}");
        }
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

            /// Arbitrary bytes, with or without the magic: never a panic.
            #[test]
            fn random_bytes_never_panic(mut bytes in proptest::collection::vec(any::<u8>(), 0..200), magic in any::<bool>()) {
                if magic {
                    let mut with = b"\x93NUMPY\x01\x00".to_vec();
                    with.append(&mut bytes);
                    bytes = with;
                }
                let _ = HostTensor::from_npy_bytes(&bytes);
            }

            /// Well-formed-looking headers with random shapes (huge dims too), dtypes and data
            /// lengths: Ok exactly when the length matches, else a one-line error, quickly.
            #[test]
            fn random_headers_are_read_exactly_or_refused(
                descr in proptest::sample::select(vec!["<f4", "<f8", "<f2", ">f4", "<u2", "<i2", "|V2", "<i4", "|u1", "f4", "<c8"]),
                shape in proptest::collection::vec(prop_oneof![0u64..5, Just(1u64 << 32), Just(1u64 << 40), Just(u64::MAX)], 0..5),
                extra in -8i64..8,
            ) {
                let size = match &descr[1..] { "f8" => 8, "f4" | "i4" | "c8" => 4, "u1" => 1, _ => 2 };
                let expected = shape.iter().try_fold(size as u64, |acc, &d| acc.checked_mul(d));
                let len = match expected {
                    Some(n) if n <= 1024 => (n as i64 + extra).max(0) as usize,
                    _ => extra.unsigned_abs() as usize * 8,
                };
                let started = std::time::Instant::now();
                let result = HostTensor::from_npy_bytes(&npy_file(&dict(descr, &shape), &vec![0; len]));
                prop_assert!(started.elapsed() < std::time::Duration::from_secs(1));
                let supported = ["<f4", "<f8", "<f2", ">f4", "<u2", "<i2", "|V2"].contains(&descr);
                match result {
                    Ok(t) => {
                        prop_assert!(supported && expected == Some(len as u64));
                        prop_assert_eq!(t.shape.iter().map(|&d| d as u64).collect::<Vec<_>>(), shape);
                    }
                    Err(reason) => {
                        prop_assert!(!supported || expected != Some(len as u64), "{}", reason);
                        prop_assert_eq!(reason.lines().count(), 1);
                    }
                }
            }
        }
    }
}
