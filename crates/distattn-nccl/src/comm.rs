//! The NCCL communicator: [`NcclComm`] implements [`Communicator`] over device buffers, on the
//! comm lane (stream) of the [`CudaBackend`] it serves.
//!
//! Communicators are created **non-blocking** (`ncclConfig_t.blocking = 0`): every NCCL call
//! returns at once and its completion is polled (`ncclCommGetAsyncError`), so no host thread
//! ever sits inside NCCL. A watchdog thread per rank polls the communicator's asynchronous
//! error, the in-process group's failure flag (thread ranks) and a stall deadline; on any of
//! them it calls `ncclCommAbort`, which also ends NCCL kernels spinning on a dead peer, and
//! every later or pending call of that rank returns an error naming the failed rank. In
//! process mode the peers' process ids are exchanged at start-up through NCCL itself, so a rank
//! that finds a stall can tell which peer process is gone.
//!
//! All-to-all is a group of sends and receives. Point-to-point groups, collectives and barriers
//! are enqueued on the backend's comm stream ([`NcclComm::stream`]); groups return once
//! enqueued (the interpreter orders the streams with events), collectives once complete.

use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use cudarc::nccl::sys as nsys;
use distattn_core::{Error, Result};
use distattn_cuda::{driver_err, CudaBackend, GpuBuf};
use distattn_exec::{Communicator, Completion};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Failure shared by the thread-ranks of one process (first one wins).
#[derive(Default, Debug)]
pub struct GroupState {
    failed: Mutex<Option<(usize, String)>>,
}

