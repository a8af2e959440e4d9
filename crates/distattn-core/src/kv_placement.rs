//! A KV cache spread over ranks (Infinite-LLM's DistAttention): where each request's cached
//! tokens live, and the attention problem of one serving step over such a cache.
//!
//! A [`KvPlacement`] cuts every request's token positions into blocks of `block_tokens` and
//! deals the blocks out starting at the request's home rank, round-robin (block `j` of a
//! request homed on `h` lives on rank `(h + j) mod P`) or zig-zag (ranks `h, h+1, …, h+P−1`,
//! then back down, and again). Blocks as large as a request's capacity split by P give
//! contiguous chunks ([`KvPlacement::contiguous`]); blocks of one page give interleaved pages
//! ([`KvPlacement::interleaved`]); two blocks per rank dealt zig-zag give each rank an early
//! and a late chunk ([`KvPlacement::zigzag`]), so a causal prompt's work is even. A token
//! appended at position `p` goes to [`KvPlacement::owner`] of `p`, so appends never move what
//! is cached.
//!
//! [`ServingStep`] is one step of a batch of requests (decode, speculative or chunked steps,
//! prefill onto a cached prefix) as one packed attention problem: the new tokens of every
//! request are the query rows, its cached and new tokens the keys, a bottom-right causal mask
//! inside each request; the layout puts each key where the placement keeps it and each query
//! on its request's home rank (decode) or beside its own key (prefill), as [`Queries`] says. Planned with pass-q, the queries travel and the cache stays;
//! with a ring over the same layout (pass-KV), the cache travels.
//!
//! A request's keys are packed in position order, except a decode request's (one new token,
//! its query at home): its one query row sees every key, whatever their order, so its keys are
//! packed rank by rank (each rank's in position order). Each rank then holds one run of them,
//! and a step over a long cache of small pages plans in constant time, not in time linear in
//! its pages (26 ms a step for 1M tokens in 16-token pages on 2 ranks before).

use crate::plan::{Layout, LayoutKind, TokenSet};
use crate::{AttnShape, Error, Mask, Result};
use std::ops::Range;

/// How a request's tokens are dealt out to the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KvPlacement {
    pub world: usize,
    /// Tokens per block dealt to one rank.
    pub block_tokens: usize,
    /// Blocks go up and back down the ranks (zig-zag) rather than round and round.
    #[serde(default)]
    pub zigzag: bool,
}

impl KvPlacement {
    /// Contiguous chunks: a request of up to `capacity` tokens keeps its first
    /// `ceil(capacity / world)` tokens on its home rank, the next chunk on the next rank, …
    pub fn contiguous(capacity: usize, world: usize) -> Result<KvPlacement> {
        if capacity == 0 {
            return Err(Error::ZeroDim { what: "KV cache capacity" });
        }
        Self::new(capacity.div_ceil(world.max(1)), world)
    }

    /// Interleaved pages: page `j` of a request on rank `(home + j) mod world`.
    pub fn interleaved(page_size: usize, world: usize) -> Result<KvPlacement> {
        Self::new(page_size, world)
    }

    /// Zig-zag chunks: a request of up to `capacity` tokens in `2 · world` chunks, chunk `j`
    /// and chunk `2 · world − 1 − j` on rank `(home + j) mod world` (as zigzag rings split a
    /// training sequence): a prompt prefilled over them is causal-balanced.
    pub fn zigzag(capacity: usize, world: usize) -> Result<KvPlacement> {
        if capacity == 0 {
            return Err(Error::ZeroDim { what: "KV cache capacity" });
        }
        Ok(KvPlacement { zigzag: true, ..Self::new(capacity.div_ceil(2 * world.max(1)), world)? })
    }

