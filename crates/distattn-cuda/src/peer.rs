//! GPU ranks as threads of one process sharing one GPU, without NCCL: [`PeerComm`] implements
//! the communicator by device-to-device copies ordered by CUDA events; [`with_peer_ranks`] runs
//! a closure on every rank.
//!
//! NCCL refuses two ranks on one GPU; this transport serves exactly that case, so every plan
//! runs through the CUDA backend and the interpreter on a machine with a single GPU (the tests
//! do). Ranks on several GPUs talk through NCCL (crate `distattn-nccl`).
//!
//! A group is a rendezvous ([`Rendezvous`]): each send posts its buffer's address with an event
//! recorded on the sender's comm stream; each receive takes the matching post, makes its own
//! comm stream wait for that event, enqueues the copy and answers with an event recorded after
//! it; the sender's comm stream waits for that answer before anything after the group (a free,
//! an overwrite) touches the buffer. Host waits give up after the timeout or when a rank
//! fails, naming it.

use crate::buffer::GpuBuf;
use crate::device::CudaBackend;
use crate::driver_err;
use cudarc::driver::{CudaEvent, CudaStream};
use distattn_core::{DType, Error, Result};
use distattn_exec::rendezvous::Rendezvous;
use distattn_exec::Communicator;
use std::sync::Arc;
use std::time::Duration;

/// What ranks post to each other.
enum Message {
    /// A send: its device address and size, and an event recorded on the sender's comm stream
    /// when it was posted.
    Posted { src: u64, bytes: usize, ready: CudaEvent },
    /// The answer to a send: recorded on the receiver's comm stream after its copy.
    Copied(CudaEvent),
}

/// Channels of the mailboxes: sends, and the answers to them.
const SEND: u8 = 0;
const COPIED: u8 = 1;

/// One rank's handle on an in-process group of GPU ranks sharing one GPU.
pub struct PeerComm {
    rank: usize,
    group: Arc<Rendezvous<Message>>,
    /// The comm lane of this rank's backend.
    stream: Arc<CudaStream>,
}

/// One transfer: (peer, device address, bytes).
type Part = (usize, u64, usize);

impl PeerComm {
    fn record(&self) -> Result<CudaEvent> {
        self.stream.record_event(None).map_err(driver_err("recording an event"))
    }

    /// Posts `sends`, copies `recvs` in from their senders, and orders this rank's comm stream
    /// after the peers' copies of its sends.
    fn exchange(&self, sends: &[Part], recvs: &[Part]) -> Result<()> {
        let world = self.group.world();
        if let Some(&(p, _, _)) = sends.iter().chain(recvs).find(|x| x.0 >= world) {
            return Err(Error::Comm(format!("rank {} addresses rank {p} of a world of {world}", self.rank)));
        }
        let sends: Vec<Part> = sends.iter().copied().filter(|x| x.2 > 0).collect();
        let posts = sends
            .iter()
            .map(|&(to, src, bytes)| Ok((to, SEND, Message::Posted { src, bytes, ready: self.record()? })))
            .collect::<Result<Vec<_>>>()?;
        self.group.post(self.rank, posts)?;
        for &(from, dst, bytes) in recvs.iter().filter(|x| x.2 > 0) {
            let Message::Posted { src, bytes: sent, ready } = self.group.take(from, self.rank, SEND)? else {
                return Err(Error::Internal(format!("rank {} got an answer where a send was due", self.rank)));
            };
            if sent != bytes {
                return Err(Error::Comm(format!(
                    "rank {} expected {bytes} bytes from rank {from}, got {sent}",
                    self.rank
                )));
            }
            self.stream.wait(&ready).map_err(driver_err("ordering after a peer"))?;
            // SAFETY: `dst` addresses `bytes` bytes of a receive buffer on this GPU (the whole
            // buffer or one slot of it) and the sender posted as many (compared above), on the
            // same GPU; the copy runs on this rank's comm stream after `ready` (waited for
            // above), and the sender's buffer stays alive and unwritten until its comm stream
            // has waited for the `Copied` event recorded after the copy.
            unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }
                .map_err(driver_err("copying from a peer"))?;
            self.group.post(self.rank, [(from, COPIED, Message::Copied(self.record()?))])?;
        }
        for &(to, _, _) in &sends {
            let Message::Copied(copied) = self.group.take(to, self.rank, COPIED)? else {
                return Err(Error::Internal(format!("rank {} got a send where an answer was due", self.rank)));
            };
            self.stream.wait(&copied).map_err(driver_err("ordering after a peer"))?;
        }
        Ok(())
    }

    /// Waits on the host for the work enqueued on the comm stream.
    fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(driver_err("synchronizing the comm stream"))
    }

    fn slot(&self, len: usize, what: &str) -> Result<usize> {
        let w = self.group.world();
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
        self.group.world()
    }

    unsafe fn group(&self, sends: &[(usize, &GpuBuf)], recvs: &mut [(usize, &mut GpuBuf)]) -> Result<()> {
        // (The copies run on the comm stream after this returns: the caller's contract keeps
        // the buffers alive and untouched until work ordered after it.)
        let s = &self.stream;
        let sends: Vec<Part> = sends.iter().map(|&(p, b)| (p, b.ptr(s), b.bytes())).collect();
        let recvs: Vec<Part> = recvs.iter().map(|(p, b)| (*p, b.ptr(s), b.bytes())).collect();
        self.exchange(&sends, &recvs)
    }

    fn all_gather(&self, send: &GpuBuf, recv: &mut GpuBuf) -> Result<()> {
        let (w, n, s) = (self.group.world(), send.bytes(), &self.stream);
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
        let sends: Vec<Part> = (0..self.group.world()).map(|p| (p, sp + (p * n) as u64, n)).collect();
        let recvs: Vec<Part> = (0..self.group.world()).map(|p| (p, rp + (p * n) as u64, n)).collect();
        self.exchange(&sends, &recvs)?;
        self.synchronize()
    }

    fn reduce_scatter_f32(&self, send: &GpuBuf, recv: &mut GpuBuf) -> Result<()> {
        let w = self.group.world();
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
        self.group.barrier(self.rank)
    }

    fn abort(&self, reason: &str) {
        self.group.abort(self.rank, reason);
    }

    fn check(&self) -> Result<()> {
        self.group.failure().map_or(Ok(()), Err)
    }

    fn stall_watch_progress(&self) {
        self.group.progress();
    }
}

/// Opens `world` thread ranks on GPU `device`, each with its own backend (its own streams)
/// and a [`PeerComm`], and runs `f` on every rank. A rank's error or panic stops the others
/// with an error naming it, which is what this returns.
pub fn with_peer_ranks<R: Send>(
    world: usize,
    device: usize,
    timeout: Duration,
    f: impl Fn(&CudaBackend, &PeerComm) -> Result<R> + Sync,
) -> Result<Vec<R>> {
    if world == 0 {
        return Err(Error::ZeroDim { what: "world size" });
    }
    let backends = (0..world).map(|_| CudaBackend::new(device)).collect::<Result<Vec<_>>>()?;
    let group = Arc::new(Rendezvous::new(world, timeout));
    let ranks: Vec<(CudaBackend, PeerComm)> = backends
        .into_iter()
        .enumerate()
        .map(|(rank, b)| {
            let comm = PeerComm { rank, group: group.clone(), stream: b.comm_stream().clone() };
            (b, comm)
        })
        .collect();
    group.run(ranks, |_, (backend, comm)| {
        // The thread works in the backend's context (the ranks share it).
        backend.context().bind_to_thread().map_err(driver_err("binding the context"))?;
        f(backend, comm)
    })
}