impl GroupState {
    pub fn fail(&self, rank: usize, reason: &str) {
        let mut f = self.failed.lock().unwrap_or_else(|e| e.into_inner());
        if f.is_none() {
            *f = Some((rank, reason.to_string()));
        }
    }
    pub fn failure(&self) -> Option<(usize, String)> {
        self.failed.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// NCCL's unique id, shareable between threads.
#[derive(Clone, Copy)]
pub struct UniqueId(pub nsys::ncclUniqueId);

impl UniqueId {
    /// The id's bytes, to send to the other ranks over another channel (a PyTorch process
    /// group, a file, a key-value store).
    pub fn to_bytes(&self) -> Vec<u8> {
        self.0.internal.iter().map(|&c| c as u8).collect()
    }

    /// The id from [`UniqueId::to_bytes`]'s bytes.
    pub fn from_bytes(bytes: &[u8]) -> Result<UniqueId> {
        // SAFETY: ncclUniqueId is plain bytes, for which all zeros is a valid value.
        let mut id: nsys::ncclUniqueId = unsafe { std::mem::zeroed() };
        if bytes.len() != id.internal.len() {
            return Err(Error::invalid(
                "NCCL unique id",
                format!("{} bytes, expected {}", bytes.len(), id.internal.len()),
            ));
        }
        for (d, &b) in id.internal.iter_mut().zip(bytes) {
            *d = b as _;
        }
        Ok(UniqueId(id))
    }
}

// The id is 128 plain bytes, so it is Send and Sync without an unsafe impl; this stops the
// build if a binding ever changes that.
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<UniqueId>()
};

/// The communicator, used only with the `Inner::handle` lock held.
struct Handle {
    comm: nsys::ncclComm_t,
    aborted: bool,
}
// SAFETY: an NCCL communicator is not tied to the thread that created it; what NCCL asks is that
// calls on one communicator do not run concurrently, and every call on `comm` is made with the
// `Mutex<Handle>` that holds it locked (or, in `init`, before it is shared).
unsafe impl Send for Handle {}

struct Inner {
    rank: usize,
    world: usize,
    handle: Mutex<Handle>,
    group: Option<Arc<GroupState>>,
    /// Process ids of the ranks whose processes this one can look up (same host and PID
    /// namespace: [`pids_seen_here`]), 0 for the others (process mode).
    pids: Mutex<Vec<u32>>,
    timeout: Duration,
    /// Start of the wait in progress (stall detection).
    busy_since: Mutex<Option<Instant>>,
    /// A run the host no longer waits for ([`NcclComm::watch`]), polled by the watchdog.
    watched: Mutex<Option<Completion<CudaEvent>>>,
    failure: Mutex<Option<Error>>,
    stop: AtomicBool,
}

fn nccl_str(r: nsys::ncclResult_t) -> String {
    // SAFETY: ncclGetErrorString takes any result code and returns null or a static
    // NUL-terminated string, which is read only when the pointer is not null.
    unsafe {
        let p = nsys::ncclGetErrorString(r);
        if p.is_null() {
            format!("{r:?}")
        } else {
            format!("{r:?} ({})", std::ffi::CStr::from_ptr(p).to_string_lossy())
        }
    }
}

/// This process's view of process ids, as a key: a hash (FNV-1a) of the host's boot id and of
/// its PID namespace. Two ranks with the same key see each other's pids in `/proc`; a rank on
/// another host (or in another container) does not, and its pid must not be looked up here.
fn proc_view_key() -> u64 {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let ns = std::fs::read_link("/proc/self/ns/pid").map(|p| p.display().to_string()).unwrap_or_default();
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in boot.trim().bytes().chain([0]).chain(ns.bytes()) {
        h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Every rank's pid from the all-gathered (pid, key low, key high) triples, 0 (not looked up)
/// for ranks whose key differs from `key` (another host's or container's processes).
fn pids_seen_here(triples: &[u32], key: u64) -> Vec<u32> {
    triples.chunks_exact(3).map(|t| if (t[1] as u64 | (t[2] as u64) << 32) == key { t[0] } else { 0 }).collect()
}

/// Whether process `pid` has exited (or is a zombie).
pub fn process_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(s) => s.rsplit_once(')').map(|(_, rest)| rest.trim_start().starts_with(['Z', 'X'])).unwrap_or(false),
    }
}

/// How long a pending NCCL call is polled without sleeping before the poll backs off.
const SETTLE_SPIN: Duration = Duration::from_millis(2);

impl Inner {
    fn failure(&self) -> Option<Error> {
        self.failure.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Aborts the communicator (once) and records `err` as this rank's failure.
    fn abort_with(&self, err: Error) -> Error {
        {
            let mut f = self.failure.lock().unwrap_or_else(|e| e.into_inner());
            if f.is_none() {
                *f = Some(err.clone());
            }
        }
        let mut h = self.handle.lock().unwrap_or_else(|e| e.into_inner());
        if !h.aborted && !h.comm.is_null() {
            h.aborted = true;
            // SAFETY: `h.comm` is the live communicator from `init`: not null and not yet
            // aborted (Drop aborts too and sets `aborted`, checked above). The lock is held, so no
            // other call on it runs meanwhile, and every later use sees `aborted` and stops.
            unsafe {
                let _ = nsys::ncclCommAbort(h.comm);
            }
        }
        h.aborted = true;
        self.failure().unwrap_or(err)
    }

    /// Peers whose process is gone (process mode).
    fn dead_peers(&self) -> Vec<usize> {
        let pids = self.pids.lock().unwrap_or_else(|e| e.into_inner());
        (0..pids.len()).filter(|&r| r != self.rank && pids[r] != 0 && process_gone(pids[r])).collect()
    }

    fn peer_failure(&self, what: String) -> Error {
        let dead = self.dead_peers();
        if let Some(&d) = dead.first() {
            let pid = self.pids.lock().map(|p| p[d]).unwrap_or(0);
            Error::RankFailed { rank: d, reason: format!("process {pid} is gone ({what}; seen by rank {})", self.rank) }
        } else {
            Error::Comm(format!("rank {}: {what}", self.rank))
        }
    }

    /// Restarts the stall clock if it runs.
    fn busy_progress(&self) {
        let mut b = self.busy_since.lock().unwrap_or_else(|e| e.into_inner());
        if b.is_some() {
            *b = Some(Instant::now());
        }
    }

    fn busy_end(&self) {
        *self.busy_since.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// Advances the watched run: each block seen complete restarts the stall clock, and its
    /// end stops it and drops the run. Whether no run is left to watch.
    fn poll_watched(&self) -> Result<bool> {
        let mut w = self.watched.lock().unwrap_or_else(|e| e.into_inner());
        let Some(c) = w.as_mut() else { return Ok(true) };
        let query = |e: &CudaEvent| e.try_is_complete().map_err(driver_err("waiting for the GPU"));
        if query(&c.end)? {
            if c.watching {
                self.busy_end();
            }
            *w = None;
            return Ok(true);
        }
        while c.done < c.progress.len() && query(&c.progress[c.done])? {
            c.done += 1;
            self.busy_progress();
        }
        Ok(false)
    }

    /// Checks every failure source; aborts on the first found.
    fn check(&self) -> Result<()> {
        if let Some(e) = self.failure() {
            return Err(e);
        }
        if let Some((r, reason)) = self.group.as_ref().and_then(|g| g.failure()) {
            if r != self.rank {
                return Err(self.abort_with(Error::RankFailed { rank: r, reason }));
            }
        }
        let async_err = {
            let h = self.handle.lock().unwrap_or_else(|e| e.into_inner());
            if h.aborted {
                None
            } else {
                let mut st = nsys::ncclResult_t::ncclSuccess;
                // SAFETY: `h.comm` is live: every abort (abort_with, Drop) happens under this
                // lock and marks the handle aborted, checked above with the lock held; `st` is a
                // local the call writes.
                let r = unsafe { nsys::ncclCommGetAsyncError(h.comm, &mut st) };
                if r != nsys::ncclResult_t::ncclSuccess {
                    Some(r)
                } else if st != nsys::ncclResult_t::ncclSuccess && st != nsys::ncclResult_t::ncclInProgress {
                    Some(st)
                } else {
                    None
                }
            }
        };
        if let Some(e) = async_err {
            let err = self.peer_failure(format!("NCCL reported {}", nccl_str(e)));
            if let Some(g) = &self.group {
                g.fail(self.rank, &err.to_string());
            }
            return Err(self.abort_with(err));
        }
        let since = *self.busy_since.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(t0) = since {
            if t0.elapsed() > self.timeout {
                let err = self.peer_failure(format!(
                    "communication stalled for more than {:?}; communicator aborted",
                    self.timeout
                ));
                if let Some(g) = &self.group {
                    g.fail(self.rank, &err.to_string());
                }
                return Err(self.abort_with(err));
            }
        }
        Ok(())
    }

    /// Polls until the communicator's pending operation is no longer in progress.
    fn settle(&self, what: &str) -> Result<()> {
        let t0 = Instant::now();
        loop {
            let st = {
                let h = self.handle.lock().unwrap_or_else(|e| e.into_inner());
                if h.aborted {
                    drop(h);
                    return Err(self.failure().unwrap_or_else(|| Error::Comm("communicator aborted".into())));
                }
                let mut st = nsys::ncclResult_t::ncclSuccess;
                // SAFETY: as in `check`: `h.comm` is live (not aborted, checked above), the lock
                // is held, and `st` is a local the call writes.
                let r = unsafe { nsys::ncclCommGetAsyncError(h.comm, &mut st) };
                if r != nsys::ncclResult_t::ncclSuccess {
                    r
                } else {
                    st
                }
            };
            match st {
                nsys::ncclResult_t::ncclSuccess => return Ok(()),
                nsys::ncclResult_t::ncclInProgress => {
                    if t0.elapsed() > self.timeout {
                        let err = self.peer_failure(format!("{what} still in progress after {:?}", self.timeout));
                        if let Some(g) = &self.group {
                            g.fail(self.rank, &err.to_string());
                        }
                        return Err(self.abort_with(err));
                    }
                    if let Some((r, reason)) = self.group.as_ref().and_then(|g| g.failure()) {
                        if r != self.rank {
                            return Err(self.abort_with(Error::RankFailed { rank: r, reason }));
                        }
                    }
                    // A group settles within tens of microseconds: poll without sleeping at
                    // first (a sleep costs 50–100 µs, which a decode step paid per group).
                    if t0.elapsed() < SETTLE_SPIN {
                        std::thread::yield_now();
                    } else {
                        std::thread::sleep(Duration::from_micros(50));
                    }
                }
                e => {
                    let err = self.peer_failure(format!("{what}: {}", nccl_str(e)));
                    if let Some(g) = &self.group {
                        g.fail(self.rank, &err.to_string());
                    }
                    return Err(self.abort_with(err));
                }
            }
        }
    }
}

/// One rank's NCCL communicator on one GPU.
pub struct NcclComm {
    inner: Arc<Inner>,
    ctx: Arc<CudaContext>,
    /// The backend's comm lane: every NCCL call is enqueued here.
    stream: Arc<CudaStream>,
    /// The backend's compute lane: blocking calls first wait for the work enqueued on it.
    producer: Arc<CudaStream>,
    watchdog: Option<JoinHandle<()>>,
}

/// Makes sure NVLink multicast stays off (shared machines) unless the caller set it.
pub fn nccl_env_defaults() {
    if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
        std::env::set_var("NCCL_NVLS_ENABLE", "0");
    }
}

/// Whether the NCCL library can be loaded (`libnccl.so` must be on the loader path; link
/// `libnccl.so.2` under that name if only the versioned file exists).
pub fn nccl_available() -> bool {
    // SAFETY: only opens libnccl by the names cudarc knows, to see whether it loads, and drops
    // the handle; opening it runs its initialisers, as the first NCCL call would.
    unsafe { nsys::is_culib_present() }
}

fn check_lib() -> Result<()> {
    if !nccl_available() {
        return Err(Error::Backend {
            backend: "nccl",
            reason: "libnccl.so could not be loaded: put a directory holding libnccl.so (a link to libnccl.so.2 will do) on LD_LIBRARY_PATH".into(),
        });
    }
    Ok(())
}

/// A fresh unique id (thread mode: shared by the ranks of this process).
pub fn unique_id() -> Result<UniqueId> {
    nccl_env_defaults();
    check_lib()?;
    let mut id = std::mem::MaybeUninit::<nsys::ncclUniqueId>::uninit();
    // SAFETY: the library loads (check_lib above) and `id` is a local with room for the
    // ncclUniqueId the call writes.
    let r = unsafe { nsys::ncclGetUniqueId(id.as_mut_ptr()) };
    if r != nsys::ncclResult_t::ncclSuccess {
        return Err(Error::Comm(format!("ncclGetUniqueId: {}", nccl_str(r))));
    }
    // SAFETY: ncclGetUniqueId succeeded, so it wrote the whole id (128 plain bytes).
    Ok(UniqueId(unsafe { id.assume_init() }))
}

fn config() -> nsys::ncclConfig_t {
    let undef = i32::MIN;
    nsys::ncclConfig_t {
        size: std::mem::size_of::<nsys::ncclConfig_t>(),
        magic: 0xcafebeef,
        version: 22800,
        blocking: 0,
        cgaClusterSize: undef,
        minCTAs: undef,
        maxCTAs: undef,
        netName: std::ptr::null(),
        splitShare: undef,
        trafficClass: undef,
        commName: std::ptr::null(),
        collnetEnable: undef,
        CTAPolicy: undef,
        shrinkShare: undef,
        nvlsCTAs: undef,
        nChannelsPerNetPeer: undef,
        nvlinkCentricSched: undef,
    }
}

impl NcclComm {
    /// Rank `rank` of `world` on `gpu`'s device and comm lane, joining the communicator of
    /// `id` (every rank must call this concurrently). Thread ranks pass their process's
    /// [`GroupState`].
    pub fn init(
        gpu: &CudaBackend,
        rank: usize,
        world: usize,
        id: UniqueId,
        group: Option<Arc<GroupState>>,
        timeout: Duration,
    ) -> Result<NcclComm> {
        nccl_env_defaults();
        check_lib()?;
        let ctx = gpu.context();
        ctx.bind_to_thread().map_err(driver_err("binding the context"))?;
        let mut comm: nsys::ncclComm_t = std::ptr::null_mut();
        let mut cfg = config();
        // SAFETY: the library loads (check_lib above); the call writes the handle into the local
        // `comm` and reads the local `cfg`, a complete ncclConfig_t of this binding with the
        // size, magic and version NCCL checks (`config`); the id is passed by value; this thread
        // has the GPU's context current.
        let mut r = unsafe { nsys::ncclCommInitRankConfig(&mut comm, world as i32, id.0, rank as i32, &mut cfg) };
        if r == nsys::ncclResult_t::ncclInvalidArgument || r == nsys::ncclResult_t::ncclInvalidUsage {
            // A library that rejects this config layout (older than the binding): a blocking
            // communicator. It works, but without the non-blocking one's guarantees: its
            // initialisation waits for every rank unbounded (a peer that never joins hangs this
            // one), and a call that blocks holds the handle the watchdog would abort it through.
            eprintln!(
                "rank {rank}: ncclCommInitRankConfig rejected the non-blocking config ({}); using ncclCommInitRank",
                nccl_str(r)
            );
            comm = std::ptr::null_mut();
            // SAFETY: as above, without a config.
            r = unsafe { nsys::ncclCommInitRank(&mut comm, world as i32, id.0, rank as i32) };
        }
        if r != nsys::ncclResult_t::ncclSuccess && r != nsys::ncclResult_t::ncclInProgress {
            return Err(Error::Comm(format!("rank {rank}: ncclCommInitRankConfig: {}", nccl_str(r))));
        }
        let inner = Arc::new(Inner {
            rank,
            world,
            handle: Mutex::new(Handle { comm, aborted: false }),
            group,
            pids: Mutex::new(vec![0; world]),
            timeout,
            busy_since: Mutex::new(None),
            watched: Mutex::new(None),
            failure: Mutex::new(None),
            stop: AtomicBool::new(false),
        });
        inner.settle("communicator initialisation")?;
        let mut c = NcclComm {
            inner,
            ctx: ctx.clone(),
            stream: gpu.comm_stream().clone(),
            producer: gpu.stream().clone(),
            watchdog: None,
        };
        c.exchange_pids()?;
        c.start_watchdog();
        Ok(c)
    }

