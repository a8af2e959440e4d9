//! The communicator interface: one for every transport — ranks as threads of one process
//! ([`crate::threads::ThreadComm`], host bytes) and NCCL (crate `distattn-nccl`, device
//! memory).
//!
//! Buffers are the transport's own type ([`Communicator::Buf`]); sizes are known to both sides
//! in advance (plans carry every buffer's descriptor), as NCCL requires. Point-to-point traffic
//! is posted as a group — all sends and receives of the group together — so rings cannot
//! deadlock whatever the order.
//!
//! Failure is part of the contract: when a rank fails (error or panic), it calls
//! [`Communicator::abort`] (the runners do so themselves) and every peer blocked in, or later
//! entering, a communication call returns [`Error::RankFailed`] naming that rank instead of
//! hanging; a peer silent beyond the timeout gives [`Error::Comm`].
//!
//! [`Error::RankFailed`]: distattn_core::Error::RankFailed
//! [`Error::Comm`]: distattn_core::Error::Comm

use distattn_core::Result;

/// Collective and point-to-point communication among `world()` ranks.
pub trait Communicator: Send {
    /// The buffer type moved (bytes for host transports, device buffers for NCCL).
    type Buf: ?Sized;

    fn rank(&self) -> usize;
    fn world(&self) -> usize;

    /// Posts every send and receive together as one group, in order after the transfers
    /// posted before it. A device transport enqueues the group on its stream (the comm lane of
    /// the backend it serves) and returns; a host transport returns once the group is done.
    /// Messages between one pair of ranks are matched in posting order, and each receive
    /// buffer has exactly the size of the matching send.
    ///
    /// # Safety
    /// A device transport's transfers run after the call returns, beyond the borrows: until
    /// work ordered after the transport's lane (its stream, or an event recorded on it), the
    /// caller frees none of the buffers, writes no send buffer, and reads or writes no receive
    /// buffer. (The interpreter orders every later use of them so; a host transport's group
    /// has completed on return.)
    unsafe fn group(&self, sends: &[(usize, &Self::Buf)], recvs: &mut [(usize, &mut Self::Buf)]) -> Result<()>;

    /// Every rank contributes `send`; `recv` (world × its size) gets rank i's at slot i.
    /// Returns when the data is in `recv`.
    fn all_gather(&self, send: &Self::Buf, recv: &mut Self::Buf) -> Result<()>;

    /// `send` is world equal slots; slot j goes to rank j; `recv` slot i comes from rank i.
    /// Returns when the data is in `recv`.
    fn all_to_all(&self, send: &Self::Buf, recv: &mut Self::Buf) -> Result<()>;

    /// `send` holds world equal slots of f32 values; rank j gets the element-wise sum over
    /// ranks of slot j in `recv`. Returns when the data is in `recv`.
    fn reduce_scatter_f32(&self, send: &Self::Buf, recv: &mut Self::Buf) -> Result<()>;

    /// Returns when every rank has entered the barrier.
    fn barrier(&self) -> Result<()>;

    /// Declares this rank failed; peers' pending and future calls return an error naming it.
    fn abort(&self, reason: &str);

    /// The failure this transport has seen (a peer's abort, a transport error, a stall), if
    /// any, as an error. Polled while waiting for work to finish.
    fn check(&self) -> Result<()> {
        Ok(())
    }

    /// Starts the stall clock for a stretch of work unless it runs already (then `false`):
    /// a transport that can abort a stuck rank (NCCL) does so once no progress is reported
    /// for longer than its timeout. Host transports time out inside their calls instead.
    fn stall_watch_begin(&self) -> bool {
        false
    }

    /// Reports progress of the watched work (restarts the stall clock).
    fn stall_watch_progress(&self) {}

    /// Stops the stall clock.
    fn stall_watch_end(&self) {}

    /// Completes a run handed to this transport to watch ([`crate::execute_deferred`]): waits
    /// for it, or returns the failure it met. Runs call it first; a transport that takes no
    /// runs to watch has nothing to do.
    fn settle(&self) -> Result<()> {
        Ok(())
    }
}
