//! Decode over a KV cache (`flash_attn_with_kvcache`): the tensors of one call checked against
//! each other, then the step run on the CPU kernels or enqueued on a GPU (append, plan, decode).

use crate::problem::{contiguous, gpu, host, host_mut, TensorDesc};
use distattn::decode::{DecodeOptions, DecodeShape, PagedCache, PagedLayout};
use distattn::{AttnOptions, DType, Element, Error, Result};
use distattn_cuda::decode::{DecodePtrs, DecodeStep, DecodeWorkspacePtrs};
use half::{bf16, f16};

/// The checked tensors of one call. Q and O `[b, s, h, d]`, LSE `[b, h, s]` f32; caches
/// `[pages, page_size, hkv, d]`; page table `[b, max_pages]` and lengths `[b]` int32; new K/V
/// `[b, s_new, hkv, d]` or none.
pub struct DecodeCall<'a> {
    pub dtype: DType,
    device: i64,
    shape: DecodeShape,
    layout: PagedLayout,
    max_pages: usize,
    new_tokens: usize,
    opts: DecodeOptions,
    q: &'a TensorDesc,
    k_cache: &'a TensorDesc,
    v_cache: &'a TensorDesc,
    page_table: &'a TensorDesc,
    seqlens: &'a TensorDesc,
    new_kv: Option<(&'a TensorDesc, &'a TensorDesc)>,
}

fn dims(name: &str, t: &TensorDesc, n: usize) -> Result<Vec<usize>> {
    if t.1.len() != n {
        return Err(Error::invalid(name, format!("must have {n} dimensions, got shape {:?}", t.1)));
    }
    Ok(t.1.clone())
}

/// Checks `t`'s shape, dtype (that of `like`: "q" or "required"), device and contiguity.
fn same(name: &str, t: &TensorDesc, want: &[usize], (like, dtype): (&str, &str), device: i64) -> Result<()> {
    if t.1 != want {
        return Err(Error::ShapeMismatch {
            tensor: name.into(),
            expected: format!("{want:?}"),
            got: format!("{:?}", t.1),
        });
    }
    if t.3 != dtype {
        return Err(Error::DTypeMismatch {
            a: name.into(),
            a_dtype: t.3.clone(),
            b: like.into(),
            b_dtype: dtype.into(),
        });
    }
    if t.4 != device {
        return Err(Error::invalid(name, format!("is on device {}, q on {device} (-1: the CPU)", t.4)));
    }
    contiguous(name, t)
}

impl<'a> DecodeCall<'a> {
    #[allow(clippy::too_many_arguments)] // one descriptor per tensor of flash_attn_with_kvcache
    pub fn new(
        q: &'a TensorDesc,
        k_cache: &'a TensorDesc,
        v_cache: &'a TensorDesc,
        page_table: &'a TensorDesc,
        seqlens: &'a TensorDesc,
        new_kv: Option<(&'a TensorDesc, &'a TensorDesc)>,
        softmax_scale: Option<f64>,
        causal: bool,
    ) -> Result<Self> {
        let dtype: DType = q.3.parse().map_err(|_| Error::UnsupportedDType(format!("{} for q", q.3)))?;
        let device = q.4;
        let [b, s, h, d] = dims("q", q, 4)?[..] else { unreachable!("4 dims checked") };
        contiguous("q", q)?;
        let kc = dims("k_cache", k_cache, 4)?;
        same("k_cache", k_cache, &kc, ("q", &q.3), device)?;
        same("v_cache", v_cache, &kc, ("q", &q.3), device)?;
        // One buffer under both names would alias the appends to K and V and the reads of both.
        let bytes = (kc.iter().product::<usize>() * dtype.size()) as u64;
        if bytes > 0 && k_cache.0 < v_cache.0.saturating_add(bytes) && v_cache.0 < k_cache.0.saturating_add(bytes) {
            return Err(Error::invalid("v_cache", "overlaps k_cache: the caches must be distinct tensors"));
        }
        let layout = PagedLayout::new(kc[0], kc[1], kc[2], kc[3])?;
        let shape = DecodeShape::new(b, s, h, layout.kv_heads, d)?;
        if kc[3] != d {
            return Err(Error::ShapeMismatch {
                tensor: "k_cache".into(),
                expected: format!("head dim {d} (q's)"),
                got: format!("{:?}", kc),
            });
        }
        let pt = dims("page_table", page_table, 2)?;
        if pt[0] != b || pt[1] == 0 {
            return Err(Error::ShapeMismatch {
                tensor: "page_table".into(),
                expected: format!("[{b}, max_pages ≥ 1]"),
                got: format!("{pt:?}"),
            });
        }
        same("page_table", page_table, &pt, ("required", "int32"), device)?;
        same("cache_seqlens", seqlens, &[b], ("required", "int32"), device)?;
        let mut new_tokens = 0;
        if let Some((k, v)) = new_kv {
            let kn = dims("k", k, 4)?;
            if kn[0] != b || kn[2] != layout.kv_heads || kn[3] != d {
                return Err(Error::ShapeMismatch {
                    tensor: "k".into(),
                    expected: format!("[{b}, new tokens, {}, {d}]", layout.kv_heads),
                    got: format!("{kn:?}"),
                });
            }
            same("k", k, &kn, ("q", &q.3), device)?;
            same("v", v, &kn, ("q", &q.3), device)?;
            new_tokens = kn[1];
        }
        let opts = DecodeOptions { attn: AttnOptions { scale: softmax_scale.map(|x| x as f32) }, causal };
        opts.attn.scale_for(d)?;
        Ok(DecodeCall {
            dtype,
            device,
            shape,
            layout,
            max_pages: pt[1],
            new_tokens,
            opts,
            q,
            k_cache,
            v_cache,
            page_table,
            seqlens,
            new_kv,
        })
    }

