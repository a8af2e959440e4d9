//! What every transport between the ranks of one process builds on: mailboxes of messages per
//! (sender, receiver, channel), a barrier, the group's first failure, and a runner that gives
//! each rank a thread and turns a rank's error or panic into an error for all the others.
//!
//! Host bytes ([`crate::threads::ThreadComm`]) and device copies ordered by events
//! (`distattn_cuda::peer`) differ only in the messages they post.

use distattn_core::{Error, Result};
use std::collections::{HashMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

struct State<M> {
    mail: HashMap<(usize, usize, u8), VecDeque<M>>,
    failed: Option<(usize, String)>,
    barrier_count: usize,
    barrier_gen: u64,
    /// The last message, barrier or completed block of any rank.
    last_progress: Instant,
    /// Rank threads of the current [`Rendezvous::run`] that have returned.
    finished: usize,
}

/// The mailboxes, barrier and failure of `world` in-process ranks. Waits give up after the
/// timeout without progress, or as soon as a rank fails, naming it.
pub struct Rendezvous<M> {
    world: usize,
    timeout: Duration,
    state: Mutex<State<M>>,
    cv: Condvar,
}

impl<M> Rendezvous<M> {
    pub fn new(world: usize, timeout: Duration) -> Self {
        let state = State {
            mail: HashMap::new(),
            failed: None,
            barrier_count: 0,
            barrier_gen: 0,
            last_progress: Instant::now(),
            finished: 0,
        };
        Rendezvous { world, timeout, state: Mutex::new(state), cv: Condvar::new() }
    }

    pub fn world(&self) -> usize {
        self.world
    }

    fn lock(&self) -> MutexGuard<'_, State<M>> {
        // A rank that panicked while holding the lock leaves valid data (every update is a
        // single push, pop or count), so poisoning is ignored; the failure is reported through
        // `failed`.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn failed(st: &State<M>) -> Result<()> {
        match &st.failed {
            Some((rank, reason)) => Err(Error::RankFailed { rank: *rank, reason: reason.clone() }),
            None => Ok(()),
        }
    }

    /// The group's failure (the first rank that failed), if any.
    pub fn failure(&self) -> Option<Error> {
        Self::failed(&self.lock()).err()
    }

    /// Records `rank`'s failure unless one is recorded already, and wakes every waiting rank.
    pub fn abort(&self, rank: usize, reason: &str) {
        let mut st = self.lock();
        if st.failed.is_none() {
            st.failed = Some((rank, reason.to_string()));
        }
        self.cv.notify_all();
    }

    /// Posts `messages` from rank `from`, each `(to, channel, message)`; messages between one
    /// pair of ranks on one channel are taken in posting order.
    pub fn post(&self, from: usize, messages: impl IntoIterator<Item = (usize, u8, M)>) -> Result<()> {
        let mut st = self.lock();
        Self::failed(&st)?;
        for (to, chan, m) in messages {
            if to >= self.world {
                return Err(Error::Comm(format!("rank {from} sends to rank {to} of a world of {}", self.world)));
            }
            st.mail.entry((from, to, chan)).or_default().push_back(m);
        }
        st.last_progress = Instant::now();
        self.cv.notify_all();
        Ok(())
    }

    /// Records that a rank completed work (restarts the clock of the waits and of
    /// [`Rendezvous::run`]'s check for ranks left without progress).
    pub fn progress(&self) {
        self.lock().last_progress = Instant::now();
    }

    /// Waits on `st` until `ready` gives a value, a rank fails or the timeout passes with no
    /// progress of any rank (since the wait began).
    fn wait<'a, T>(
        &self,
        mut st: MutexGuard<'a, State<M>>,
        what: impl Fn() -> String,
        mut ready: impl FnMut(&mut State<M>) -> Option<T>,
    ) -> Result<T> {
        let start = Instant::now();
        loop {
            Self::failed(&st)?;
            if let Some(v) = ready(&mut st) {
                st.last_progress = Instant::now();
                return Ok(v);
            }
            let deadline = st.last_progress.max(start) + self.timeout;
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Comm(format!("{} timed out after {:?}", what(), self.timeout)));
            }
            st = self.cv.wait_timeout(st, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// Takes the next message from rank `from` to rank `to` on `chan`, waiting for it.
    pub fn take(&self, from: usize, to: usize, chan: u8) -> Result<M> {
        let key = (from, to, chan);
        self.wait(
            self.lock(),
            || format!("rank {to} waiting for rank {from}"),
            |st| st.mail.get_mut(&key).and_then(|q| q.pop_front()),
        )
    }

    /// Returns when every rank has entered the barrier.
    pub fn barrier(&self, rank: usize) -> Result<()> {
        let mut st = self.lock();
        Self::failed(&st)?;
        let gen = st.barrier_gen;
        st.barrier_count += 1;
        if st.barrier_count == self.world {
            st.barrier_count = 0;
            st.barrier_gen += 1;
            self.cv.notify_all();
            return Ok(());
        }
        self.wait(st, || format!("rank {rank} in a barrier"), |st| (st.barrier_gen != gen).then_some(()))
    }

    /// Runs `f(rank, handle)` for every handle (rank = its index), one thread each, and returns
    /// every rank's result in rank order. A rank's error or panic is recorded as the group's
    /// failure (the first one wins; a rank that only saw a peer's failure does not overwrite
    /// it), so every other rank's pending or next wait returns [`Error::RankFailed`] naming it,
    /// and this returns that error. Once some ranks have returned, a rank that makes no
    /// progress (messages, barriers, completed blocks) for the timeout is declared failed, so its
    /// next check ends it instead of the join waiting forever. (A thread stuck inside one
    /// computation cannot be stopped in-process; it ends at its next check.)
    pub fn run<H: Send, R: Send>(&self, handles: Vec<H>, f: impl Fn(usize, &H) -> Result<R> + Sync) -> Result<Vec<R>>
    where
        M: Send,
    {
        if handles.is_empty() {
            return Err(Error::ZeroDim { what: "world size" });
        }
        self.lock().finished = 0;
        let results: Vec<Result<R>> = std::thread::scope(|s| {
            let threads: Vec<std::thread::ScopedJoinHandle<'_, Result<R>>> = handles
                .into_iter()
                .enumerate()
                .map(|(rank, h)| {
                    let f = &f;
                    s.spawn(move || {
                        let r = match catch_unwind(AssertUnwindSafe(|| f(rank, &h))) {
                            Ok(Ok(v)) => Ok(v),
                            Ok(Err(e)) => {
                                self.abort(rank, &e.to_string());
                                Err(e)
                            }
                            Err(p) => {
                                let reason = format!("panicked: {}", panic_message(p.as_ref()));
                                self.abort(rank, &reason);
                                Err(Error::RankFailed { rank, reason })
                            }
                        };
                        self.lock().finished += 1;
                        self.cv.notify_all();
                        r
                    })
                })
                .collect();
            // Woken when a rank returns (or by any progress), not on a polling period: a short
            // run ends as soon as its last rank does.
            let n = threads.len();
            let mut st = self.lock();
            while st.finished < n {
                if st.finished > 0 && st.failed.is_none() && st.last_progress.elapsed() > self.timeout {
                    drop(st);
                    let stuck = (0..n).find(|&r| !threads[r].is_finished()).unwrap_or(0);
                    let reason = format!("made no progress for {:?} after its peers finished", self.timeout);
                    self.abort(stuck, &reason);
                    st = self.lock();
                    continue;
                }
                // (The progress check matters only once some rank has returned and none failed.)
                let wait = if st.finished == 0 || st.failed.is_some() {
                    self.timeout
                } else {
                    self.timeout.saturating_sub(st.last_progress.elapsed()).max(Duration::from_millis(1))
                };
                st = self.cv.wait_timeout(st, wait).unwrap_or_else(|e| e.into_inner()).0;
            }
            drop(st);
            threads
                .into_iter()
                .map(|t| {
                    t.join().unwrap_or_else(|_| Err(Error::Internal("a rank thread ended without a result".into())))
                })
                .collect()
        });
        if let Some(e) = self.failure() {
            return Err(e);
        }
        results.into_iter().collect()
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
