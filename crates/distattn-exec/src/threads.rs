//! P ranks as threads of one process: [`ThreadComm`] implements [`Communicator`] over
//! mailboxes of host bytes, and [`run_ranks`] runs a closure on every rank, turning a rank's
//! error or panic into an error for all the others.

use crate::comm::Communicator;
use crate::rendezvous::Rendezvous;
use distattn_core::{Error, Result};
use std::sync::Arc;
use std::time::Duration;

/// Mailbox channel of point-to-point groups.
const P2P: u8 = 0;
/// Mailbox channel of collectives (kept apart so they never match p2p messages).
const COLL: u8 = 1;

/// One rank's handle on an in-process group of `world` ranks.
pub struct ThreadComm {
    rank: usize,
    group: Arc<Rendezvous<Vec<u8>>>,
}

impl ThreadComm {
    /// Handles for the ranks of `group`.
    pub fn group_of(group: &Arc<Rendezvous<Vec<u8>>>) -> Vec<ThreadComm> {
        (0..group.world()).map(|rank| ThreadComm { rank, group: group.clone() }).collect()
    }

    /// The failure recorded for the group, if any.
    pub fn failure(&self) -> Option<Error> {
        self.group.failure()
    }

    /// Takes the next message from `from` on `chan` into `dst`, which must have its size.
    fn take_into(&self, from: usize, chan: u8, dst: &mut [u8]) -> Result<()> {
        let msg = self.group.take(from, self.rank, chan)?;
        if msg.len() != dst.len() {
            return Err(Error::Comm(format!(
                "rank {} expected {} bytes from rank {from}, got {}",
                self.rank,
                dst.len(),
                msg.len()
            )));
        }
        dst.copy_from_slice(&msg);
        Ok(())
    }

