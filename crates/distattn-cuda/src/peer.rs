//! GPU ranks as threads of one process without NCCL: [`PeerComm`] implements the
//! communicator by device-to-device copies (`cuMemcpyAsync`, which also crosses GPUs), ordered
//! by CUDA events; [`with_peer_ranks`] runs a closure on every rank.
//!
//! NCCL refuses two ranks on one GPU; this transport does not, so every plan can run through
//! the CUDA backend and the interpreter on a machine with a single GPU (the tests do), and on
//! several GPUs of one process.
//!
//! A group is a rendezvous: each send posts its buffer's address with an event recorded on the
//! sender's comm stream; each receive waits on the host for the matching post, makes its own
//! comm stream wait for that event, enqueues the copy and answers with an event recorded after
//! it; the sender's comm stream waits for that answer before anything after the group (a free,
//! an overwrite) touches the buffer. Host waits give up after the timeout or when a rank
//! fails, naming it.

use crate::buffer::GpuBuf;
use crate::device::CudaBackend;
use crate::driver_err;
use cudarc::driver::{CudaEvent, CudaStream};
use distattn_core::{DType, Error, Result};
use distattn_exec::threads::panic_message;
use distattn_exec::Communicator;
use std::collections::{HashMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// A send waiting for its receiver.
struct Posted {
    id: u64,
    src: u64,
    bytes: usize,
    /// Recorded on the sender's comm stream when the send was posted.
    ready: CudaEvent,
}

#[derive(Default)]
struct State {
    /// Posted sends by (from, to), in posting order.
    mail: HashMap<(usize, usize), VecDeque<Posted>>,
    /// Answers by send id: recorded on the receiver's comm stream after its copy.
    copied: HashMap<u64, CudaEvent>,
    next_id: u64,
    failed: Option<(usize, String)>,
    barrier_count: usize,
    barrier_gen: u64,
}

struct Shared {
    world: usize,
    timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Every update is a single insert or removal, so a rank that panicked holding the lock
        // left valid data; its failure is reported through `failed`.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One rank's handle on an in-process group of GPU ranks.
pub struct PeerComm {
    rank: usize,
    shared: Arc<Shared>,
    /// The comm lane of this rank's backend.
    stream: Arc<CudaStream>,
}

/// One transfer: (peer, device address, bytes).
type Part = (usize, u64, usize);

impl PeerComm {
    /// Handles for `world` ranks; rank r posts and copies on `streams[r]` (its backend's comm
    /// stream). Host waits give up after `timeout`.
    pub fn group_of(streams: Vec<Arc<CudaStream>>, timeout: Duration) -> Vec<PeerComm> {
        let shared =
            Arc::new(Shared { world: streams.len(), timeout, state: Mutex::new(State::default()), cv: Condvar::new() });
        streams
            .into_iter()
            .enumerate()
            .map(|(rank, stream)| PeerComm { rank, shared: shared.clone(), stream })
            .collect()
    }

    fn failed(st: &State) -> Result<()> {
        match &st.failed {
            Some((rank, reason)) => Err(Error::RankFailed { rank: *rank, reason: reason.clone() }),
            None => Ok(()),
        }
    }

    /// Waits on the host until `ready(state)` gives a value, a rank fails or the timeout passes.
    fn wait_for<'a, T>(
        &self,
        mut st: MutexGuard<'a, State>,
        what: &str,
        mut ready: impl FnMut(&mut State) -> Option<T>,
    ) -> Result<(MutexGuard<'a, State>, T)> {
        let deadline = Instant::now() + self.shared.timeout;
        loop {
            Self::failed(&st)?;
            if let Some(v) = ready(&mut st) {
                return Ok((st, v));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Comm(format!(
                    "rank {} timed out after {:?} {what}",
                    self.rank, self.shared.timeout
                )));
            }
            st = self.shared.cv.wait_timeout(st, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    fn record(&self) -> Result<CudaEvent> {
        self.stream.record_event(None).map_err(driver_err("recording an event"))
    }

    /// Posts `sends`, copies `recvs` in from their senders, and orders this rank's comm stream
    /// after the peers' copies of its sends.
    fn exchange(&self, sends: &[Part], recvs: &[Part]) -> Result<()> {
        let world = self.shared.world;
        if let Some(&(p, _, _)) = sends.iter().chain(recvs).find(|x| x.0 >= world) {
            return Err(Error::Comm(format!("rank {} addresses rank {p} of a world of {world}", self.rank)));
        }
        let mut st = self.shared.lock();
        Self::failed(&st)?;
        let mut mine = Vec::new();
        for &(to, src, bytes) in sends.iter().filter(|x| x.2 > 0) {
            let ready = self.record()?;
            let id = st.next_id;
            st.next_id += 1;
            st.mail.entry((self.rank, to)).or_default().push_back(Posted { id, src, bytes, ready });
            mine.push(id);
        }
        self.shared.cv.notify_all();
        for &(from, dst, bytes) in recvs.iter().filter(|x| x.2 > 0) {
            let key = (from, self.rank);
            let waiting = format!("for rank {from}");
            let (guard, posted) = self.wait_for(st, &waiting, |s| s.mail.get_mut(&key).and_then(|q| q.pop_front()))?;
            st = guard;
            if posted.bytes != bytes {
                return Err(Error::Comm(format!(
                    "rank {} expected {bytes} bytes from rank {from}, got {}",
                    self.rank, posted.bytes
                )));
            }
            self.stream.wait(&posted.ready).map_err(driver_err("ordering after a peer"))?;
            // SAFETY: `dst` addresses `bytes` bytes of a receive buffer on this GPU (the whole
            // buffer or one slot of it) and the sender posted as many (compared above); the copy
            // runs on this rank's comm stream after `ready` (waited for above), and the sender's
            // buffer stays alive and unwritten until its comm stream has waited for the `copied`
            // event recorded after the copy.
            unsafe { cudarc::driver::result::memcpy_dtod_async(dst, posted.src, bytes, self.stream.cu_stream()) }
                .map_err(driver_err("copying from a peer"))?;
            st.copied.insert(posted.id, self.record()?);
            self.shared.cv.notify_all();
        }
        for id in mine {
            let (guard, copied) = self.wait_for(st, "for a peer to copy its data", |s| s.copied.remove(&id))?;
            st = guard;
            self.stream.wait(&copied).map_err(driver_err("ordering after a peer"))?;
        }
        Ok(())
    }

    /// Waits on the host for the work enqueued on the comm stream.
    fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(driver_err("synchronizing the comm stream"))
    }

    fn slot(&self, len: usize, what: &str) -> Result<usize> {
        let w = self.shared.world;
        if !len.is_multiple_of(w) {
            return Err(Error::Comm(format!("{what}: {len} bytes do not split into {w} equal slots")));
        }
        Ok(len / w)
    }
}

impl Communicator for PeerComm {
    type Buf = GpuBuf;

    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.shared.world
    }

    fn group(&self, sends: &[(usize, &GpuBuf)], recvs: &mut [(usize, &mut GpuBuf)]) -> Result<()> {
        let s = &self.stream;
        let sends: Vec<Part> = sends.iter().map(|&(p, b)| (p, b.ptr(s), b.bytes())).collect();
        let recvs: Vec<Part> = recvs.iter().map(|(p, b)| (*p, b.ptr(s), b.bytes())).collect();
        self.exchange(&sends, &recvs)
    }

    fn all_gather(&self, send: &GpuBuf, recv: &mut GpuBuf) -> Result<()> {
        let (w, n, s) = (self.shared.world, send.bytes(), &self.stream);
        if recv.bytes() != n * w || recv.dtype() != send.dtype() {
            return Err(Error::Comm(format!(
                "all_gather: receive buffer of {} bytes, expected {}",
                recv.bytes(),
                n * w
            )));
        }
        let (sp, rp) = (send.ptr(s), recv.ptr(s));
        let sends: Vec<Part> = (0..w).map(|p| (p, sp, n)).collect();
        let recvs: Vec<Part> = (0..w).map(|p| (p, rp + (p * n) as u64, n)).collect();
        self.exchange(&sends, &recvs)?;
        self.synchronize()
    }

    fn all_to_all(&self, send: &GpuBuf, recv: &mut GpuBuf) -> Result<()> {
        if recv.bytes() != send.bytes() {
            return Err(Error::Comm("all_to_all: send and receive sizes differ".into()));
        }
        let n = self.slot(send.bytes(), "all_to_all")?;
        let s = &self.stream;
        let (sp, rp) = (send.ptr(s), recv.ptr(s));
        let sends: Vec<Part> = (0..self.shared.world).map(|p| (p, sp + (p * n) as u64, n)).collect();
        let recvs: Vec<Part> = (0..self.shared.world).map(|p| (p, rp + (p * n) as u64, n)).collect();
        self.exchange(&sends, &recvs)?;
        self.synchronize()
    }

    fn reduce_scatter_f32(&self, send: &GpuBuf, recv: &mut GpuBuf) -> Result<()> {
        let w = self.shared.world;
        if send.dtype() != DType::F32 || recv.dtype() != DType::F32 || recv.len() * w != send.len() {
            return Err(Error::Comm(format!(
                "reduce_scatter: f32 buffers of {} and {} elements for {w} ranks",
                send.len(),
                recv.len()
            )));
        }
        // Every rank's slot of this rank, gathered on the device, summed on the host in rank
        // order (bitwise the same on every rank): a test transport, not a fast one.
        let s = &self.stream;
        let n = recv.bytes();
        let parts = GpuBuf::alloc(s, DType::F32, recv.len() * w)?;
        let (sp, pp) = (send.ptr(s), parts.ptr(s));
        let sends: Vec<Part> = (0..w).map(|p| (p, sp + (p * n) as u64, n)).collect();
        let recvs: Vec<Part> = (0..w).map(|p| (p, pp + (p * n) as u64, n)).collect();
        self.exchange(&sends, &recvs)?;
        let all = parts.download_f32(s)?;
        let mut sum = vec![0f32; recv.len()];
        for part in all.chunks_exact(recv.len()) {
            for (a, x) in sum.iter_mut().zip(part) {
                *a += x;
            }
        }
        let summed = GpuBuf::upload(s, &sum)?;
        // SAFETY: `recv` holds n bytes and `summed` (uploaded above) recv.len() f32, also n bytes,
        // both on this GPU; the copy runs on the comm stream after the upload, and `summed` is
        // freed only after synchronize() below.
        unsafe { cudarc::driver::result::memcpy_dtod_async(recv.ptr(s), summed.ptr(s), n, s.cu_stream()) }
            .map_err(driver_err("copying a sum"))?;
        self.synchronize()
    }

    fn barrier(&self) -> Result<()> {
        let mut st = self.shared.lock();
        Self::failed(&st)?;
        let gen = st.barrier_gen;
        st.barrier_count += 1;
        if st.barrier_count == self.shared.world {
            st.barrier_count = 0;
            st.barrier_gen += 1;
            self.shared.cv.notify_all();
            return Ok(());
        }
        self.wait_for(st, "in a barrier", |s| (s.barrier_gen != gen).then_some(())).map(|_| ())
    }

    fn abort(&self, reason: &str) {
        let mut st = self.shared.lock();
        if st.failed.is_none() {
            st.failed = Some((self.rank, reason.to_string()));
        }
        self.shared.cv.notify_all();
    }

    fn check(&self) -> Result<()> {
        Self::failed(&self.shared.lock())
    }
}

/// Opens `world` thread ranks, rank r on GPU `ordinal(r)` (several may share one), each with a
/// backend and a [`PeerComm`], and runs `f` on every rank. A rank's error or panic stops the
/// others with an error naming it, which is what this returns.
pub fn with_peer_ranks<R: Send>(
    world: usize,
    ordinal: impl Fn(usize) -> usize,
    timeout: Duration,
    f: impl Fn(&CudaBackend, &PeerComm) -> Result<R> + Sync,
) -> Result<Vec<R>> {
    if world == 0 {
        return Err(Error::ZeroDim { what: "world size" });
    }
    let backends = (0..world).map(|r| CudaBackend::new(ordinal(r))).collect::<Result<Vec<_>>>()?;
    let comms = PeerComm::group_of(backends.iter().map(|b| b.comm_stream().clone()).collect(), timeout);
    let probe = comms[0].shared.clone();
    let results: Vec<Result<R>> = std::thread::scope(|s| {
        let handles: Vec<_> = backends
            .iter()
            .zip(comms)
            .map(|(backend, comm)| {
                let f = &f;
                s.spawn(move || {
                    // The thread works in the backend's context (NCCL-free ranks share it).
                    backend.context().bind_to_thread().map_err(driver_err("binding the context"))?;
                    match catch_unwind(AssertUnwindSafe(|| f(backend, &comm))) {
                        Ok(Ok(v)) => Ok(v),
                        Ok(Err(e)) => {
                            comm.abort(&e.to_string());
                            Err(e)
                        }
                        Err(p) => {
                            let reason = format!("panicked: {}", panic_message(p.as_ref()));
                            comm.abort(&reason);
                            Err(Error::RankFailed { rank: comm.rank, reason })
                        }
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(Error::Internal("a rank thread ended without a result".into()))))
            .collect()
    });
    if let Some((rank, reason)) = probe.lock().failed.clone() {
        return Err(Error::RankFailed { rank, reason });
    }
    results.into_iter().collect()
}
