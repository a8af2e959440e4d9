//! One call's tensors, checked against each other, and the problem they pose (shape, mask,
//! options), run on the CPU kernels or enqueued on a GPU.

use distattn::{Attention, AttnOptions, AttnShape, DType, Element, Error, Forward, Mask, MaskSpec, Result};
use distattn_cuda::external::{ExternalBackward, ExternalForward};
use distattn_cuda::fp8::{e4m3_vt_len, ExternalE4m3Forward};
use distattn_cuda::CudaBackend;
use half::{bf16, f16};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// A tensor as the Python layer describes it: `(data address, shape, strides in elements,
/// dtype name, device)`, the device being the CUDA ordinal or −1 for the CPU.
pub type TensorDesc = (u64, Vec<usize>, Vec<i64>, String, i64);

/// torch's name of the FP8 dtype the FP8 forward takes.
pub const E4M3: &str = "float8_e4m3fn";

/// Cumulative sequence lengths of packed queries and keys (`cu_seqlens_q`, `cu_seqlens_k`).
pub type Seqlens = (Vec<i64>, Vec<i64>);

/// The checked problem of one call.
pub struct Problem {
    pub dtype: DType,
    /// CUDA ordinal, or −1 for the CPU.
    device: i64,
    shape: AttnShape,
    mask: Arc<Mask>,
    opts: AttnOptions,
}

pub(crate) fn dtype_of(name: &str, t: &TensorDesc) -> Result<DType> {
    t.3.parse().map_err(|_| Error::UnsupportedDType(format!("{} for {name}", t.3)))
}

pub(crate) fn where_is(device: i64) -> String {
    if device < 0 {
        "cpu".into()
    } else {
        format!("cuda:{device}")
    }
}

/// Per-sequence lengths from cumulative offsets, checked against the packed token count.
fn lengths(name: &str, cu: &[i64], total: usize) -> Result<Vec<usize>> {
    if cu.len() < 2 || cu[0] != 0 {
        return Err(Error::invalid(name, format!("must start at 0 and hold at least 2 entries, got {cu:?}")));
    }
    let lens: Vec<usize> = cu
        .windows(2)
        .map(|w| usize::try_from(w[1] - w[0]))
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| Error::invalid(name, "must never decrease"))?;
    if cu[cu.len() - 1] != total as i64 {
        return Err(Error::invalid(
            name,
            format!("ends at {} but the packed tensor has {total} tokens", cu[cu.len() - 1]),
        ));
    }
    Ok(lens)
}

impl Problem {
    /// Checks Q `[b, nq, h, d]`, K and V `[b, nk, hkv, d]` (one dtype, one device, contiguous),
    /// parses the mask spec and builds the mask: over the whole `nq × nk` matrix, or, given
    /// cumulative lengths (`b = 1`), inside each packed sequence with that sequence's lengths.
    pub fn new(
        q: &TensorDesc,
        k: &TensorDesc,
        v: &TensorDesc,
        spec: &str,
        seqlens: Option<&Seqlens>,
        softmax_scale: Option<f64>,
    ) -> Result<Problem> {
        let dtype = dtype_of("q", q)?;
        for (name, t) in [("k", k), ("v", v)] {
            if dtype_of(name, t)? != dtype {
                return Err(Error::DTypeMismatch {
                    a: "q".into(),
                    a_dtype: dtype.to_string(),
                    b: name.into(),
                    b_dtype: t.3.clone(),
                });
            }
        }
        Self::checked(q, k, v, dtype, spec, seqlens, softmax_scale)
    }