    fn exchange_pids(&mut self) -> Result<()> {
        let w = self.inner.world;
        let key = proc_view_key();
        // Sent as the bits of f32s (the element types are those of attention): the pid and the
        // two halves of the key.
        let mine = [std::process::id(), key as u32, (key >> 32) as u32].map(f32::from_bits);
        let send = GpuBuf::upload::<f32>(&self.stream, &mine)?;
        let mut recv = GpuBuf::alloc(&self.stream, distattn_core::DType::F32, 3 * w)?;
        self.all_gather(&send, &mut recv)?;
        let got: Vec<u32> = recv.download_f32(&self.stream)?.iter().map(|x| x.to_bits()).collect();
        *self.inner.pids.lock().unwrap_or_else(|e| e.into_inner()) = pids_seen_here(&got, key);
        Ok(())
    }

    fn start_watchdog(&mut self) {
        let (inner, ctx) = (self.inner.clone(), self.ctx.clone());
        self.watchdog = Some(std::thread::spawn(move || {
            // Event queries of the watched run, on this GPU's context.
            let _ = ctx.bind_to_thread();
            while !inner.stop.load(Ordering::Relaxed) {
                if inner.failure().is_some() {
                    break;
                }
                if let Err(e) = inner.poll_watched() {
                    inner.abort_with(e);
                    break;
                }
                let _ = inner.check();
                std::thread::sleep(Duration::from_millis(20));
            }
        }));
    }

