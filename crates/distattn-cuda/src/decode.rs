//! Decode attention on the GPU (see `distattn_core::decode`): a step is planned once on the
//! device from the device's lengths (`decode_plan`: tiles per request, prefix-summed) and every
//! layer's `flash_decode` launch reads that plan; `append_kv` writes new tokens into the paged
//! caches in place. The grid is fixed by the GPU (every SM busy, whatever the batch), so nothing
//! on the host depends on the lengths: a step needs no host round trip and its launches can be
//! captured in a CUDA graph once the kernels are loaded.
//!
//! The raw launchers take device addresses (the caller owns every buffer: PyTorch's tensors in
//! the Python package); [`DecodeBuffers`] holds a step's tensors on the GPU, and
//! [`CudaBackend::decode_host`] runs a step on host slices.

use crate::buffer::GpuBuf;
use crate::compile::{backend_err, KernelConfig};
use crate::device::CudaBackend;
use crate::params::{AppendParams, DecodeParams};
use crate::{driver_err, CudaElement};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
use distattn_core::decode::{DecodeOptions, DecodeShape, PagedCache, PagedLayout, DECODE_BLOCK_ROWS};
use distattn_core::schedule::Lane;
use distattn_core::{AttnOptions, DType, Error, Forward, Result};
use distattn_exec::{Block, Piece};

const LOG2E: f32 = std::f32::consts::LOG2_E;

/// Whether the decode kernel suits a block whose rows keep these key runs: each row reads its
/// run on its own there, so rows sharing keys (a training block's) read them once per row where
/// the flash kernels read them once per tile of rows. Up to 4 reads of each key pay (a decode
/// batch reads each once; a speculative step of 4 rows, 4 times).
pub(crate) fn decode_reads_pay(runs: &[(usize, usize)], k_len: usize) -> bool {
    runs.iter().map(|r| r.1).sum::<usize>() <= 4 * k_len
}

/// Device addresses of a decode step's tensors: Q and O `[batch, q_rows, heads, d]` (bf16 or
/// f16; O f32 with [`DecodeStep::o_f32`]), LSE `[batch, heads, q_rows]` f32, the K and V
/// caches `[pages, page_size, kv_heads, d]`, the page table `[batch, max_pages]` and lengths
/// `[batch]` (i32).
#[derive(Debug, Clone, Copy)]
pub struct DecodePtrs {
    pub q: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub o: u64,
    pub lse: u64,
    pub page_table: u64,
    pub seqlens: u64,
}

/// Device addresses of a step's workspace, sized by [`CudaBackend::decode_workspace`]:
/// `cu_tiles` (i64) and `counters` (i32), written by the plan; `part_o` and `part_lse` (f32),
/// any contents.
#[derive(Debug, Clone, Copy)]
pub struct DecodeWorkspacePtrs {
    pub cu_tiles: u64,
    pub part_o: u64,
    pub part_lse: u64,
    pub counters: u64,
}

/// Element counts of a step's workspace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeWorkspace {
    pub cu_tiles: usize,
    pub part_o: usize,
    pub part_lse: usize,
    pub counters: usize,
    /// Blocks of each decode launch.
    pub blocks: usize,
}

/// What a step attends to: each request has `seqlens[b] + seqlen_add` keys (its cached tokens
/// and the step's new ones), in at most `max_pages` pages of `layout`.
#[derive(Debug, Clone, Copy)]
pub struct DecodeStep {
    pub shape: DecodeShape,
    pub layout: PagedLayout,
    pub max_pages: usize,
    pub seqlen_add: usize,
    pub opts: DecodeOptions,
    /// The page table holds each request's first key row in one contiguous cache (`layout` one
    /// page of all its rows, `max_pages` 1) rather than page numbers.
    pub row_table: bool,
    /// O is written as f32 at [`DecodePtrs::o`] (a distributed step's partial, merged in f32)
    /// rather than in the input dtype.
    pub o_f32: bool,
}

