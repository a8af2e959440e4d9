//! The communicator interface of distributed attention.
//!
//! One interface for every transport: ranks as threads of one process (crate `distattn-dist`)
//! and NCCL next. Buffers are the transport's own type ([`Communicator::Buf`]: host bytes for
//! threads, device memory for NCCL); sizes are known to both sides in advance (plans carry every
//! buffer's descriptor), as NCCL requires. Point-to-point traffic is posted as a group — all
//! sends and receives of the group together, so rings cannot deadlock whatever the order.
//!
//! Failure is part of the contract: when a rank fails (error or panic), it calls
//! [`Communicator::abort`] (the thread runner does so itself) and every peer blocked in, or later
//! entering, a communication call returns [`Error::RankFailed`] naming that rank instead of
//! hanging; a peer silent beyond the timeout gives [`Error::Comm`].
//!
//! [`Error::RankFailed`]: crate::Error::RankFailed
//! [`Error::Comm`]: crate::Error::Comm

use crate::Result;

/// Collective and point-to-point communication among `world()` ranks.
pub trait Communicator: Send {
    /// The buffer type moved (bytes for host transports).
    type Buf: ?Sized;

    fn rank(&self) -> usize;
    fn world(&self) -> usize;

    /// Posts every send and receive together and returns when all have completed. Messages
    /// between one pair of ranks are matched in posting order. Each receive buffer must have
    /// exactly the size of the matching send.
    fn group(&self, sends: &[(usize, &Self::Buf)], recvs: &mut [(usize, &mut Self::Buf)]) -> Result<()>;

    /// Every rank contributes `send`; `recv` (world × its size) gets rank i's at slot i.
    fn all_gather(&self, send: &Self::Buf, recv: &mut Self::Buf) -> Result<()>;

    /// `send` is world equal slots; slot j goes to rank j; `recv` slot i comes from rank i.
    fn all_to_all(&self, send: &Self::Buf, recv: &mut Self::Buf) -> Result<()>;

    /// `send` holds world equal slots of f32 values; rank j gets the element-wise sum over
    /// ranks of slot j in `recv`.
    fn reduce_scatter_f32(&self, send: &Self::Buf, recv: &mut Self::Buf) -> Result<()>;

    /// Returns when every rank has entered the barrier.
    fn barrier(&self) -> Result<()>;

    /// Declares this rank failed; peers' pending and future calls return an error naming it.
    fn abort(&self, reason: &str);
}

/// Plain-old-data element types that may be viewed as bytes.
///
/// # Safety
/// Implementors must have no padding, no invalid bit patterns and no pointers.
pub unsafe trait Pod: Copy + Send + Sync + 'static {}
unsafe impl Pod for u8 {}
unsafe impl Pod for u16 {}
unsafe impl Pod for u32 {}
unsafe impl Pod for u64 {}
unsafe impl Pod for f32 {}
unsafe impl Pod for f64 {}
unsafe impl Pod for half::bf16 {}
unsafe impl Pod for half::f16 {}

/// A typed slice as bytes.
pub fn as_bytes<T: Pod>(x: &[T]) -> &[u8] {
    // SAFETY: T is Pod, so every byte of the slice is initialised and readable as u8.
    unsafe { std::slice::from_raw_parts(x.as_ptr() as *const u8, std::mem::size_of_val(x)) }
}

/// A typed mutable slice as bytes.
pub fn as_bytes_mut<T: Pod>(x: &mut [T]) -> &mut [u8] {
    // SAFETY: T is Pod, so any byte pattern written is a valid T.
    unsafe { std::slice::from_raw_parts_mut(x.as_mut_ptr() as *mut u8, std::mem::size_of_val(x)) }
}