    /// `pages:N`, `contiguous:N` / `zigzag:N` (chunks of requests of up to N tokens: a cache
    /// that grows keeps its placement) or `contiguous` / `zigzag` (chunks of requests of up to
    /// `capacity` tokens).
    pub fn from_spec(spec: &str, capacity: usize, world: usize) -> Result<KvPlacement> {
        let num = |n: &str| {
            n.parse::<usize>()
                .map_err(|_| Error::invalid("placement", format!("'{spec}': {n:?} is not a number of tokens")))
        };
        match spec.trim().split_once(':') {
            None if spec.trim() == "contiguous" => Self::contiguous(capacity, world),
            None if spec.trim() == "zigzag" => Self::zigzag(capacity, world),
            Some(("contiguous", n)) => Self::contiguous(num(n)?, world),
            Some(("zigzag", n)) => Self::zigzag(num(n)?, world),
            Some(("pages", n)) => Self::interleaved(num(n)?, world),
            _ => Err(Error::invalid(
                "placement",
                format!("expected pages:N, contiguous[:N] or zigzag[:N], got '{spec}'"),
            )),
        }
    }

    fn new(block_tokens: usize, world: usize) -> Result<KvPlacement> {
        if world == 0 {
            return Err(Error::ZeroDim { what: "world size" });
        }
        if block_tokens == 0 {
            return Err(Error::ZeroDim { what: "placement block" });
        }
        Ok(KvPlacement { world, block_tokens, zigzag: false })
    }

    /// The rank, counted from the home, that block `j` goes to.
    fn turn(&self, j: usize) -> usize {
        let p = self.world;
        match j % (2 * p) {
            c if self.zigzag && c >= p => 2 * p - 1 - c,
            _ => j % p,
        }
    }

    /// The rank holding position `pos` of a request homed on `home`.
    pub fn owner(&self, home: usize, pos: usize) -> usize {
        (home + self.turn(pos / self.block_tokens)) % self.world
    }

    /// How many positions (of `0..len`) of a request homed on `home` `rank` holds: the length
    /// of [`KvPlacement::positions`], counted without listing its blocks.
    pub fn held(&self, home: usize, len: usize, rank: usize) -> usize {
        let (p, bt) = (self.world, self.block_tokens);
        let mine = (rank + p - home % p) % p;
        let blocks = len.div_ceil(bt);
        // Blocks j < `blocks` this rank holds: j ≡ mine (mod P), or, zig-zag, j mod 2P one of
        // mine and 2P − 1 − mine (two different residues, as mine < P).
        let turn = if self.zigzag { 2 * p } else { p };
        let residues: &[usize] = if self.zigzag { &[mine, 2 * p - 1 - mine] } else { &[mine] };
        let count: usize = residues.iter().map(|&m| if m < blocks { (blocks - 1 - m) / turn + 1 } else { 0 }).sum();
        let last = blocks.checked_sub(1).filter(|j| residues.contains(&(j % turn)));
        // The last block may be short.
        count * bt - last.map_or(0, |j| (j + 1) * bt - len)
    }

    /// The positions (of `0..len`) of a request homed on `home` that `rank` holds, ascending.
    pub fn positions(&self, home: usize, len: usize, rank: usize) -> Vec<Range<usize>> {
        let mine = (rank + self.world - home % self.world) % self.world;
        let block = |j: usize| j * self.block_tokens..((j + 1) * self.block_tokens).min(len);
        let blocks = len.div_ceil(self.block_tokens);
        if !self.zigzag {
            return (mine..blocks).step_by(self.world).map(block).collect();
        }
        // Per turn of 2P blocks: block `mine` on the way up, `2P − 1 − mine` on the way down.
        let p = self.world;
        (0..blocks.div_ceil(2 * p))
            .flat_map(|t| [2 * p * t + mine, 2 * p * t + 2 * p - 1 - mine])
            .filter(|&j| j < blocks)
            .map(block)
            .collect()
    }
}

/// One request of a serving step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepRequest {
    /// The rank holding the request's queries and outputs.
    pub home: usize,
    /// Tokens already in the cache.
    pub cached: usize,
    /// New tokens this step (queries; their K/V appended to the cache first).
    pub new: usize,
}

/// Where a step's queries (and outputs) live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Queries {
    /// On the request's home rank: decode, and any step with few new tokens.
    AtHome,
    /// Each new token's beside its K/V: prefill, a long prompt's work spread like its cache.
    WithKeys,
}

