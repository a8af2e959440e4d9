//! One rank of a context-parallel call, in a process that holds only its own shards — what a
//! training framework runs, with one process per GPU started by `torchrun` or Slurm.
//!
//! [`RankAttention`] is the problem of the whole sequence (shape, mask, strategy, world) seen
//! from one rank: which tokens it holds ([`RankAttention::tokens`]: its Q, K and V shards are
//! those rows of the whole tensors, in ascending order), and `forward` / `backward` running this
//! rank's program of the strategy's plan through the one interpreter, on any backend and
//! communicator, with the caller's buffers as inputs.

use distattn_core::plan::{BufDesc, Layout, Pass, Plan, Tensor, TokenSet};
use distattn_core::planner::build;
use distattn_core::schedule::Lane;
use distattn_core::{AttnOptions, AttnShape, DType, Error, Mask, PlanOptions, Result, Strategy};
use distattn_exec::{execute_deferred, Backend, Communicator, Completion, PreparedRank};
use std::sync::{Arc, Mutex};

/// The whole problem of a context-parallel call, seen from rank `rank` of `world`.
///
/// ```
/// use distattn::{AttnShape, Mask, RankAttention, Strategy};
///
/// // 1000 tokens over 4 ranks by the zig-zag ring: rank 1 holds chunks 1 and 6 of 8.
/// let shape = AttnShape::new(1, 1000, 1000, 8, 2, 64)?;
/// let rank = RankAttention::new(shape, Mask::causal(1000, 1000)?, Strategy::Zigzag, 4, 1)?;
/// assert_eq!(rank.tokens().to_runs(), vec![125..250, 750..875]);
/// assert_eq!(rank.local_shape().q_len, 250);
/// # Ok::<(), distattn::Error>(())
/// ```
pub struct RankAttention {
    shape: AttnShape,
    mask: Mask,
    opts: AttnOptions,
    strategy: Strategy,
    plan_opts: PlanOptions,
    world: usize,
    rank: usize,
    /// Every rank's query and key tokens (the strategy's layout, or the caller's placement).
    layout: Layout,
    /// Prepared programs by (pass, dtype), built on first use.
    programs: Mutex<Vec<Arc<PreparedRank>>>,
    /// The forward plan built when the problem was checked, kept for the first forward
    /// program: a plan's steps do not depend on the dtype, only its buffers' sizes do.
    forward_plan: Mutex<Option<Plan>>,
}

impl RankAttention {
    /// Rank `rank` of `world` running `strategy` on the self-attention problem `shape` (whole
    /// sequence; `q_len == k_len`) under `mask`, softmax scale `1/sqrt(head_dim)`.
    pub fn new(shape: AttnShape, mask: Mask, strategy: Strategy, world: usize, rank: usize) -> Result<Self> {
        Self::with_options(shape, mask, strategy, world, rank, PlanOptions::default())
    }

    /// As [`RankAttention::new`], with planner options.
    pub fn with_options(
        shape: AttnShape,
        mask: Mask,
        strategy: Strategy,
        world: usize,
        rank: usize,
        plan_opts: PlanOptions,
    ) -> Result<Self> {
        if shape.q_len != shape.k_len {
            return Err(Error::invalid(
                "shape",
                format!(
                    "context parallelism shards one sequence: q_len ({}) must equal k_len ({})",
                    shape.q_len, shape.k_len
                ),
            ));
        }
        let me = Self::planned(shape, mask, strategy, world, rank, plan_opts)?;
        if let Some(r) = (0..world).find(|&r| me.layout.q[r] != me.layout.k[r]) {
            return Err(Error::invalid(
                "strategy",
                format!("{strategy} places rank {r}'s queries and keys on different tokens; a shard must hold both"),
            ));
        }
        Ok(me)
    }

    /// Rank `rank` of a problem whose tokens the caller places (`layout`: where each query and
    /// each key lives, as a KV cache spread over the ranks puts them; see
    /// [`crate::kv_placement::ServingStep`]), run by `strategy` (pass-q or ring). Queries and
    /// keys may differ in number and place.
    pub fn placed(
        shape: AttnShape,
        mask: Mask,
        layout: Layout,
        strategy: Strategy,
        world: usize,
        rank: usize,
    ) -> Result<Self> {
        let plan_opts = PlanOptions { layout: Some(layout), ..PlanOptions::default() };
        Self::planned(shape, mask, strategy, world, rank, plan_opts)
    }