    /// Posts slot `slot(to)` of `send` to every other rank on the collectives' channel.
    fn post_slots<'a>(&self, slot: impl Fn(usize) -> &'a [u8]) -> Result<()> {
        let w = self.group.world();
        self.group.post(self.rank, (0..w).filter(|&r| r != self.rank).map(|to| (to, COLL, slot(to).to_vec())))
    }

    fn slots(&self, len: usize, what: &str) -> Result<usize> {
        let w = self.group.world();
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
        self.group.world()
    }

    unsafe fn group(&self, sends: &[(usize, &[u8])], recvs: &mut [(usize, &mut [u8])]) -> Result<()> {
        self.group.post(self.rank, sends.iter().map(|&(to, data)| (to, P2P, data.to_vec())))?;
        for (from, dst) in recvs.iter_mut() {
            self.take_into(*from, P2P, dst)?;
        }
        Ok(())
    }

    fn all_gather(&self, send: &[u8], recv: &mut [u8]) -> Result<()> {
        let (w, n) = (self.group.world(), send.len());
        if recv.len() != n * w {
            return Err(Error::Comm(format!("all_gather: receive buffer of {} bytes, expected {}", recv.len(), n * w)));
        }
        self.post_slots(|_| send)?;
        recv[self.rank * n..][..n].copy_from_slice(send);
        for from in (0..w).filter(|&r| r != self.rank) {
            self.take_into(from, COLL, &mut recv[from * n..][..n])?;
        }
        Ok(())
    }

    fn all_to_all(&self, send: &[u8], recv: &mut [u8]) -> Result<()> {
        let w = self.group.world();
        let n = self.slots(send.len(), "all_to_all")?;
        if recv.len() != send.len() {
            return Err(Error::Comm("all_to_all: send and receive sizes differ".into()));
        }
        self.post_slots(|to| &send[to * n..][..n])?;
        recv[self.rank * n..][..n].copy_from_slice(&send[self.rank * n..][..n]);
        for from in (0..w).filter(|&r| r != self.rank) {
            self.take_into(from, COLL, &mut recv[from * n..][..n])?;
        }
        Ok(())
    }

    fn reduce_scatter_f32(&self, send: &[u8], recv: &mut [u8]) -> Result<()> {
        let w = self.group.world();
        let n = self.slots(send.len(), "reduce_scatter")?;
        if recv.len() != n || !n.is_multiple_of(4) {
            return Err(Error::Comm(format!(
                "reduce_scatter: receive buffer of {} bytes, expected {n} (f32)",
                recv.len()
            )));
        }
        self.post_slots(|to| &send[to * n..][..n])?;
        let floats =
            |b: &[u8]| b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect::<Vec<f32>>();
        // Sum in rank order so every rank's result is bitwise reproducible.
        let mut sum = vec![0f32; n / 4];
        for from in 0..w {
            let part = if from == self.rank {
                floats(&send[from * n..][..n])
            } else {
                floats(&self.group.take(from, self.rank, COLL)?)
            };
            if part.len() != sum.len() {
                return Err(Error::Comm(format!(
                    "reduce_scatter: rank {from} sent {} values, expected {}",
                    part.len(),
                    sum.len()
                )));
            }
            for (s, x) in sum.iter_mut().zip(part) {
                *s += x;
            }
        }
        for (c, x) in recv.chunks_exact_mut(4).zip(sum) {
            c.copy_from_slice(&x.to_le_bytes());
        }
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.group.barrier(self.rank)
    }

    fn abort(&self, reason: &str) {
        self.group.abort(self.rank, reason);
    }

    fn check(&self) -> Result<()> {
        self.failure().map_or(Ok(()), Err)
    }

    fn stall_watch_progress(&self) {
        self.group.progress();
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
    let group = Arc::new(Rendezvous::new(world, timeout));
    group.run(ThreadComm::group_of(&group), |_, comm| f(comm))
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytemuck::{cast_slice as as_bytes, cast_slice_mut as as_bytes_mut};
    use std::time::Instant;

    const T: Duration = Duration::from_secs(10);

    #[test]
    fn ring_groups_and_collectives() {
        let out = run_ranks(4, T, |c| {
            let (r, w) = (c.rank(), c.world());
            // Ring exchange, every rank sending before receiving (would deadlock on blocking sends).
            let mine = [r as u32 * 10, r as u32 * 10 + 1];
            let mut got = [0u32; 2];
            // SAFETY: a host transport's group has completed when it returns.
            unsafe { c.group(&[((r + 1) % w, as_bytes(&mine))], &mut [((r + w - 1) % w, as_bytes_mut(&mut got))])? };
            let from = ((r + w - 1) % w) as u32;
            assert_eq!(got, [from * 10, from * 10 + 1]);
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
            let want = |j: usize| -> f32 { (0..w).map(|i| (i * 1000 + 2 * r + j) as f32).sum() };
            assert_eq!(red, [want(0), want(1)]);
            c.barrier()?;
            Ok(r)
        })
        .unwrap();
        assert_eq!(out, vec![0, 1, 2, 3]);
    }

    #[test]
    fn a_run_ends_when_its_last_rank_does() {
        // (Once ended only on a 10 ms polling period: a floor under every short run.)
        let fastest = (0..10)
            .map(|_| {
                let t0 = Instant::now();
                run_ranks(2, T, |c| Ok(c.rank())).unwrap();
                t0.elapsed()
            })
            .min()
            .unwrap();
        assert!(fastest < Duration::from_millis(5), "{fastest:?}");
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
                // SAFETY: a host transport's group has completed when it returns.
                unsafe { c.group(&[], &mut [((c.rank() + 1) % 4, &mut x[..])])? };
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
                // SAFETY: a host transport's group has completed when it returns.
                unsafe { c.group(&[], &mut [(1, &mut x[..])])? };
            }
            Ok(())
        })
        .unwrap_err();
        // Rank 0's own wait and the watchdog of ranks whose peers have finished both fire at
        // the timeout; either may name the failure first, and both name rank 0.
        let msg = err.to_string();
        assert!(matches!(err, Error::RankFailed { rank: 0, .. }), "{err}");
        assert!(msg.contains("timed out") || msg.contains("made no progress"), "{err}");
    }

    #[test]
    fn a_wait_outlasts_the_timeout_while_the_peer_makes_progress() {
        // Rank 1 computes for 3 timeouts, reporting each completed block, then sends: rank 0's
        // wait is not a silent peer's.
        let t = Duration::from_millis(150);
        let group = Arc::new(Rendezvous::new(2, t));
        let got = group
            .run(ThreadComm::group_of(&group), |rank, c| {
                let mut x = [0u8; 1];
                if rank == 0 {
                    // SAFETY: a host transport's group has completed when it returns.
                    unsafe { c.group(&[], &mut [(1, &mut x[..])])? };
                } else {
                    for _ in 0..9 {
                        std::thread::sleep(t / 3);
                        group.progress();
                    }
                    // SAFETY: a host transport's group has completed when it returns.
                    unsafe { c.group(&[(0, &[7u8][..])], &mut [])? };
                }
                Ok(x[0])
            })
            .unwrap();
        assert_eq!(got, vec![7, 0]);
    }
}