    /// Takes over the completion of a run issued with [`distattn_exec::execute_deferred`]:
    /// the watchdog follows its blocks under the stall clock (a stuck run aborts the
    /// communicator, which ends its NCCL kernels, so nothing waiting on the device hangs), and
    /// the next run on this communicator, or [`Communicator::settle`], waits for it and reports
    /// its failure. One run at a time: an earlier one is settled first.
    pub fn watch(&self, run: Completion<CudaEvent>) -> Result<()> {
        self.settle_watched()?;
        *self.inner.watched.lock().unwrap_or_else(|e| e.into_inner()) = Some(run);
        Ok(())
    }

    /// Waits for the watched run, if any, polling for failures and stalls.
    fn settle_watched(&self) -> Result<()> {
        loop {
            // A failure seen meanwhile (the watchdog's abort of a stuck run) comes first.
            let r = self.inner.check().and_then(|_| self.inner.poll_watched());
            match r {
                Ok(true) => return Ok(()),
                Ok(false) => std::thread::sleep(Duration::from_micros(20)),
                Err(e) => {
                    // The run will not complete as planned; the abort ended its transfers.
                    if self.inner.watched.lock().unwrap_or_else(|e| e.into_inner()).take().is_some_and(|c| c.watching) {
                        self.busy_end();
                    }
                    return Err(e);
                }
            }
        }
    }