    /// As [`RankAttention::placed`], from the forward plan the caller already built with its
    /// placement (`planner::fastest`'s choice, say), which is not planned again.
    pub fn placed_plan(plan: Plan, mask: Mask, rank: usize) -> Result<Self> {
        if plan.pass != Pass::Forward {
            return Err(Error::invalid("plan", format!("a forward plan is needed, not a {:?} one", plan.pass)));
        }
        let plan_opts = PlanOptions { layout: Some(plan.layout.clone()), ..PlanOptions::default() };
        Self::with_plan(plan, mask, plan_opts, rank)
    }

    /// Checks the problem against the strategy by planning its forward once.
    fn planned(
        shape: AttnShape,
        mask: Mask,
        strategy: Strategy,
        world: usize,
        rank: usize,
        plan_opts: PlanOptions,
    ) -> Result<Self> {
        let plan = build(strategy, world, &shape, &mask, DType::F32, &plan_opts.with_pass(Pass::Forward))?;
        Self::with_plan(plan, mask, plan_opts, rank)
    }

    /// Rank `rank` of a checked forward plan, built with `plan_opts`.
    fn with_plan(plan: Plan, mask: Mask, plan_opts: PlanOptions, rank: usize) -> Result<Self> {
        if rank >= plan.world {
            return Err(Error::invalid("rank", format!("{rank} is not a rank of a world of {}", plan.world)));
        }
        Ok(RankAttention {
            shape: plan.shape,
            mask,
            opts: AttnOptions::default(),
            strategy: plan.strategy,
            plan_opts,
            world: plan.world,
            rank,
            layout: plan.layout.clone(),
            programs: Mutex::new(Vec::new()),
            forward_plan: Mutex::new(Some(plan)),
        })
    }

    /// Sets the softmax scale (`None`: `1/sqrt(head_dim)`); it must be positive and finite.
    pub fn scale(mut self, scale: Option<f32>) -> Result<Self> {
        AttnOptions { scale }.scale_for(self.shape.head_dim)?;
        self.opts.scale = scale;
        Ok(self)
    }

    /// The global positions of this rank's tokens, ascending: its shards of Q, K, V (and of O,
    /// dO and the gradients) are these rows of the whole tensors, in this order. (With a
    /// placement, the query rows; K and V hold [`RankAttention::kv_tokens`].)
    pub fn tokens(&self) -> &TokenSet {
        &self.layout.q[self.rank]
    }

    /// The global positions of this rank's keys (its rows of K, V, dK, dV), ascending.
    pub fn kv_tokens(&self) -> &TokenSet {
        &self.layout.k[self.rank]
    }

    /// Every rank's query and key tokens (what gathering the shards back needs).
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The shape of this rank's shards: the whole shape with this rank's query and key rows.
    pub fn local_shape(&self) -> AttnShape {
        AttnShape { q_len: self.tokens().len(), k_len: self.kv_tokens().len(), ..self.shape }
    }

    pub fn shape(&self) -> &AttnShape {
        &self.shape
    }

    pub fn strategy(&self) -> Strategy {
        self.strategy
    }