impl DecodeStep {
    /// A step over a paged cache, O in the input dtype.
    pub fn paged(
        shape: DecodeShape,
        layout: PagedLayout,
        max_pages: usize,
        seqlen_add: usize,
        opts: DecodeOptions,
    ) -> DecodeStep {
        DecodeStep { shape, layout, max_pages, seqlen_add, opts, row_table: false, o_f32: false }
    }
}

fn i32_of(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::invalid(what, format!("{v} does not fit the kernels' 32-bit indices")))
}

impl CudaBackend {
    /// The decode kernel's configuration for a dtype and head dim, checked against this GPU.
    fn decode_config(&self, dtype: DType, head_dim: usize) -> Result<KernelConfig> {
        let cfg = self.kernels(dtype, head_dim)?.cfg;
        if cfg.decode_smem() > self.max_smem() {
            return Err(backend_err(format!(
                "decode at head dim {head_dim} needs {} bytes of shared memory, the GPU allows {}",
                cfg.decode_smem(),
                self.max_smem()
            )));
        }
        Ok(cfg)
    }

    /// A block of one key run per row (`runs`, [`Block::row_runs`]) through the decode kernel,
    /// reading K and V in place: each query row (of each batch entry) is a request of one row
    /// whose keys are its run (a row table, no pages). The kernel writes the block's O (f32,
    /// or the inputs' dtype for a final result) directly (rows in the block's order); its LSE
    /// `[batch · q_len, heads]` is the block's `[batch, heads, q_len]` for one query row, else
    /// laid out by a copy.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn block_decode<T: CudaElement>(
        &self,
        block: &Block,
        runs: &[(usize, usize)],
        q: &GpuBuf,
        k: &GpuBuf,
        v: &GpuBuf,
        opts: &AttnOptions,
        o: &mut GpuBuf,
        lse: &mut GpuBuf,
    ) -> Result<()> {
        let sh = &block.shape;
        let rows = sh.batch * sh.q_len;
        let shape = DecodeShape::new(rows, 1, sh.heads, sh.kv_heads, sh.head_dim)?;
        // The row table, then the lengths, as i32 (packed in pairs into the i64 index list).
        let mut ints = Vec::with_capacity(2 * rows + 1);
        for b in 0..sh.batch {
            for &(lo, _) in runs {
                ints.push(i32_of("key row", b * sh.k_len + lo)?);
            }
        }
        for _ in 0..sh.batch {
            for &(_, n) in runs {
                ints.push(i32_of("keys", n)?);
            }
        }
        if ints.len() % 2 == 1 {
            ints.push(0);
        }
        let list = self.indices(Lane::Compute, &bytemuck::pod_collect_to_vec::<i32, i64>(&ints))?;
        let table = self.index_ptr(Lane::Compute, &list);
        let s = self.stream();
        let w = self.decode_workspace(T::DTYPE, &shape)?;
        // Workspace as f32 buffers of the same bytes: cu_tiles is i64, counters i32.
        let ws_bufs = [2 * w.cu_tiles, w.part_o, w.part_lse, w.counters]
            .map(|n| GpuBuf::alloc(s, DType::F32, n.max(1)))
            .into_iter()
            .collect::<Result<Vec<_>>>()?;
        // A step of several query rows per batch entry gets its LSE in the kernel's layout first.
        let lse_t = if sh.q_len == 1 { None } else { Some(GpuBuf::alloc(s, DType::F32, rows * sh.heads)?) };
        let ws = DecodeWorkspacePtrs {
            cu_tiles: ws_bufs[0].ptr(s),
            part_o: ws_bufs[1].ptr(s),
            part_lse: ws_bufs[2].ptr(s),
            counters: ws_bufs[3].ptr(s),
        };
        let ptrs = DecodePtrs {
            q: q.ptr(s),
            k_cache: k.ptr(s),
            v_cache: v.ptr(s),
            o: o.ptr(s),
            lse: lse_t.as_ref().unwrap_or(lse).ptr(s),
            page_table: table,
            seqlens: table + 4 * rows as u64,
        };
        let key_rows = (sh.batch * sh.k_len).max(1);
        let layout = PagedLayout::new(1, key_rows, sh.kv_heads, sh.head_dim)?;
        let opts = DecodeOptions { attn: *opts, causal: false };
        // O is f32, or in the inputs' dtype where it holds a final result.
        let o_f32 = o.dtype() == DType::F32;
        let step = DecodeStep { row_table: true, o_f32, ..DecodeStep::paged(shape, layout, 1, 0, opts) };
        // SAFETY: Q, K, V, O (f32, or T::DTYPE where o_f32 is false) and LSE are the block's
        // buffers ([b, q_len or k_len, heads, d] and [b, heads, q_len], checked by the
        // interpreter), every run inside its batch entry's keys (from the block's mask); the
        // table and lengths were uploaded for the compute stream (`list` and the cache keep
        // them); the workspace (and lse_t) were just allocated on it at decode_workspace's
        // sizes, and everything runs on that stream.
        unsafe {
            self.decode_plan_raw(s, T::DTYPE, &shape, ptrs.seqlens, 0, key_rows, &ws)?;
            self.decode_raw(s, T::DTYPE, &ptrs, &ws, &step)?;
        }
        if let Some(lse_t) = lse_t {
            // LSE [batch · q_len, heads] to [batch, heads, q_len]: a head's column per piece.
            let columns: Vec<Piece> = (0..sh.batch)
                .flat_map(|b| {
                    (0..sh.heads).map(move |h| {
                        Piece::strided(
                            b * sh.q_len * sh.heads + h,
                            (b * sh.heads + h) * sh.q_len,
                            1,
                            sh.q_len,
                            sh.heads,
                            1,
                        )
                    })
                })
                .collect();
            self.run_pieces(Lane::Compute, &lse_t, lse, &columns, false)?;
            lse_t.free_on(s);
        }
        for b in ws_bufs {
            b.free_on(s);
        }
        Ok(())
    }

    /// Blocks of a decode launch: as many as the SMs hold at once (one to a few per SM), fixed
    /// for the GPU.
    pub fn decode_blocks(&self, dtype: DType, head_dim: usize) -> Result<usize> {
        let cfg = self.decode_config(dtype, head_dim)?;
        let per_sm = (self.smem_per_sm() / (cfg.decode_smem() + 1024)).clamp(1, 4);
        Ok((self.sm_count() * per_sm).min(cfg.decode_max_blocks()))
    }

    /// The workspace a step of `shape` needs.
    pub fn decode_workspace(&self, dtype: DType, shape: &DecodeShape) -> Result<DecodeWorkspace> {
        let blocks = self.decode_blocks(dtype, shape.head_dim)?;
        Ok(DecodeWorkspace {
            cu_tiles: shape.batch + 1,
            part_o: 2 * blocks * DECODE_BLOCK_ROWS * shape.head_dim,
            part_lse: 2 * blocks * DECODE_BLOCK_ROWS,
            // A count per segment, and per group of 16 pieces (flash_decode's two-level merge).
            counters: shape.batch * shape.segments_per_request() * (1 + blocks.div_ceil(16)),
            blocks,
        })
    }

    /// Enqueues the step's plan into `ws`: `cu_tiles` from the lengths at `seqlens` (+
    /// `seqlen_add`, clamped to `capacity`), in tiles of the decode kernel of `dtype` and
    /// `head_dim`, and the merge counters zeroed. One plan serves every layer of the step (of
    /// that dtype and head dim).
    ///
    /// # Safety
    /// `seqlens` holds `batch` i32, and `ws` is a workspace of [`CudaBackend::decode_workspace`]
    /// for `shape`, of this context, not used by other work meanwhile; `stream` is of this
    /// context.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn decode_plan_raw(
        &self,
        stream: &CudaStream,
        dtype: DType,
        shape: &DecodeShape,
        seqlens: u64,
        seqlen_add: usize,
        capacity: usize,
        ws: &DecodeWorkspacePtrs,
    ) -> Result<()> {
        let aux = self.aux(dtype)?;
        let (add, batch, cap, tile) = (
            i32_of("new tokens", seqlen_add)?,
            i32_of("batch", shape.batch)?,
            i32_of("cache capacity", capacity)?,
            self.decode_config(dtype, shape.head_dim)?.decode_bn() as i32,
        );
        let n_counters = self.decode_workspace(dtype, shape)?.counters as i64;
        let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let mut launch = stream.launch_builder(&aux.decode_plan);
        launch
            .arg(&seqlens)
            .arg(&add)
            .arg(&batch)
            .arg(&cap)
            .arg(&tile)
            .arg(&ws.cu_tiles)
            .arg(&ws.counters)
            .arg(&n_counters);
        // SAFETY: decode_plan(const int*, int, int, int, int, i64*, int*, i64) gets exactly these
        // arguments; the addresses hold batch, batch + 1 and n_counters elements (this
        // function's contract).
        unsafe { launch.launch(cfg) }.map(|_| ()).map_err(driver_err("launching decode_plan"))
    }

    /// Enqueues decode attention for one layer of a planned step.
    ///
    /// # Safety
    /// Every address is device memory of this context holding what [`DecodePtrs`] and
    /// [`DecodeWorkspacePtrs`] list for `step` (Q, O and the caches 16-byte aligned, the
    /// workspace of [`CudaBackend::decode_workspace`] planned for these lengths by
    /// [`CudaBackend::decode_plan_raw`]), every page-table entry a request's length reaches a page of the
    /// cache, nothing written by other work while the kernel runs; `stream` is of this context.
    pub unsafe fn decode_raw(
        &self,
        stream: &CudaStream,
        dtype: DType,
        t: &DecodePtrs,
        ws: &DecodeWorkspacePtrs,
        step: &DecodeStep,
    ) -> Result<()> {
        let s = &step.shape;
        let cfg = self.decode_config(dtype, s.head_dim)?;
        let kern = self.kernels(dtype, s.head_dim)?;
        let blocks = self.decode_blocks(dtype, s.head_dim)?;
        for (name, p) in [("q", t.q), ("k cache", t.k_cache), ("v cache", t.v_cache), ("o", t.o)] {
            if p == 0 || !p.is_multiple_of(16) {
                return Err(Error::invalid(name, format!("device address {p:#x} is null or not 16-byte aligned")));
            }
        }
        if step.layout.kv_heads != s.kv_heads || step.layout.head_dim != s.head_dim {
            return Err(Error::ShapeMismatch {
                tensor: "KV cache".into(),
                expected: format!("{} KV heads of dim {}", s.kv_heads, s.head_dim),
                got: format!("{} KV heads of dim {}", step.layout.kv_heads, step.layout.head_dim),
            });
        }
        let p = DecodeParams {
            q: t.q,
            k: t.k_cache,
            v: t.v_cache,
            o: t.o,
            lse: t.lse,
            page_table: t.page_table,
            seqlens: t.seqlens,
            cu_tiles: ws.cu_tiles,
            part_o: ws.part_o,
            part_lse: ws.part_lse,
            counters: ws.counters,
            batch: i32_of("batch", s.batch)?,
            q_rows: s.q_rows as i32,
            heads: i32_of("heads", s.heads)?,
            kv_heads: s.kv_heads as i32,
            page_size: i32_of("page size", step.layout.page_size)?,
            max_pages: i32_of("pages per request", step.max_pages)?,
            segs_per_request: i32_of("segments", s.segments_per_request())?,
            seqlen_add: i32_of("new tokens", step.seqlen_add)?,
            causal: step.opts.causal as i32,
            page_shift: if step.layout.page_size.is_power_of_two() {
                step.layout.page_size.trailing_zeros() as i32
            } else {
                -1
            },
            scale_log2: step.opts.attn.scale_for(s.head_dim)? * LOG2E,
            row_table: step.row_table as i32,
            o_f32: step.o_f32 as i32,
            pad_: 0,
        };
        i32_of("cache capacity", step.max_pages * step.layout.page_size)?;
        let launch_cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (cfg.decode_threads() as u32, 1, 1),
            shared_mem_bytes: cfg.decode_smem() as u32,
        };
        let mut launch = stream.launch_builder(&kern.decode);
        launch.arg(&p);
        // SAFETY: flash_decode takes DecodeParams by value (layout asserted against params.cuh
        // at every compile); its addresses hold what the step says (this function's contract),
        // the grid has at most decode_max_blocks blocks (the merge's shared memory) and the
        // workspace was sized for that many.
        unsafe { launch.launch(launch_cfg) }.map(|_| ()).map_err(driver_err("launching flash_decode"))
    }

    /// Enqueues the append of `new_tokens` tokens per request (`k_new`, `v_new` `[batch,
    /// new_tokens, kv_heads, d]`, contiguous) at positions `seqlens[b]..` of the caches; tokens
    /// past a request's `max_pages` pages are dropped.
    ///
    /// # Safety
    /// As [`CudaBackend::decode_raw`] for the caches, page table and lengths; `k_new` and `v_new`
    /// hold `batch × new_tokens × kv_heads × d` elements, 16-byte aligned.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn append_kv_raw(
        &self,
        stream: &CudaStream,
        dtype: DType,
        t: &DecodePtrs,
        k_new: u64,
        v_new: u64,
        batch: usize,
        new_tokens: usize,
        layout: &PagedLayout,
        max_pages: usize,
    ) -> Result<()> {
        let aux = self.aux(dtype)?;
        for (name, p) in [("k", k_new), ("v", v_new), ("k cache", t.k_cache), ("v cache", t.v_cache)] {
            if p == 0 || !p.is_multiple_of(16) {
                return Err(Error::invalid(name, format!("device address {p:#x} is null or not 16-byte aligned")));
            }
        }
        // A token's K (or V) row moves in 16-byte chunks of 8 elements.
        if !(layout.kv_heads * layout.head_dim).is_multiple_of(8) {
            return Err(Error::invalid(
                "head dim",
                format!("{} KV heads x head dim {}: not whole 16-byte chunks", layout.kv_heads, layout.head_dim),
            ));
        }
        let row_chunks = layout.kv_heads * layout.head_dim / 8;
        let chunks = batch * new_tokens * row_chunks;
        if chunks == 0 {
            return Ok(());
        }
        let p = AppendParams {
            k_new,
            v_new,
            k_cache: t.k_cache,
            v_cache: t.v_cache,
            page_table: t.page_table,
            seqlens: t.seqlens,
            chunks: chunks as i64,
            new_tokens: i32_of("new tokens", new_tokens)?,
            row_chunks: i32_of("KV row", row_chunks)?,
            page_size: i32_of("page size", layout.page_size)?,
            max_pages: i32_of("pages per request", max_pages)?,
        };
        let cfg =
            LaunchConfig { grid_dim: (chunks.div_ceil(256) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let mut launch = stream.launch_builder(&aux.append_kv);
        launch.arg(&p);
        // SAFETY: append_kv takes AppendParams by value (layout asserted at every compile); the
        // grid covers `chunks` threads, each copying one 16-byte chunk within the buffers the
        // contract describes.
        unsafe { launch.launch(cfg) }.map(|_| ()).map_err(driver_err("launching append_kv"))
    }

    /// One decode step on host slices (uploaded, run on the compute stream, downloaded): O in
    /// f32 and LSE, as `distattn_cpu::decode::decode` returns them.
    pub fn decode_host<T: CudaElement>(
        &self,
        q: &[T],
        cache: &PagedCache<'_, T>,
        shape: &DecodeShape,
        opts: &DecodeOptions,
    ) -> Result<Forward> {
        let step = DecodeBuffers::upload(self, q, cache, shape, opts)?;
        step.plan(self)?;
        step.run(self)?;
        let down = driver_err("downloading decode results");
        let st = self.stream();
        let o: Vec<T> = st.clone_dtoh(&step.o).map_err(&down)?;
        let lse = st.clone_dtoh(&step.lse).map_err(&down)?;
        self.synchronize()?;
        Ok(Forward { o: o.iter().map(|x| x.to_f32()).collect(), lse })
    }
}

/// A decode step's tensors on this GPU, uploaded from host slices and checked: planned once
/// ([`DecodeBuffers::plan`]), then run as often as there are layers ([`DecodeBuffers::run`]).
pub struct DecodeBuffers<T: CudaElement> {
    q: CudaSlice<T>,
    k_cache: CudaSlice<T>,
    v_cache: CudaSlice<T>,
    page_table: CudaSlice<i32>,
    seqlens: CudaSlice<i32>,
    /// O `[batch, q_rows, heads, d]`, poisoned with NaN until a run writes it.
    pub o: CudaSlice<T>,
    /// LSE `[batch, heads, q_rows]`, natural log, NaN until a run writes it.
    pub lse: CudaSlice<f32>,
    cu_tiles: CudaSlice<i64>,
    part_o: CudaSlice<f32>,
    part_lse: CudaSlice<f32>,
    counters: CudaSlice<i32>,
    step: DecodeStep,
}

impl<T: CudaElement> DecodeBuffers<T> {
    /// Checks the step (lengths within their pages, every page they reach in the cache) and
    /// uploads it to `gpu`'s compute stream.
    pub fn upload(
        gpu: &CudaBackend,
        q: &[T],
        cache: &PagedCache<'_, T>,
        shape: &DecodeShape,
        opts: &DecodeOptions,
    ) -> Result<Self> {
        shape.check_q("q", q.len())?;
        cache.check(shape)?;
        let st = gpu.stream();
        let up = driver_err("uploading decode inputs");
        let step = DecodeStep::paged(*shape, cache.layout, cache.max_pages(), 0, *opts);
        let [q, k, v] = [q, cache.k, cache.v].map(|x| st.clone_htod(x).map_err(&up));
        Self::with_inputs(gpu, [q?, k?, v?], cache.page_table, cache.lengths, step)
    }

    /// A step over caches of random values in [-1.7, 1.7) made on the GPU (only the page table
    /// and lengths cross from the host): request b has `lengths[b]` keys in its own pages of
    /// `page_size`, in order. For timing contexts whose host copy would be too large.
    pub fn random(
        gpu: &CudaBackend,
        shape: &DecodeShape,
        page_size: usize,
        lengths: &[usize],
        opts: &DecodeOptions,
        seed: u64,
    ) -> Result<Self> {
        if lengths.len() != shape.batch {
            return Err(Error::invalid("lengths", format!("{} for a batch of {}", lengths.len(), shape.batch)));
        }
        let max_pages = lengths.iter().map(|l| l.div_ceil(page_size.max(1))).max().unwrap_or(0).max(1);
        let layout = PagedLayout::new(shape.batch * max_pages, page_size, shape.kv_heads, shape.head_dim)?;
        let table: Vec<i32> = (0..shape.batch * max_pages).map(|p| i32_of("page", p)).collect::<Result<_>>()?;
        let st = gpu.stream();
        let aux = gpu.aux(T::DTYPE)?;
        let random = |n: usize, seed: u64| -> Result<CudaSlice<T>> {
            let x = st.alloc_zeros::<T>(n.max(1)).map_err(driver_err("allocating a random decode step"))?;
            // SAFETY: `x` holds n (at least one) values of T, the module's type, on this stream.
            unsafe { aux.rand_fill(st, x.device_ptr(st).0, n, seed, 1.7)? };
            Ok(x)
        };
        let inputs =
            [random(shape.q_elems(), seed)?, random(layout.elems(), seed ^ 1)?, random(layout.elems(), seed ^ 2)?];
        let step = DecodeStep::paged(*shape, layout, max_pages, 0, *opts);
        Self::with_inputs(gpu, inputs, &table, lengths, step)
    }

    /// The step's buffers around Q, K and V already on the GPU: the page table and lengths
    /// uploaded, O and LSE poisoned with NaN, the workspace allocated.
    fn with_inputs(
        gpu: &CudaBackend,
        [q, k_cache, v_cache]: [CudaSlice<T>; 3],
        page_table: &[i32],
        lengths: &[usize],
        step: DecodeStep,
    ) -> Result<Self> {
        let lens: Vec<i32> = lengths.iter().map(|&l| i32_of("cache length", l)).collect::<Result<_>>()?;
        let st = gpu.stream();
        let up = driver_err("uploading decode inputs");
        let alloc = driver_err("allocating the decode workspace");
        let w = gpu.decode_workspace(T::DTYPE, &step.shape)?;
        Ok(DecodeBuffers {
            q,
            k_cache,
            v_cache,
            page_table: st.clone_htod(page_table).map_err(&up)?,
            seqlens: st.clone_htod(&lens).map_err(&up)?,
            o: st.clone_htod(&vec![T::from_f32(f32::NAN); step.shape.q_elems()]).map_err(&up)?,
            lse: st.clone_htod(&vec![f32::NAN; step.shape.lse_elems()]).map_err(&up)?,
            cu_tiles: st.alloc_zeros::<i64>(w.cu_tiles).map_err(&alloc)?,
            part_o: st.alloc_zeros::<f32>(w.part_o).map_err(&alloc)?,
            part_lse: st.alloc_zeros::<f32>(w.part_lse).map_err(&alloc)?,
            counters: st.alloc_zeros::<i32>(w.counters).map_err(&alloc)?,
            step,
        })
    }

    fn ptrs(&self, st: &CudaStream) -> (DecodePtrs, DecodeWorkspacePtrs) {
        (
            DecodePtrs {
                q: self.q.device_ptr(st).0,
                k_cache: self.k_cache.device_ptr(st).0,
                v_cache: self.v_cache.device_ptr(st).0,
                o: self.o.device_ptr(st).0,
                lse: self.lse.device_ptr(st).0,
                page_table: self.page_table.device_ptr(st).0,
                seqlens: self.seqlens.device_ptr(st).0,
            },
            DecodeWorkspacePtrs {
                cu_tiles: self.cu_tiles.device_ptr(st).0,
                part_o: self.part_o.device_ptr(st).0,
                part_lse: self.part_lse.device_ptr(st).0,
                counters: self.counters.device_ptr(st).0,
            },
        )
    }

    /// Enqueues the step's plan on the compute stream.
    pub fn plan(&self, gpu: &CudaBackend) -> Result<()> {
        let st = gpu.stream();
        let (t, ws) = self.ptrs(st);
        let s = &self.step;
        // SAFETY: the buffers were allocated on this stream for this step (upload), the
        // workspace by decode_workspace.
        unsafe { gpu.decode_plan_raw(st, T::DTYPE, &s.shape, t.seqlens, 0, s.max_pages * s.layout.page_size, &ws) }
    }

    /// Enqueues decode attention of the planned step on the compute stream (one layer's).
    pub fn run(&self, gpu: &CudaBackend) -> Result<()> {
        let st = gpu.stream();
        let (t, ws) = self.ptrs(st);
        // SAFETY: as in `plan` (which the caller ran first: the workspace is planned), the table
        // checked by check_cache.
        unsafe { gpu.decode_raw(st, T::DTYPE, &t, &ws, &self.step) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_decode_kernel_takes_blocks_that_read_each_key_a_few_times() {
        // A batch of requests, disjoint runs; 4 rows of one request on the same keys.
        assert!(decode_reads_pay(&[(0, 100), (100, 50), (150, 0)], 150));
        assert!(decode_reads_pay(&[(0, 97), (0, 98), (0, 99), (0, 100)], 100));
        // A training block's 64 causal rows over the same keys: the flash kernels.
        let causal: Vec<(usize, usize)> = (0..64).map(|i| (0, 1000 + i)).collect();
        assert!(!decode_reads_pay(&causal, 1064));
    }
}