    /// The stream NCCL operations are enqueued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The failure this rank has seen, if any.
    pub fn failure(&self) -> Option<Error> {
        self.inner.failure()
    }

    /// Runs `f` (NCCL calls on the raw communicator) under the handle lock, then waits until
    /// NCCL has taken the operation (non-blocking communicators may answer "in progress"). `f`
    /// gets the communicator only when it is live (not aborted), with this GPU's context current
    /// and the lock held, so no other thread calls NCCL on it meanwhile.
    fn enqueue(&self, what: &str, f: impl FnOnce(nsys::ncclComm_t) -> nsys::ncclResult_t) -> Result<()> {
        self.inner.check()?;
        let r = {
            let h = self.inner.handle.lock().unwrap_or_else(|e| e.into_inner());
            if h.aborted {
                drop(h);
                return Err(self.inner.failure().unwrap_or_else(|| Error::Comm("communicator aborted".into())));
            }
            self.ctx.bind_to_thread().map_err(driver_err("binding the context"))?;
            f(h.comm)
        };
        match r {
            nsys::ncclResult_t::ncclSuccess => Ok(()),
            nsys::ncclResult_t::ncclInProgress => self.inner.settle(what),
            e => {
                let err = self.inner.peer_failure(format!("{what}: {}", nccl_str(e)));
                if let Some(g) = &self.inner.group {
                    g.fail(self.inner.rank, &err.to_string());
                }
                Err(self.inner.abort_with(err))
            }
        }
    }