    pub fn out_dims(&self) -> ([usize; 4], [usize; 3]) {
        let s = &self.shape;
        ([s.batch, s.q_rows, s.heads, s.head_dim], [s.batch, s.heads, s.q_rows])
    }

    /// Workspace element counts on this call's GPU: (cu_tiles i64, part_o f32, part_lse f32,
    /// counters i32), any contents (the plan writes cu_tiles and zeroes the counters).
    pub fn workspace(&self) -> Result<(usize, usize, usize, usize)> {
        let w = gpu(self.device)?.decode_workspace(self.dtype, &self.shape)?;
        Ok((w.cu_tiles, w.part_o, w.part_lse, w.counters))
    }

    /// Checks a GPU workspace against this call's sizes and gives its addresses.
    fn workspace_ptrs(&self, ws: [&TensorDesc; 4]) -> Result<DecodeWorkspacePtrs> {
        let (n_cu, n_po, n_pl, n_c) = self.workspace()?;
        for (name, t, n, dt) in [
            ("cu_tiles", ws[0], n_cu, "int64"),
            ("part_o", ws[1], n_po, "float32"),
            ("part_lse", ws[2], n_pl, "float32"),
            ("counters", ws[3], n_c, "int32"),
        ] {
            same(name, t, &[n], ("required", dt), self.device)?;
        }
        Ok(DecodeWorkspacePtrs { cu_tiles: ws[0].0, part_o: ws[1].0, part_lse: ws[2].0, counters: ws[3].0 })
    }

    /// Enqueues the step's plan (lengths + `seqlen_new`) into a GPU workspace.
    pub fn plan(&self, seqlen_new: usize, workspace: [&TensorDesc; 4], stream: u64) -> Result<()> {
        if self.device < 0 {
            return Err(Error::invalid("plan", "a plan is made on a GPU; CPU calls plan themselves"));
        }
        let ws = self.workspace_ptrs(workspace)?;
        let gpu = gpu(self.device)?;
        let cap = self.max_pages * self.layout.page_size;
        // SAFETY: the descriptors were checked against this call (shapes, dtypes, device,
        // contiguity; the workspace sized by decode_workspace); `stream` is torch's current
        // stream of this GPU.
        unsafe {
            let s = gpu.borrow_stream(stream);
            gpu.decode_plan_raw(&s, self.dtype, &self.shape, self.seqlens.0, seqlen_new, cap, &ws)
        }
    }

