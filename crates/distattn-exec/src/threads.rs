//! P ranks as threads of one process: [`ThreadComm`] implements [`Communicator`] over shared
//! mailboxes of host bytes, and [`run_ranks`] runs a closure on every rank, turning a rank's
//! error or panic into an error for all the others.

use crate::comm::Communicator;
use distattn_core::{Error, Result};
use std::collections::{HashMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Mailbox channel of point-to-point groups.
const P2P: u8 = 0;
/// Mailbox channel of collectives (kept apart so they never match p2p messages).
const COLL: u8 = 1;

#[derive(Default)]
struct State {
    mail: HashMap<(usize, usize, u8), VecDeque<Vec<u8>>>,
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
        // A rank that panicked while holding the lock leaves valid data (every update is a
        // single push/pop), so poisoning is ignored; the failure is reported through `failed`.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One rank's handle on an in-process group of `world` ranks.
pub struct ThreadComm {
    rank: usize,
    shared: Arc<Shared>,
}

fn failed_err(f: &(usize, String)) -> Error {
    Error::RankFailed { rank: f.0, reason: f.1.clone() }
}

impl ThreadComm {
    /// Handles for `world` ranks sharing one set of mailboxes; blocking calls give up after
    /// `timeout` without progress.
    pub fn group_of(world: usize, timeout: Duration) -> Vec<ThreadComm> {
        let shared = Arc::new(Shared { world, timeout, state: Mutex::new(State::default()), cv: Condvar::new() });
        (0..world).map(|rank| ThreadComm { rank, shared: shared.clone() }).collect()
    }

    /// The failure recorded for the group, if any.
    pub fn failure(&self) -> Option<Error> {
        self.shared.lock().failed.as_ref().map(failed_err)
    }

    fn post(&self, st: &mut State, to: usize, chan: u8, data: &[u8]) -> Result<()> {
        if to >= self.shared.world {
            return Err(Error::Comm(format!(
                "rank {} sends to rank {to} of a world of {}",
                self.rank, self.shared.world
            )));
        }
        st.mail.entry((self.rank, to, chan)).or_default().push_back(data.to_vec());
        Ok(())
    }

    /// Waits for the next message from `from` on `chan` and copies it into `dst`.
    fn take<'a>(
        &self,
        mut st: MutexGuard<'a, State>,
        from: usize,
        chan: u8,
        dst: &mut [u8],
    ) -> Result<MutexGuard<'a, State>> {
        let deadline = Instant::now() + self.shared.timeout;
        loop {
            if let Some(f) = &st.failed {
                return Err(failed_err(f));
            }
            if let Some(msg) = st.mail.get_mut(&(from, self.rank, chan)).and_then(|q| q.pop_front()) {
                if msg.len() != dst.len() {
                    return Err(Error::Comm(format!(
                        "rank {} expected {} bytes from rank {from}, got {}",
                        self.rank,
                        dst.len(),
                        msg.len()
                    )));
                }
                dst.copy_from_slice(&msg);
                return Ok(st);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Comm(format!(
                    "rank {} timed out after {:?} waiting for rank {from}",
                    self.rank, self.shared.timeout
                )));
            }
            st = self.shared.cv.wait_timeout(st, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    fn check(&self, st: &State) -> Result<()> {
        st.failed.as_ref().map_or(Ok(()), |f| Err(failed_err(f)))
    }

    fn slots(&self, len: usize, what: &str) -> Result<usize> {
        let w = self.shared.world;
        if !len.is_multiple_of(w) {
            return Err(Error::Comm(format!("{what}: {len} bytes do not split into {w} equal slots")));
        }
        Ok(len / w)
    }
}

impl Communicator for ThreadComm {
    type Buf = [u8];

    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.shared.world
    }

    fn group(&self, sends: &[(usize, &[u8])], recvs: &mut [(usize, &mut [u8])]) -> Result<()> {
        let mut st = self.shared.lock();
        self.check(&st)?;
        for &(to, data) in sends {
            self.post(&mut st, to, P2P, data)?;
        }
        self.shared.cv.notify_all();
        for (from, dst) in recvs.iter_mut() {
            st = self.take(st, *from, P2P, dst)?;
        }
        Ok(())
    }

    fn all_gather(&self, send: &[u8], recv: &mut [u8]) -> Result<()> {
        let (w, n) = (self.shared.world, send.len());
        if recv.len() != n * w {
            return Err(Error::Comm(format!("all_gather: receive buffer of {} bytes, expected {}", recv.len(), n * w)));
        }
        let mut st = self.shared.lock();
        self.check(&st)?;
        for to in (0..w).filter(|&r| r != self.rank) {
            self.post(&mut st, to, COLL, send)?;
        }
        self.shared.cv.notify_all();
        recv[self.rank * n..][..n].copy_from_slice(send);
        for from in (0..w).filter(|&r| r != self.rank) {
            st = self.take(st, from, COLL, &mut recv[from * n..][..n])?;
        }
        Ok(())
    }

    fn all_to_all(&self, send: &[u8], recv: &mut [u8]) -> Result<()> {
        let w = self.shared.world;
        let n = self.slots(send.len(), "all_to_all")?;
        if recv.len() != send.len() {
            return Err(Error::Comm("all_to_all: send and receive sizes differ".into()));
        }
        let mut st = self.shared.lock();
        self.check(&st)?;
        for to in (0..w).filter(|&r| r != self.rank) {
            self.post(&mut st, to, COLL, &send[to * n..][..n])?;
        }
        self.shared.cv.notify_all();
        recv[self.rank * n..][..n].copy_from_slice(&send[self.rank * n..][..n]);
        for from in (0..w).filter(|&r| r != self.rank) {
            st = self.take(st, from, COLL, &mut recv[from * n..][..n])?;
        }
        Ok(())
    }

    fn reduce_scatter_f32(&self, send: &[u8], recv: &mut [u8]) -> Result<()> {
        let w = self.shared.world;
        let n = self.slots(send.len(), "reduce_scatter")?;
        if recv.len() != n || n % 4 != 0 {
            return Err(Error::Comm(format!(
                "reduce_scatter: receive buffer of {} bytes, expected {n} (f32)",
                recv.len()
            )));
        }
        let mut st = self.shared.lock();
        self.check(&st)?;
        for to in (0..w).filter(|&r| r != self.rank) {
            self.post(&mut st, to, COLL, &send[to * n..][..n])?;
        }
        self.shared.cv.notify_all();
        let mut acc: Vec<f32> =
            send[self.rank * n..][..n].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        let mut tmp = vec![0u8; n];
        // Sum in rank order so every rank's result is bitwise reproducible.
        let mut parts: Vec<(usize, Vec<f32>)> = Vec::new();
        for from in (0..w).filter(|&r| r != self.rank) {
            st = self.take(st, from, COLL, &mut tmp)?;
            parts.push((from, tmp.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()));
        }
        drop(st);
        let own = std::mem::take(&mut acc);
        parts.push((self.rank, own));
        parts.sort_by_key(|p| p.0);
        let mut sum = vec![0f32; n / 4];
        for (_, p) in parts {
            for (s, x) in sum.iter_mut().zip(p) {
                *s += x;
            }
        }
        for (c, x) in recv.chunks_exact_mut(4).zip(sum) {
            c.copy_from_slice(&x.to_le_bytes());
        }
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        let mut st = self.shared.lock();
        self.check(&st)?;
        let gen = st.barrier_gen;
        st.barrier_count += 1;
        if st.barrier_count == self.shared.world {
            st.barrier_count = 0;
            st.barrier_gen += 1;
            self.shared.cv.notify_all();
            return Ok(());
        }
        let deadline = Instant::now() + self.shared.timeout;
        while st.barrier_gen == gen {
            self.check(&st)?;
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Comm(format!("rank {} timed out in a barrier", self.rank)));
            }
            st = self.shared.cv.wait_timeout(st, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        }
        Ok(())
    }

    fn abort(&self, reason: &str) {
        let mut st = self.shared.lock();
        if st.failed.is_none() {
            st.failed = Some((self.rank, reason.to_string()));
        }
        self.shared.cv.notify_all();
    }

    fn check(&self) -> Result<()> {
        self.failure().map_or(Ok(()), Err)
    }
}