    /// Enqueues a group of sends and receives on the comm stream and returns without waiting
    /// for the transfer (the interpreter orders the streams with events).
    ///
    /// # Safety
    /// As [`Communicator::group`]: the buffers stay alive, the sends unwritten and the receives
    /// untouched, until work ordered after the comm stream.
    unsafe fn post_group(&self, sends: &[(usize, &GpuBuf)], recvs: &[(usize, &GpuBuf)]) -> Result<()> {
        let s = &self.stream;
        let w = self.inner.world;
        for &(p, _) in sends.iter().chain(recvs) {
            if p >= w {
                return Err(Error::Comm(format!("rank {} addresses rank {p} of a world of {w}", self.inner.rank)));
            }
        }
        let sends: Vec<(i32, u64, usize)> =
            sends.iter().filter(|x| x.1.bytes() > 0).map(|&(p, b)| (p as i32, b.ptr(s), b.bytes())).collect();
        let recvs: Vec<(i32, u64, usize)> =
            recvs.iter().filter(|x| x.1.bytes() > 0).map(|&(p, b)| (p as i32, b.ptr(s), b.bytes())).collect();
        if sends.is_empty() && recvs.is_empty() {
            return Ok(());
        }
        let cs = s.cu_stream() as nsys::cudaStream_t;
        // SAFETY: `comm` is live and used by this thread alone (see `enqueue`). Each send reads and
        // each receive writes `n` bytes at the address of a GpuBuf of exactly `n` bytes on this
        // GPU, to or from a peer below `world` (checked above), on the comm stream `cs`. The group
        // returns once enqueued: by this function's contract the caller frees and touches those
        // buffers only on work ordered after this stream's transfers.
        self.enqueue("grouped send/recv", |comm| unsafe {
            let r = nsys::ncclGroupStart();
            if r != nsys::ncclResult_t::ncclSuccess {
                return r;
            }
            let mut bad = nsys::ncclResult_t::ncclSuccess;
            for &(p, ptr, n) in &sends {
                let r = nsys::ncclSend(ptr as *const _, n, nsys::ncclDataType_t::ncclUint8, p, comm, cs);
                if r != nsys::ncclResult_t::ncclSuccess && r != nsys::ncclResult_t::ncclInProgress {
                    bad = r;
                }
            }
            for &(p, ptr, n) in &recvs {
                let r = nsys::ncclRecv(ptr as *mut _, n, nsys::ncclDataType_t::ncclUint8, p, comm, cs);
                if r != nsys::ncclResult_t::ncclSuccess && r != nsys::ncclResult_t::ncclInProgress {
                    bad = r;
                }
            }
            let r = nsys::ncclGroupEnd();
            if bad != nsys::ncclResult_t::ncclSuccess {
                bad
            } else {
                r
            }
        })
    }

    /// Waits until `ev` has completed, polling for failures and stalls (never blocks in CUDA
    /// or NCCL, so an abort always ends the wait).
    pub fn wait_event(&self, ev: &CudaEvent) -> Result<()> {
        let began = self.busy_begin();
        let r = loop {
            match ev.try_is_complete() {
                Ok(true) => break Ok(()),
                Ok(false) => {}
                Err(e) => break Err(Error::Backend { backend: "cuda", reason: format!("waiting for the GPU: {e:?}") }),
            }
            if let Err(e) = self.inner.check() {
                break Err(e);
            }
            std::thread::sleep(Duration::from_micros(20));
        };
        if began {
            self.busy_end();
        }
        r
    }

    /// Starts the stall clock unless it runs already (then returns false). While it runs, the
    /// watchdog aborts the communicator once it passes the timeout, even if this thread is
    /// stuck inside a CUDA call.
    pub fn busy_begin(&self) -> bool {
        let mut b = self.inner.busy_since.lock().unwrap_or_else(|e| e.into_inner());
        if b.is_some() {
            return false;
        }
        *b = Some(Instant::now());
        true
    }

    /// Restarts the stall clock if it runs (the work it guards has made progress).
    pub fn busy_progress(&self) {
        self.inner.busy_progress()
    }

    /// Stops the stall clock.
    pub fn busy_end(&self) {
        self.inner.busy_end()
    }

    /// Waits for everything enqueued so far on `s`.
    pub fn wait_stream(&self, s: &CudaStream) -> Result<()> {
        let ev = s.record_event(None).map_err(driver_err("recording an event"))?;
        self.wait_event(&ev)
    }

    fn before_blocking(&self) -> Result<()> {
        let ev = self.producer.record_event(None).map_err(driver_err("recording an event"))?;
        self.stream.wait(&ev).map_err(driver_err("ordering streams"))
    }