    /// An FP8 forward's problem: Q, K and V `float8_e4m3fn`, otherwise as [`Problem::new`];
    /// `out` is O's dtype.
    pub fn e4m3(
        q: &TensorDesc,
        k: &TensorDesc,
        v: &TensorDesc,
        out: DType,
        spec: &str,
        seqlens: Option<&Seqlens>,
        softmax_scale: Option<f64>,
    ) -> Result<Problem> {
        for (name, t) in [("q", q), ("k", k), ("v", v)] {
            if t.3 != E4M3 {
                return Err(Error::UnsupportedDType(format!(
                    "{} for {name} of the FP8 forward, which takes {E4M3}",
                    t.3
                )));
            }
        }
        Self::checked(q, k, v, out, spec, seqlens, softmax_scale)
    }

    /// The checks of every call but the inputs' dtypes: devices, layouts, shapes, scale, mask.
    fn checked(
        q: &TensorDesc,
        k: &TensorDesc,
        v: &TensorDesc,
        dtype: DType,
        spec: &str,
        seqlens: Option<&Seqlens>,
        softmax_scale: Option<f64>,
    ) -> Result<Problem> {
        for (name, t) in [("k", k), ("v", v)] {
            if t.4 != q.4 {
                return Err(Error::invalid(
                    "devices",
                    format!("q is on {} but {name} on {}", where_is(q.4), where_is(t.4)),
                ));
            }
        }
        for (name, t) in [("q", q), ("k", k), ("v", v)] {
            if t.1.len() != 4 {
                return Err(Error::invalid(name, format!("must be 4-D [batch, seq, heads, head_dim], got {:?}", t.1)));
            }
            contiguous(name, t)?;
        }
        let ([b, nq, h, d], [bk, nk, hkv, dk]) = (dims4(q), dims4(k));
        if v.1 != k.1 {
            return Err(Error::ShapeMismatch {
                tensor: "v".into(),
                expected: format!("{:?} (k's shape)", k.1),
                got: format!("{:?}", v.1),
            });
        }
        if bk != b || dk != d {
            return Err(Error::ShapeMismatch {
                tensor: "k".into(),
                expected: format!("[{b}, seq, kv_heads, {d}] (q's batch and head dim)"),
                got: format!("{:?}", k.1),
            });
        }
        let shape = AttnShape::new(b, nq, nk, h, hkv, d)?;
        let opts = AttnOptions { scale: softmax_scale.map(|s| s as f32) };
        opts.scale_for(d)?; // positive and finite, as the library checks it
        let mask = cached_mask(spec, nq, nk, seqlens, b)?;
        Ok(Problem { dtype, device: q.4, shape, mask, opts })
    }

    pub fn q_dims(&self) -> [usize; 4] {
        let s = &self.shape;
        [s.batch, s.q_len, s.heads, s.head_dim]
    }

    pub fn kv_dims(&self) -> [usize; 4] {
        let s = &self.shape;
        [s.batch, s.k_len, s.kv_heads, s.head_dim]
    }

    pub fn lse_dims(&self) -> [usize; 3] {
        let s = &self.shape;
        [s.batch, s.heads, s.q_len]
    }

    /// Checks an output or workspace tensor: shape, dtype, device, contiguous.
    pub fn expect(&self, name: &str, t: &TensorDesc, dims: &[usize], dtype: DType) -> Result<()> {
        expect(name, t, dims, dtype, self.device)
    }

    /// Runs the forward pass into `o` and `lse`.
    pub fn forward(
        &self,
        q: &TensorDesc,
        k: &TensorDesc,
        v: &TensorDesc,
        o: &TensorDesc,
        lse: &TensorDesc,
        stream: u64,
    ) -> Result<()> {
        if self.device >= 0 {
            let t = ExternalForward { q: q.0, k: k.0, v: v.0, o: o.0, lse: lse.0 };
            let gpu = gpu(self.device)?;
            // SAFETY: the descriptors were checked against each other and this problem (shape,
            // dtype, device, contiguous): each address is torch's memory on this GPU holding the
            // tensor the kernels expect, and `stream` is torch's current stream of that GPU (the
            // Python layer's contract), alive for the call.
            return unsafe {
                gpu.forward_external(&gpu.borrow_stream(stream), self.dtype, &t, &self.shape, &self.mask, &self.opts)
            };
        }
        match self.dtype {
            DType::F32 => self.cpu_forward::<f32>(q, k, v, o, lse),
            DType::BF16 => self.cpu_forward::<bf16>(q, k, v, o, lse),
            DType::F16 => self.cpu_forward::<f16>(q, k, v, o, lse),
        }
    }