    /// Appends the new K/V (if any) and attends, into `o` and `lse`; on a GPU, in `workspace`,
    /// planned first unless `planned` (a plan of this step already there).
    pub fn run(
        &self,
        o: &TensorDesc,
        lse: &TensorDesc,
        workspace: Option<[&TensorDesc; 4]>,
        planned: bool,
        stream: u64,
    ) -> Result<()> {
        let (od, ld) = self.out_dims();
        same("out", o, &od, ("q", &self.q.3), self.device)?;
        same("lse", lse, &ld, ("required", "float32"), self.device)?;
        if self.device < 0 {
            return match self.dtype {
                DType::F32 => self.cpu::<f32>(o, lse),
                DType::BF16 => self.cpu::<bf16>(o, lse),
                DType::F16 => self.cpu::<f16>(o, lse),
            };
        }
        let workspace = workspace.ok_or_else(|| Error::invalid("workspace", "a GPU decode needs its workspace"))?;
        if !planned {
            self.plan(self.new_tokens, workspace, stream)?;
        }
        let ws = self.workspace_ptrs(workspace)?;
        let gpu = gpu(self.device)?;
        let ptrs = DecodePtrs {
            q: self.q.0,
            k_cache: self.k_cache.0,
            v_cache: self.v_cache.0,
            o: o.0,
            lse: lse.0,
            page_table: self.page_table.0,
            seqlens: self.seqlens.0,
        };
        let step = DecodeStep::paged(self.shape, self.layout, self.max_pages, self.new_tokens, self.opts);
        // SAFETY: every descriptor was checked against this call (shapes, dtypes, device,
        // contiguity; the workspace sized by decode_workspace and planned before the decode, for
        // these lengths and new tokens: the Python layer's contract for `planned`): each address
        // is torch's memory on this GPU, and `stream` is torch's current stream there. The page
        // table and lengths live on the GPU and are the caller's to keep in range (documented:
        // lengths are clamped to the table's row).
        unsafe {
            let s = gpu.borrow_stream(stream);
            if let Some((k, v)) = self.new_kv {
                gpu.append_kv_raw(
                    &s,
                    self.dtype,
                    &ptrs,
                    k.0,
                    v.0,
                    self.shape.batch,
                    self.new_tokens,
                    &self.layout,
                    self.max_pages,
                )?;
            }
            gpu.decode_raw(&s, self.dtype, &ptrs, &ws, &step)
        }
    }

    fn cpu<T: Element>(&self, o: &TensorDesc, lse: &TensorDesc) -> Result<()> {
        // SAFETY: each descriptor was checked (host, contiguous, shape and dtype); the Python
        // layer holds the tensors for the call, and only the caches, O and LSE are written.
        let (table, seqlens) = unsafe { (host::<i32>(self.page_table), host::<i32>(self.seqlens)) };
        let before: Vec<usize> = seqlens
            .iter()
            .map(|&l| usize::try_from(l).map_err(|_| Error::invalid("cache_seqlens", format!("{l} is negative"))))
            .collect::<Result<_>>()?;
        // SAFETY: as above; the caches do not overlap (checked in `new`).
        let (kc, vc) = unsafe { (host_mut::<T>(self.k_cache), host_mut::<T>(self.v_cache)) };
        if let Some((k, v)) = self.new_kv {
            // SAFETY: as above.
            let (k, v) = unsafe { (host::<T>(k), host::<T>(v)) };
            distattn::decode::append_kv(kc, vc, &self.layout, table, &before, k, v, self.new_tokens)?;
        }
        let lengths: Vec<usize> = before.iter().map(|&l| l + self.new_tokens).collect();
        // SAFETY: as above.
        let q = unsafe { host::<T>(self.q) };
        let workers = std::thread::available_parallelism().map_or(1, |n| n.get());
        let cache = PagedCache { k: kc, v: vc, layout: self.layout, page_table: table, lengths: &lengths };
        let out = distattn::decode::decode(q, &cache, &self.shape, &self.opts, workers)?;
        // SAFETY: as above.
        let (o, l) = unsafe { (host_mut::<T>(o), host_mut::<f32>(lse)) };
        T::convert_from_f32(&out.o, o);
        l.copy_from_slice(&out.lse);
        Ok(())
    }
}