    /// Declares this rank failed: peers (thread ranks at once, processes at their next stall
    /// check) stop with an error naming it.
    pub fn fail(&self, reason: &str) {
        let err = Error::RankFailed { rank: self.inner.rank, reason: reason.to_string() };
        if let Some(g) = &self.inner.group {
            g.fail(self.inner.rank, reason);
        }
        self.inner.abort_with(err);
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // A watched run completes (or fails within the stall timeout) before the teardown, so
        // dropping the communicator right after a call never cuts that call's transfers short.
        let _ = self.settle_watched();
        self.inner.stop.store(true, Ordering::Relaxed);
        if let Some(w) = self.watchdog.take() {
            let _ = w.join();
        }
        let mut h = self.inner.handle.lock().unwrap_or_else(|e| e.into_inner());
        if h.aborted || h.comm.is_null() {
            return;
        }
        let _ = self.ctx.bind_to_thread();
        // Finalize (flushes this rank's pending operations; non-blocking), wait a while for it to
        // settle, then abort rather than destroy: destroy can block until the peers destroy
        // theirs (seen with NCCL 2.28 on a rank whose call failed after its transfers and dropped
        // its communicator while its peer waited in the next step), and a drop must not hang.
        // Once finalized, abort frees the same resources.
        let comm = h.comm;
        // SAFETY: the watchdog is joined and the lock is held, so nothing else calls NCCL on
        // `comm`, which is live (neither aborted nor null, checked above).
        let r = unsafe { nsys::ncclCommFinalize(comm) };
        let t0 = Instant::now();
        let mut pending = r == nsys::ncclResult_t::ncclInProgress;
        while pending && t0.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_micros(100));
            let mut st = nsys::ncclResult_t::ncclSuccess;
            // SAFETY: as for the finalize: `comm` is live and only this thread calls NCCL on it;
            // `st` is a local the call writes.
            unsafe {
                let _ = nsys::ncclCommGetAsyncError(comm, &mut st);
            }
            pending = st == nsys::ncclResult_t::ncclInProgress;
        }
        // SAFETY: as for the finalize; abort ends `comm`, and the handle is marked aborted right
        // after, so nothing passes it to NCCL again.
        unsafe {
            let _ = nsys::ncclCommAbort(comm);
        }
        h.aborted = true;
    }
}

fn slots(len: usize, w: usize, what: &str) -> Result<usize> {
    if !len.is_multiple_of(w) {
        return Err(Error::Comm(format!("{what}: {len} bytes do not split into {w} equal slots")));
    }
    Ok(len / w)
}

impl Communicator for NcclComm {
    type Buf = GpuBuf;

    fn rank(&self) -> usize {
        self.inner.rank
    }

    fn world(&self) -> usize {
        self.inner.world
    }

    unsafe fn group(&self, sends: &[(usize, &GpuBuf)], recvs: &mut [(usize, &mut GpuBuf)]) -> Result<()> {
        let r: Vec<(usize, &GpuBuf)> = recvs.iter().map(|(p, b)| (*p, &**b)).collect();
        // SAFETY: post_group's contract is this method's (Communicator::group), the caller's.
        unsafe { self.post_group(sends, &r) }
    }

    fn all_gather(&self, send: &GpuBuf, recv: &mut GpuBuf) -> Result<()> {
        let w = self.inner.world;
        if recv.bytes() != send.bytes() * w || recv.dtype() != send.dtype() {
            return Err(Error::Comm(format!(
                "all_gather: receive buffer of {} bytes, expected {}",
                recv.bytes(),
                send.bytes() * w
            )));
        }
        self.before_blocking()?;
        let s = self.stream.clone();
        let (sp, rp, n) = (send.ptr(&s), recv.ptr(&s), send.bytes());
        let cs = s.cu_stream() as nsys::cudaStream_t;
        // SAFETY: `comm` is live and used by this thread alone (see `enqueue`). `send` holds n
        // bytes and `recv` n·world (checked above), both on this GPU; the collective reads and
        // writes them on the comm stream `cs`, ordered after the compute lane's work by
        // before_blocking(), and both stay borrowed until wait_stream() below has seen it done.
        self.enqueue("all_gather", |comm| unsafe {
            nsys::ncclAllGather(sp as *const _, rp as *mut _, n, nsys::ncclDataType_t::ncclUint8, comm, cs)
        })?;
        self.wait_stream(&s)
    }