    /// Enqueues the FP8 forward into `o` and `lse` on a GPU: `vt` is its workspace
    /// ([`distattn_cuda::fp8::e4m3_vt_len`] bytes), `descales` those of Q, K, V (`[b, hkv]`
    /// f32 each) or `None`.
    pub fn forward_e4m3(
        &self,
        [q, k, v]: [&TensorDesc; 3],
        descales: [Option<&TensorDesc>; 3],
        vt: &TensorDesc,
        [o, lse]: [&TensorDesc; 2],
        stream: u64,
    ) -> Result<()> {
        if self.device < 0 {
            return Err(Error::invalid("q", "the FP8 forward runs on CUDA tensors"));
        }
        let bh = [self.shape.batch, self.shape.kv_heads];
        for (name, d) in ["q_descale", "k_descale", "v_descale"].into_iter().zip(descales) {
            if let Some(d) = d {
                self.expect(name, d, &bh, DType::F32)?;
            }
        }
        if vt.1 != [e4m3_vt_len(&self.shape)] || vt.3 != "uint8" || vt.4 != self.device {
            return Err(Error::invalid(
                "vt",
                format!("must be {} uint8 bytes on the inputs' GPU", e4m3_vt_len(&self.shape)),
            ));
        }
        let addr = |d: Option<&TensorDesc>| d.map_or(0, |d| d.0);
        let t = ExternalE4m3Forward {
            q: q.0,
            k: k.0,
            v: v.0,
            vt: vt.0,
            q_descale: addr(descales[0]),
            k_descale: addr(descales[1]),
            v_descale: addr(descales[2]),
            o: o.0,
            lse: lse.0,
        };
        let gpu = gpu(self.device)?;
        // SAFETY: as in `forward`: every descriptor was checked against this problem (the
        // inputs by `Problem::e4m3`, the outputs by the caller, the descales and the workspace
        // above), on this GPU, and `stream` is torch's current stream there.
        unsafe {
            gpu.forward_e4m3_external(&gpu.borrow_stream(stream), self.dtype, &t, &self.shape, &self.mask, &self.opts)
        }
    }

    /// Runs the backward pass into `dq`, `dk`, `dv`; a GPU needs the workspace `(delta, dq_acc)`,
    /// `dq_acc` where [`CudaBackend::backward_dq_workspace`] says so.
    pub fn backward(
        &self,
        [q, k, v, o, lse, d_o]: [&TensorDesc; 6],
        [dq, dk, dv]: [&TensorDesc; 3],
        workspace: Option<(&TensorDesc, Option<&TensorDesc>)>,
        stream: u64,
    ) -> Result<()> {
        if self.device >= 0 {
            let (delta, dq_acc) =
                workspace.ok_or_else(|| Error::invalid("workspace", "a GPU backward needs delta and dq_acc"))?;
            let t = ExternalBackward {
                q: q.0,
                k: k.0,
                v: v.0,
                o: o.0,
                lse: lse.0,
                d_o: d_o.0,
                dq: dq.0,
                dk: dk.0,
                dv: dv.0,
                delta: delta.0,
                dq_acc: dq_acc.map_or(0, |d| d.0),
            };
            let gpu = gpu(self.device)?;
            // SAFETY: as in `forward`: every descriptor was checked against this problem, and
            // dq_acc, where given, is zeroed (the Python layer's contract; backward_external
            // rejects a missing one that the backward needs).
            return unsafe {
                gpu.backward_external(&gpu.borrow_stream(stream), self.dtype, &t, &self.shape, &self.mask, &self.opts)
            };
        }
        let ins = [q, k, v, o, lse, d_o];
        match self.dtype {
            DType::F32 => self.cpu_backward::<f32>(ins, [dq, dk, dv]),
            DType::BF16 => self.cpu_backward::<bf16>(ins, [dq, dk, dv]),
            DType::F16 => self.cpu_backward::<f16>(ins, [dq, dk, dv]),
        }
    }