/// One serving step over a placed cache as a packed attention problem (see the module).
#[derive(Debug, Clone, PartialEq)]
pub struct ServingStep {
    /// Batch 1; `q_len` = Σ new tokens, `k_len` = Σ (cached + new).
    pub shape: AttnShape,
    /// Bottom-right causal inside each request.
    pub mask: Mask,
    /// Queries at their home, keys where the placement keeps them.
    pub layout: Layout,
    /// Where each request's query rows start in the packed queries.
    pub q_offsets: Vec<usize>,
    /// Where each request's keys start in the packed keys (in position order, or rank by rank
    /// for a decode request: see the module).
    pub k_offsets: Vec<usize>,
}

impl ServingStep {
    /// The step of `requests` over a cache placed by `placement`, queries placed by `queries`.
    pub fn new(
        placement: &KvPlacement,
        requests: &[StepRequest],
        queries: Queries,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<ServingStep> {
        let queries_with_keys = queries == Queries::WithKeys;
        if requests.is_empty() {
            return Err(Error::ZeroDim { what: "requests" });
        }
        let p = placement.world;
        let (mut q_offsets, mut k_offsets) = (Vec::with_capacity(requests.len()), Vec::with_capacity(requests.len()));
        let (mut q_runs, mut k_runs) = (vec![Vec::new(); p], vec![Vec::new(); p]);
        let (mut q_len, mut k_len) = (0, 0);
        for (i, r) in requests.iter().enumerate() {
            if r.home >= p {
                return Err(Error::invalid("request", format!("{i} is homed on rank {}, of {p} ranks", r.home)));
            }
            if r.new == 0 {
                return Err(Error::invalid("request", format!("{i} has no new tokens")));
            }
            // Lengths are checked before any position list is built from them (a wrapped sum
            // would plan another request; a huge one would allocate its positions first).
            let n =
                r.cached.checked_add(r.new).filter(|&n| n <= crate::shape::MAX_SEQ_LEN - k_len).ok_or_else(|| {
                    Error::invalid(
                        "request",
                        format!(
                            "{i} ({} cached + {} new) takes the step past {} keys",
                            r.cached,
                            r.new,
                            crate::shape::MAX_SEQ_LEN
                        ),
                    )
                })?;
            q_offsets.push(q_len);
            k_offsets.push(k_len);
            let decode = r.new == 1 && !queries_with_keys;
            let mut packed = k_len; // a decode request's keys so far, rank by rank
            for (rank, runs) in k_runs.iter_mut().enumerate() {
                if decode {
                    let count = placement.held(r.home, n, rank);
                    if count > 0 {
                        runs.push(packed..packed + count);
                    }
                    packed += count;
                    continue;
                }
                let held = placement.positions(r.home, n, rank);
                if queries_with_keys {
                    // Query row j is position cached + j.
                    let rows = held.iter().filter_map(|x| {
                        let (a, b) = (x.start.max(r.cached), x.end);
                        (a < b).then(|| q_len + a - r.cached..q_len + b - r.cached)
                    });
                    q_runs[rank].extend(rows);
                }
                runs.extend(held.into_iter().map(|x| k_len + x.start..k_len + x.end));
            }
            if !queries_with_keys {
                q_runs[r.home].push(q_len..q_len + r.new);
            }
            q_len += r.new;
            k_len += n;
        }
        let shape = AttnShape::new(1, q_len, k_len, heads, kv_heads, head_dim)?;
        let q_lens: Vec<usize> = requests.iter().map(|r| r.new).collect();
        let k_lens: Vec<usize> = requests.iter().map(|r| r.cached + r.new).collect();
        let mask = Mask::per_document(&q_lens, &k_lens, Mask::causal)?;
        let layout = Layout {
            kind: LayoutKind::Placed,
            q: q_runs.into_iter().map(TokenSet::from_runs).collect(),
            k: k_runs.into_iter().map(TokenSet::from_runs).collect(),
        };
        layout.validate(q_len, k_len)?;
        Ok(ServingStep { shape, mask, layout, q_offsets, k_offsets })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlong_requests_are_errors_before_their_positions_are_built() {
        let pl = KvPlacement::interleaved(16, 2).unwrap();
        for (cached, new) in [(usize::MAX, 2), (usize::MAX, 1), (100_000_000_000, 2), (1 << 31, 1)] {
            let reqs = [StepRequest { home: 0, cached, new }];
            for queries in [Queries::AtHome, Queries::WithKeys] {
                let e = ServingStep::new(&pl, &reqs, queries, 4, 2, 16).unwrap_err();
                assert!(matches!(&e, Error::InvalidArgument { what, .. } if what == "request"), "{e}");
            }
        }
        // Two requests that fit alone but not together.
        let half = crate::shape::MAX_SEQ_LEN / 2 + 1;
        let reqs = [StepRequest { home: 0, cached: half, new: 1 }, StepRequest { home: 1, cached: half, new: 1 }];
        assert!(ServingStep::new(&pl, &reqs, Queries::AtHome, 4, 2, 16).is_err());
    }

    #[test]
    fn blocks_are_dealt_round_robin_from_the_home() {
        let pl = KvPlacement::interleaved(4, 3).unwrap();
        assert_eq!(pl.positions(1, 18, 1), vec![0..4, 12..16]);
        assert_eq!(pl.positions(1, 18, 2), vec![4..8, 16..18]);
        assert_eq!(pl.positions(1, 18, 0), vec![8..12]);
        for pos in 0..18 {
            let owner = pl.owner(1, pos);
            assert!(pl.positions(1, 18, owner).iter().any(|r| r.contains(&pos)));
        }
        let chunks = KvPlacement::contiguous(1000, 4).unwrap();
        assert_eq!(chunks.positions(0, 600, 2), vec![500..600]);
        assert!(chunks.positions(0, 600, 3).is_empty());
        for empty in [KvPlacement::interleaved(0, 2), KvPlacement::contiguous(0, 2), KvPlacement::zigzag(0, 2)] {
            assert!(matches!(empty, Err(Error::ZeroDim { .. })), "{empty:?}");
        }
        assert_eq!(KvPlacement::from_spec("pages:8", 100, 2).unwrap(), KvPlacement::interleaved(8, 2).unwrap());
        assert_eq!(KvPlacement::from_spec("contiguous", 100, 2).unwrap().block_tokens, 50);
        assert_eq!(KvPlacement::from_spec("contiguous:1000", 100, 2).unwrap().block_tokens, 500);
        assert!(matches!(KvPlacement::from_spec("pages:0", 100, 2), Err(Error::ZeroDim { .. })));
        for bad in ["pages:x", "pages", "chunks:4"] {
            let r = KvPlacement::from_spec(bad, 100, 2);
            assert!(matches!(&r, Err(Error::InvalidArgument { what, .. }) if what == "placement"), "{bad}: {r:?}");
        }
    }

    #[test]
    fn zigzag_chunks_go_up_the_ranks_and_back_down() {
        // Capacity 16 on 2 ranks: 4 chunks of 4; from home 1, ranks 1, 0, 0, 1; a longer
        // request starts another turn.
        let pl = KvPlacement::from_spec("zigzag:16", 9, 2).unwrap();
        assert_eq!(pl, KvPlacement::zigzag(16, 2).unwrap());
        assert_eq!((0..20).step_by(4).map(|p| pl.owner(1, p)).collect::<Vec<_>>(), vec![1, 0, 0, 1, 1]);
        assert_eq!(pl.positions(1, 20, 1), vec![0..4, 12..16, 16..20]);
        assert_eq!(pl.positions(1, 14, 0), vec![4..8, 8..12]);
        for (world, len) in [(3, 31), (4, 64), (1, 5)] {
            let pl = KvPlacement::zigzag(24, world).unwrap();
            for home in 0..world {
                let mut seen = vec![0; len];
                for rank in 0..world {
                    for r in pl.positions(home, len, rank) {
                        for pos in r {
                            assert_eq!(pl.owner(home, pos), rank, "world {world} home {home} pos {pos}");
                            seen[pos] += 1;
                        }
                    }
                }
                assert!(seen.iter().all(|&n| n == 1), "every position held once");
            }
        }
        assert_eq!(KvPlacement::from_spec("zigzag", 100, 2).unwrap().block_tokens, 25);
        assert!(KvPlacement::from_spec("zigzag:x", 100, 2).is_err());
    }

    #[test]
    fn a_step_packs_requests_and_places_their_tokens() {
        let pl = KvPlacement::interleaved(2, 2).unwrap();
        let reqs = [StepRequest { home: 1, cached: 5, new: 1 }, StepRequest { home: 0, cached: 0, new: 3 }];
        let s = ServingStep::new(&pl, &reqs, Queries::AtHome, 4, 2, 8).unwrap();
        assert_eq!((s.shape.q_len, s.shape.k_len), (4, 9));
        assert_eq!(s.layout.q[1], TokenSet::range(0..1));
        assert_eq!(s.layout.q[0], TokenSet::range(1..4));
        // Request 0 (decode, 6 tokens, home 1): pages 2..4 on rank 0 and 0..2, 4..6 on rank 1,
        // packed rank by rank: rank 0's 2 keys first, then rank 1's 4. Request 1 (3 new tokens
        // at 6..9, home 0), in position order: 6..8 on rank 0, 8..9 on rank 1.
        assert_eq!(s.layout.k[0], TokenSet::from_runs(vec![0..2, 6..8]));
        assert_eq!(s.layout.k[1], TokenSet::from_runs(vec![2..6, 8..9]));
        let bad = [StepRequest { home: 2, cached: 1, new: 1 }];
        assert!(ServingStep::new(&pl, &bad, Queries::AtHome, 4, 2, 8).is_err());
        // Prefill: request 1's query rows 1..4 are positions 0..3, on ranks 0, 0, 1.
        // Beside their keys, one new token's keys keep position order too.
        let s = ServingStep::new(&pl, &reqs, Queries::WithKeys, 4, 2, 8).unwrap();
        assert_eq!(s.layout.q[0], TokenSet::range(1..3));
        assert_eq!(s.layout.q[1], TokenSet::from_runs(vec![0..1, 3..4]));
        assert_eq!(s.layout.k[1], TokenSet::from_runs(vec![0..2, 4..6, 8..9]));
        assert_eq!(s.layout.k[0], TokenSet::from_runs(vec![2..4, 6..8]));
    }

    #[test]
    fn held_counts_what_positions_lists() {
        for world in 1..5 {
            for block in [1, 3, 16] {
                for pl in [
                    KvPlacement::interleaved(block, world).unwrap(),
                    KvPlacement::zigzag(block * 2 * world, world).unwrap(),
                ] {
                    for home in 0..world {
                        for len in 0..70 {
                            for rank in 0..world {
                                let listed: usize = pl.positions(home, len, rank).iter().map(|x| x.len()).sum();
                                assert_eq!(
                                    pl.held(home, len, rank),
                                    listed,
                                    "{pl:?} home {home} len {len} rank {rank}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_decode_step_over_small_pages_holds_one_run_a_rank() {
        // 1M cached tokens in 16-token pages over 3 ranks, two decode requests.
        let pl = KvPlacement::interleaved(16, 3).unwrap();
        let reqs = [StepRequest { home: 2, cached: 1 << 20, new: 1 }, StepRequest { home: 0, cached: 1000, new: 1 }];
        let s = ServingStep::new(&pl, &reqs, Queries::AtHome, 4, 2, 8).unwrap();
        for (rank, k) in s.layout.k.iter().enumerate() {
            assert_eq!(k.to_runs().len(), 2, "rank {rank}: {:?}", k.to_runs().first());
            let held: usize = reqs
                .iter()
                .map(|r| pl.positions(r.home, r.cached + 1, rank).iter().map(|x| x.len()).sum::<usize>())
                .sum();
            assert_eq!(k.len(), held, "rank {rank} holds as many keys as the placement gives it");
        }
    }
}