    fn all_to_all(&self, send: &GpuBuf, recv: &mut GpuBuf) -> Result<()> {
        let w = self.inner.world;
        if recv.bytes() != send.bytes() {
            return Err(Error::Comm("all_to_all: send and receive sizes differ".into()));
        }
        let n = slots(send.bytes(), w, "all_to_all")?;
        self.before_blocking()?;
        let s = self.stream.clone();
        let (sp, rp) = (send.ptr(&s), recv.ptr(&s));
        let cs = s.cu_stream() as nsys::cudaStream_t;
        if n > 0 {
            // SAFETY: `comm` is live and used by this thread alone (see `enqueue`). `send` and
            // `recv` hold world·n bytes each on this GPU (equal sizes checked above, n = bytes /
            // world by `slots`); peer p's slot is bytes p·n..(p + 1)·n of each. The transfers run
            // on the comm stream `cs`, ordered after the compute lane's work by
            // before_blocking(), and both buffers stay borrowed until wait_stream() below has
            // seen them done.
            self.enqueue("all_to_all", |comm| unsafe {
                let r = nsys::ncclGroupStart();
                if r != nsys::ncclResult_t::ncclSuccess {
                    return r;
                }
                for p in 0..w {
                    let _ = nsys::ncclSend(
                        (sp + (p * n) as u64) as *const _,
                        n,
                        nsys::ncclDataType_t::ncclUint8,
                        p as i32,
                        comm,
                        cs,
                    );
                    let _ = nsys::ncclRecv(
                        (rp + (p * n) as u64) as *mut _,
                        n,
                        nsys::ncclDataType_t::ncclUint8,
                        p as i32,
                        comm,
                        cs,
                    );
                }
                nsys::ncclGroupEnd()
            })?;
        }
        self.wait_stream(&s)
    }

    fn reduce_scatter_f32(&self, send: &GpuBuf, recv: &mut GpuBuf) -> Result<()> {
        let w = self.inner.world;
        if send.dtype() != distattn_core::DType::F32
            || recv.dtype() != distattn_core::DType::F32
            || recv.len() * w != send.len()
        {
            return Err(Error::Comm(format!(
                "reduce_scatter: f32 buffers of {} and {} elements for {w} ranks",
                send.len(),
                recv.len()
            )));
        }
        self.before_blocking()?;
        let s = self.stream.clone();
        let (sp, rp, n) = (send.ptr(&s), recv.ptr(&s), recv.len());
        let cs = s.cu_stream() as nsys::cudaStream_t;
        // SAFETY: `comm` is live and used by this thread alone (see `enqueue`). `send` holds
        // world·n f32 and `recv` n (checked above), both on this GPU; the collective runs on the
        // comm stream `cs`, ordered after the compute lane's work by before_blocking(), and both
        // stay borrowed until wait_stream() below has seen it done.
        self.enqueue("reduce_scatter", |comm| unsafe {
            nsys::ncclReduceScatter(
                sp as *const _,
                rp as *mut _,
                n,
                nsys::ncclDataType_t::ncclFloat32,
                nsys::ncclRedOp_t::ncclSum,
                comm,
                cs,
            )
        })?;
        self.wait_stream(&s)
    }

    fn barrier(&self) -> Result<()> {
        let s = self.stream.clone();
        let b = GpuBuf::filled(&s, distattn_core::DType::F32, 1, 0.0)?;
        let p = b.ptr(&s);
        let cs = s.cu_stream() as nsys::cudaStream_t;
        // SAFETY: `comm` is live and used by this thread alone (see `enqueue`). `b` is one f32
        // allocated and set on this comm stream above; the all-reduce sums it in place on the
        // same stream, and `b` lives until wait_stream() below has seen that done.
        self.enqueue("barrier", |comm| unsafe {
            nsys::ncclAllReduce(
                p as *const _,
                p as *mut _,
                1,
                nsys::ncclDataType_t::ncclFloat32,
                nsys::ncclRedOp_t::ncclSum,
                comm,
                cs,
            )
        })?;
        self.wait_stream(&s)
    }

    fn abort(&self, reason: &str) {
        self.fail(reason);
    }

    fn check(&self) -> Result<()> {
        self.inner.check()
    }

    fn stall_watch_begin(&self) -> bool {
        self.busy_begin()
    }

    fn stall_watch_progress(&self) {
        self.busy_progress()
    }

    fn stall_watch_end(&self) {
        self.busy_end()
    }

    fn settle(&self) -> Result<()> {
        self.settle_watched()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_pids_of_this_process_view_are_looked_up() {
        let key = proc_view_key();
        assert_eq!(key, proc_view_key(), "the key is a function of the host and namespace");
        let (lo, hi) = (key as u32, (key >> 32) as u32);
        // Ranks 0 and 2 share this view; rank 1 is on another host (its key differs).
        let got = [11, lo, hi, 22, lo ^ 1, hi, 33, lo, hi];
        assert_eq!(pids_seen_here(&got, key), vec![11, 0, 33]);
    }
}