    fn attention<T: Element>(&self) -> Result<Attention<T>> {
        Ok(Attention::new(self.shape, Mask::clone(&self.mask))?.scale(self.opts.scale)?.output::<T>())
    }

    fn cpu_forward<T: Element>(
        &self,
        q: &TensorDesc,
        k: &TensorDesc,
        v: &TensorDesc,
        o: &TensorDesc,
        lse: &TensorDesc,
    ) -> Result<()> {
        // SAFETY: each descriptor was checked against this problem (shape, dtype `T` or f32,
        // CPU, contiguous), so it is a live host tensor of that many elements; the outputs are
        // fresh tensors (the Python layer allocates them), so no slice aliases another.
        let f = unsafe { self.attention::<T>()?.forward(host::<T>(q), host::<T>(k), host::<T>(v))? };
        // SAFETY: as above.
        unsafe {
            host_mut::<T>(o).copy_from_slice(&f.o);
            host_mut::<f32>(lse).copy_from_slice(&f.lse);
        }
        Ok(())
    }

    fn cpu_backward<T: Element>(&self, ins: [&TensorDesc; 6], outs: [&TensorDesc; 3]) -> Result<()> {
        let [q, k, v, o, lse, d_o] = ins;
        // SAFETY: as in cpu_forward: checked, live, contiguous host tensors; outputs are fresh.
        unsafe {
            let fwd = Forward { o: host::<T>(o).to_vec(), lse: host::<f32>(lse).to_vec() };
            let g = self.attention::<T>()?.backward(host::<T>(q), host::<T>(k), host::<T>(v), &fwd, host::<T>(d_o))?;
            host_mut::<T>(outs[0]).copy_from_slice(&g.dq);
            host_mut::<T>(outs[1]).copy_from_slice(&g.dk);
            host_mut::<T>(outs[2]).copy_from_slice(&g.dv);
        }
        Ok(())
    }
}

/// Checks a tensor the native side is handed: its shape is `dims`, its dtype `dtype`, it lives
/// on `device` (the inputs' device) and is contiguous.
pub(crate) fn expect(name: &str, t: &TensorDesc, dims: &[usize], dtype: DType, device: i64) -> Result<()> {
    if t.1 != dims {
        return Err(Error::ShapeMismatch {
            tensor: name.into(),
            expected: format!("{dims:?}"),
            got: format!("{:?}", t.1),
        });
    }
    if dtype_of(name, t)? != dtype {
        return Err(Error::DTypeMismatch {
            a: name.into(),
            a_dtype: t.3.clone(),
            b: "expected".into(),
            b_dtype: dtype.to_string(),
        });
    }
    if t.4 != device {
        return Err(Error::invalid(name, format!("is on {}, the inputs on {}", where_is(t.4), where_is(device))));
    }
    contiguous(name, t)
}