    pub fn world(&self) -> usize {
        self.world
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    /// This rank's program of `pass` for inputs of `dtype`, planned and prepared once.
    pub fn program(&self, pass: Pass, dtype: DType) -> Result<Arc<PreparedRank>> {
        let mut programs =
            self.programs.lock().map_err(|_| Error::Internal("the program table was poisoned".into()))?;
        if let Some(p) = programs.iter().find(|p| p.pass == pass && p.dtype == dtype) {
            return Ok(p.clone());
        }
        let kept = match pass {
            Pass::Forward => {
                self.forward_plan.lock().map_err(|_| Error::Internal("the plan was poisoned".into()))?.take()
            }
            _ => None,
        };
        let plan = match kept {
            Some(plan) => Plan { dtype, ..plan },
            None => build(self.strategy, self.world, &self.shape, &self.mask, dtype, &self.plan_opts.with_pass(pass))?,
        };
        self.check_shards(&plan)?;
        let prog = Arc::new(distattn_exec::prepare(&plan, self.rank, &self.mask)?);
        programs.push(prog.clone());
        Ok(prog)
    }

    /// Every input and output of this rank is a whole shard (its own tokens, every head), but
    /// a backward's inputs that the forward kept ([`RankAttention::kept`]).
    fn check_shards(&self, plan: &Plan) -> Result<()> {
        let prog = &plan.ranks[self.rank];
        let kept =
            |t: Tensor| plan.pass == Pass::Backward && self.plan_opts.keep_head_sharded && t.is_kept_head_sharded();
        for &(tensor, id) in prog.inputs.iter().chain(&prog.outputs).filter(|&&(t, _)| !kept(t)) {
            let d = &prog.bufs[id];
            let heads = if tensor.is_kv() { self.shape.kv_heads } else { self.shape.heads };
            if d.tokens != *self.layout.tokens(tensor, self.rank) || d.heads != (0..heads) {
                return Err(Error::InvalidPlan(format!(
                    "{} on rank {}: {tensor:?} is not the rank's shard (tokens {:?}, heads {:?})",
                    self.strategy, self.rank, d.tokens, d.heads
                )));
            }
        }
        Ok(())
    }

    /// O (`[b, n_local, h, d]`: f32, or `dtype` with [`PlanOptions::narrow_outputs`]) and LSE
    /// (f32, `[b, h, n_local]`, natural log) of this rank's queries against the whole sequence,
    /// from its shards of Q, K, V (of `dtype`, written on the backend's compute lane). Every
    /// rank of the world calls it together.
    pub fn forward<B, C>(
        &self,
        backend: &B,
        comm: &C,
        dtype: DType,
        q: B::Buf,
        k: B::Buf,
        v: B::Buf,
    ) -> Result<[B::Buf; 2]>
    where
        B: Backend,
        C: Communicator<Buf = B::CommBuf>,
    {
        self.forward_deferred(backend, comm, dtype, q, k, v)?.wait(backend, comm)
    }

    /// [`RankAttention::forward`] that returns once the run is issued: O and LSE are valid in
    /// the backend's compute order, and the caller owns the run's [`Completion`] (waits for it,
    /// or hands it to the transport to watch).
    pub fn forward_deferred<B, C>(
        &self,
        backend: &B,
        comm: &C,
        dtype: DType,
        q: B::Buf,
        k: B::Buf,
        v: B::Buf,
    ) -> Result<Deferred<B, 2>>
    where
        B: Backend,
        C: Communicator<Buf = B::CommBuf>,
    {
        let prog = self.program(Pass::Forward, dtype)?;
        let (run, completion) = self.run(&prog, backend, comm, [(Tensor::Q, q), (Tensor::K, k), (Tensor::V, v)])?;
        let outputs = take_outputs(&prog, run.outputs, [Tensor::O, Tensor::Lse])?;
        Ok(Deferred { outputs, saved: run.saved, completion })
    }

    /// What this rank's forward keeps for its backward, in the order of [`Deferred::saved`]:
    /// with [`PlanOptions::keep_head_sharded`], Ulysses and hybrid keep the head-sharded Q, K,
    /// V (`[b, tokens, heads, d]`, of the inputs' dtype) and LSE (f32, `[b, heads, tokens]`)
    /// they computed with; otherwise nothing. The backward then takes these buffers as its Q,
    /// K, V and LSE, so only dO and D cross the links again.
    pub fn kept(&self, dtype: DType) -> Result<Vec<(Tensor, Vec<usize>)>> {
        let prog = self.program(Pass::Forward, dtype)?;
        let dims = |d: &BufDesc| {
            let (b, n, h) = (self.shape.batch, d.tokens.len(), d.heads.len());
            if d.tensor.is_stats() {
                vec![b, h, n]
            } else {
                vec![b, n, h, self.shape.head_dim]
            }
        };
        Ok(prog.saved.iter().map(|&(t, id)| (t, dims(&prog.bufs[id]))).collect())
    }

    /// dQ, dK, dV (like this rank's shards; f32, or `dtype` with [`PlanOptions::narrow_outputs`])
    /// from its shards of Q, K, V and dO (of `dtype`), the forward's LSE and D = rowsum(dO ∘ O)
    /// of its rows (f32, `[b, h, n_local]`). Where the forward kept buffers
    /// ([`RankAttention::kept`]), Q, K, V and LSE are those instead. Every rank of the world calls
    /// it together.
    #[allow(clippy::too_many_arguments)] // one buffer per tensor of a backward pass
    pub fn backward<B, C>(
        &self,
        backend: &B,
        comm: &C,
        dtype: DType,
        q: B::Buf,
        k: B::Buf,
        v: B::Buf,
        d_o: B::Buf,
        lse: B::Buf,
        delta: B::Buf,
    ) -> Result<[B::Buf; 3]>
    where
        B: Backend,
        C: Communicator<Buf = B::CommBuf>,
    {
        self.backward_deferred(backend, comm, dtype, q, k, v, d_o, lse, delta)?.wait(backend, comm)
    }

    /// [`RankAttention::backward`] that returns once the run is issued (as
    /// [`RankAttention::forward_deferred`]).
    #[allow(clippy::too_many_arguments)] // one buffer per tensor of a backward pass
    pub fn backward_deferred<B, C>(
        &self,
        backend: &B,
        comm: &C,
        dtype: DType,
        q: B::Buf,
        k: B::Buf,
        v: B::Buf,
        d_o: B::Buf,
        lse: B::Buf,
        delta: B::Buf,
    ) -> Result<Deferred<B, 3>>
    where
        B: Backend,
        C: Communicator<Buf = B::CommBuf>,
    {
        let prog = self.program(Pass::Backward, dtype)?;
        let given = [
            (Tensor::Q, q),
            (Tensor::K, k),
            (Tensor::V, v),
            (Tensor::DO, d_o),
            (Tensor::Lse, lse),
            (Tensor::Delta, delta),
        ];
        let (run, completion) = self.run(&prog, backend, comm, given)?;
        let outputs = take_outputs(&prog, run.outputs, [Tensor::DQ, Tensor::DK, Tensor::DV])?;
        Ok(Deferred { outputs, saved: run.saved, completion })
    }

    /// Issues `prog` on `given` (its inputs, in any order): its outputs in program order and the
    /// run's completion.
    fn run<B, C, const N: usize>(
        &self,
        prog: &PreparedRank,
        backend: &B,
        comm: &C,
        given: [(Tensor, B::Buf); N],
    ) -> Result<distattn_exec::Deferred<B>>
    where
        B: Backend,
        C: Communicator<Buf = B::CommBuf>,
    {
        let mut given: Vec<Option<(Tensor, B::Buf)>> = given.into_iter().map(Some).collect();
        let mut inputs = Vec::with_capacity(prog.inputs.len());
        for &(tensor, _) in &prog.inputs {
            let slot = given.iter_mut().find(|g| g.as_ref().is_some_and(|(t, _)| *t == tensor));
            let (_, buf) = slot.and_then(Option::take).ok_or_else(|| {
                Error::InvalidPlan(format!(
                    "{} takes {tensor:?} as an input more than once or unexpectedly",
                    self.strategy
                ))
            })?;
            inputs.push(buf);
        }
        // Inputs this rank's program does not read (a rank with nothing to compute).
        for (_, buf) in given.into_iter().flatten() {
            backend.free(Lane::Compute, buf);
        }
        execute_deferred(prog, backend, comm, &self.opts, inputs)
    }
}

/// A call's outputs, returned once its run is issued (valid in the backend's compute order),
/// what a forward keeps for its backward, and the run's completion, which the caller waits for
/// or hands to the transport.
pub struct Deferred<B: Backend, const N: usize> {
    pub outputs: [B::Buf; N],
    /// A forward's buffers for its backward ([`RankAttention::kept`] says which); empty for
    /// the others.
    pub saved: Vec<B::Buf>,
    pub completion: Completion<B::Event>,
}

impl<B: Backend, const N: usize> Deferred<B, N> {
    /// The outputs once the run has completed on the device (what the waiting calls return);
    /// the saved buffers are released.
    pub fn wait<C: Communicator>(self, backend: &B, comm: &C) -> Result<[B::Buf; N]> {
        self.completion.wait(backend, comm)?;
        for buf in self.saved {
            backend.free(Lane::Compute, buf);
        }
        Ok(self.outputs)
    }
}

/// The outputs of `prog` in the order of `want`.
fn take_outputs<Buf, const N: usize>(prog: &PreparedRank, outs: Vec<Buf>, want: [Tensor; N]) -> Result<[Buf; N]> {
    let mut outs: Vec<Option<(Tensor, Buf)>> = prog.outputs.iter().map(|&(t, _)| t).zip(outs).map(Some).collect();
    let mut taken = Vec::with_capacity(N);
    for t in want {
        let slot = outs.iter_mut().find(|o| o.as_ref().is_some_and(|(x, _)| *x == t)).and_then(Option::take);
        taken.push(slot.ok_or_else(|| Error::InvalidPlan(format!("the program returns no {t:?}")))?.1);
    }
    taken.try_into().map_err(|_| Error::Internal("output count".into()))
}