/// The message of a caught panic payload (`"panic"` when it carries none).
pub fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic".to_string()
    }
}

/// Runs `f` on `world` ranks, one thread each, and returns every rank's result in rank order.
///
/// If a rank returns an error or panics, it is recorded as the group's failure (the first one
/// wins), every other rank's pending or next communication returns
/// [`Error::RankFailed`] naming it, and this function returns that error.
pub fn run_ranks<R: Send>(
    world: usize,
    timeout: Duration,
    f: impl Fn(&ThreadComm) -> Result<R> + Sync,
) -> Result<Vec<R>> {
    if world == 0 {
        return Err(Error::ZeroDim { what: "world size" });
    }
    let comms = ThreadComm::group_of(world, timeout);
    let probe = ThreadComm { rank: 0, shared: comms[0].shared.clone() };
    let results: Vec<Result<R>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let f = &f;
                s.spawn(move || match catch_unwind(AssertUnwindSafe(|| f(&comm))) {
                    Ok(Ok(v)) => Ok(v),
                    Ok(Err(e)) => {
                        // A rank that only saw a peer's failure does not overwrite it.
                        comm.abort(&e.to_string());
                        Err(e)
                    }
                    Err(p) => {
                        let reason = format!("panicked: {}", panic_message(p.as_ref()));
                        comm.abort(&reason);
                        Err(Error::RankFailed { rank: comm.rank, reason })
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(Error::Internal("a rank thread ended without a result".into()))))
            .collect()
    });
    if let Some(e) = probe.failure() {
        return Err(e);
    }
    results.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytemuck::{cast_slice as as_bytes, cast_slice_mut as as_bytes_mut};

    const T: Duration = Duration::from_secs(10);

    #[test]
    fn ring_groups_and_collectives() {
        let out = run_ranks(4, T, |c| {
            let (r, w) = (c.rank(), c.world());
            // Ring exchange, every rank sending before receiving (would deadlock on blocking sends).
            let mine = [r as u32 * 10, r as u32 * 10 + 1];
            let mut got = [0u32; 2];
            c.group(&[((r + 1) % w, as_bytes(&mine))], &mut [((r + w - 1) % w, as_bytes_mut(&mut got))])?;
            assert_eq!(got[0], ((r + w - 1) % w) as u32 * 10);
            let mut all = vec![0u32; 2 * w];
            c.all_gather(as_bytes(&mine), as_bytes_mut(&mut all))?;
            assert_eq!(all, (0..w as u32).flat_map(|x| [x * 10, x * 10 + 1]).collect::<Vec<_>>());
            let send: Vec<u32> = (0..w as u32).map(|j| 100 * r as u32 + j).collect();
            let mut recv = vec![0u32; w];
            c.all_to_all(as_bytes(&send), as_bytes_mut(&mut recv))?;
            assert_eq!(recv, (0..w as u32).map(|i| 100 * i + r as u32).collect::<Vec<_>>());
            let vals: Vec<f32> = (0..2 * w).map(|j| (r * 1000 + j) as f32).collect();
            let mut red = vec![0f32; 2];
            c.reduce_scatter_f32(as_bytes(&vals), as_bytes_mut(&mut red))?;
            let want: f32 = (0..w).map(|i| (i * 1000 + 2 * r) as f32).sum();
            assert_eq!(red[0], want);
            c.barrier()?;
            Ok(r)
        })
        .unwrap();
        assert_eq!(out, vec![0, 1, 2, 3]);
    }

    #[test]
    fn failed_rank_is_named_not_hung() {
        for panic in [false, true] {
            let t0 = Instant::now();
            let err = run_ranks(4, Duration::from_secs(30), |c| {
                if c.rank() == 2 {
                    if panic {
                        panic!("injected");
                    }
                    return Err(Error::Backend { backend: "test", reason: "injected".into() });
                }
                let mut x = [0u8; 4];
                c.group(&[], &mut [((c.rank() + 1) % 4, &mut x[..])])?;
                c.barrier()?;
                Ok(())
            })
            .unwrap_err();
            assert!(matches!(err, Error::RankFailed { rank: 2, .. }), "{err}");
            assert!(t0.elapsed() < Duration::from_secs(5));
        }
    }

    #[test]
    fn silent_peer_times_out() {
        let err = run_ranks(2, Duration::from_millis(200), |c| {
            if c.rank() == 0 {
                let mut x = [0u8; 1];
                c.group(&[], &mut [(1, &mut x[..])])?;
            }
            Ok(())
        })
        .unwrap_err();
        assert!(err.to_string().contains("timed out"), "{err}");
    }
}