/// The mask of `spec` over `nq × nk` tokens, or inside each packed sequence of `seqlens`,
/// built once per distinct call: training runs the same shapes every step, and building a
/// mask is linear in the sequence length.
pub(crate) fn cached_mask(
    spec: &str,
    nq: usize,
    nk: usize,
    seqlens: Option<&Seqlens>,
    batch: usize,
) -> Result<Arc<Mask>> {
    type Key = (String, usize, usize, Option<Seqlens>);
    static MASKS: OnceLock<Mutex<HashMap<Key, Arc<Mask>>>> = OnceLock::new();
    // (Checked before the table: a mask made for a batch of 1 must not serve a larger one.)
    if seqlens.is_some() && batch != 1 {
        return Err(Error::invalid("q", "packed sequences take a batch of 1"));
    }
    let masks = MASKS.get_or_init(Default::default);
    let key = (spec.to_string(), nq, nk, seqlens.cloned());
    if let Some(m) = masks.lock().map_err(|_| poisoned("mask"))?.get(&key) {
        return Ok(m.clone());
    }
    let spec: MaskSpec = spec.parse()?;
    let mask = Arc::new(match seqlens {
        None => spec.build(nq, nk)?,
        Some((cu_q, cu_k)) => {
            let (q_lens, k_lens) = (lengths("cu_seqlens_q", cu_q, nq)?, lengths("cu_seqlens_k", cu_k, nk)?);
            if q_lens.len() != k_lens.len() {
                return Err(Error::invalid(
                    "cu_seqlens_k",
                    format!("holds {} sequences but cu_seqlens_q holds {}", k_lens.len(), q_lens.len()),
                ));
            }
            Mask::per_document(&q_lens, &k_lens, |ql, kl| spec.build(ql, kl))?
        }
    });
    let mut masks = masks.lock().map_err(|_| poisoned("mask"))?;
    if masks.len() >= 64 {
        masks.clear();
    }
    masks.insert(key, mask.clone());
    Ok(mask)
}

fn poisoned(what: &str) -> Error {
    Error::Internal(format!("the {what} table was poisoned"))
}

fn dims4(t: &TensorDesc) -> [usize; 4] {
    [t.1[0], t.1[1], t.1[2], t.1[3]]
}

/// Fails unless the strides are row-major for the shape (size-1 dimensions may have any, and
/// an empty tensor any: it addresses nothing, and torch gives empty results such strides).
pub(crate) fn contiguous(name: &str, t: &TensorDesc) -> Result<()> {
    if t.1.len() != t.2.len() {
        return Err(Error::invalid(name, "shape and strides differ in length"));
    }
    if t.1.contains(&0) {
        return Ok(());
    }
    let mut expected = 1i64;
    for (&size, &stride) in t.1.iter().zip(&t.2).rev() {
        if size != 1 && stride != expected {
            return Err(Error::invalid(name, format!("must be contiguous (strides {:?} for shape {:?})", t.2, t.1)));
        }
        expected = expected.saturating_mul(size as i64);
    }
    Ok(())
}

fn elems(t: &TensorDesc) -> usize {
    t.1.iter().product()
}

/// The host tensor `t` as a slice.
///
/// # Safety
/// `t` describes a live, contiguous host tensor of `T` that nothing writes while the slice
/// lives.
pub(crate) unsafe fn host<'a, T>(t: &TensorDesc) -> &'a [T] {
    // SAFETY: the caller's contract; torch aligns every element to its type.
    unsafe { std::slice::from_raw_parts(t.0 as *const T, elems(t)) }
}

/// The host tensor `t` as a mutable slice.
///
/// # Safety
/// As [`host`], and nothing else reads or writes it while the slice lives.
pub(crate) unsafe fn host_mut<'a, T>(t: &TensorDesc) -> &'a mut [T] {
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts_mut(t.0 as *mut T, elems(t)) }
}

/// The CUDA backend of GPU `ordinal`, opened once per process (kernels and tile plans cached).
pub(crate) fn gpu(ordinal: i64) -> Result<Arc<CudaBackend>> {
    static GPUS: OnceLock<Mutex<HashMap<i64, Arc<CudaBackend>>>> = OnceLock::new();
    let mut gpus =
        GPUS.get_or_init(Default::default).lock().map_err(|_| Error::Internal("the GPU table was poisoned".into()))?;
    if let Some(g) = gpus.get(&ordinal) {
        return Ok(g.clone());
    }
    let g = Arc::new(CudaBackend::new(ordinal as usize)?);
    gpus.insert(ordinal, g.clone());
    Ok(g)
}
