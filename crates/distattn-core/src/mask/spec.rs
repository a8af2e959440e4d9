//! Masks named by short strings, for the command line and for benchmark rows.
//!
//! | spec | mask |
//! |---|---|
//! | `full` | every query sees every key |
//! | `causal` | bottom-right-aligned causal |
//! | `window:L,R` | sliding window, `L` keys left and `R` right of the diagonal (`-` = unbounded) |
//! | `window-global:L,R,G` | sliding window plus `G` global leading tokens |
//! | `docs:A,B,…` / `docs-causal:A,B,…` | packed documents of lengths A, B, … (full / causal inside) |
//! | `docs-random:SEED` / `docs-random-causal:SEED` | packed documents with long-tailed lengths drawn deterministically from `SEED` ([`long_tailed_doc_lens`](super::long_tailed_doc_lens)) |
//! | `prefix:P` | prefix-LM with a bidirectional prefix of `P` tokens |
//! | `prefix-docs:A/P,B/Q,…` | prefix-LM inside documents (length/prefix) |
//! | `shared-question:Q,A1,A2,…` | question of `Q` tokens shared by answers A1, A2, … |
//! | `block-causal:B` | causal at block granularity `B` |
//! | `block-causal-docs:B:A,B,…` | block-causal inside documents |
//! | `blocks:BQ,BK:0110…` | arbitrary block mask, row-major, `1` = kept |
//!
//! Document lengths must add up to the sequence length.

use super::{DocKind, Mask};
use crate::{Error, Result};
use std::fmt;
use std::str::FromStr;

/// A mask described independently of the sequence length.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum MaskSpec {
    Full,
    Causal,
    Window { left: Option<usize>, right: Option<usize> },
    WindowGlobal { left: Option<usize>, right: Option<usize>, global: usize },
    Documents { lens: Vec<usize>, kind: DocKind },
    RandomDocuments { seed: u64, kind: DocKind },
    Prefix { prefix: usize },
    PrefixDocuments { docs: Vec<(usize, usize)> },
    SharedQuestion { question: usize, answers: Vec<usize> },
    BlockCausal { block: usize },
    BlockCausalDocuments { block: usize, lens: Vec<usize> },
    Blocks { block_q: usize, block_k: usize, keep: Vec<bool> },
}

impl MaskSpec {
    /// Builds the mask for a `q_len × k_len` score matrix.
    pub fn build(&self, q_len: usize, k_len: usize) -> Result<Mask> {
        let square = || -> Result<usize> {
            if q_len != k_len {
                return Err(Error::InvalidMask(format!(
                    "mask '{self}' needs equal query and key lengths, got {q_len} and {k_len}"
                )));
            }
            Ok(q_len)
        };
        let total = |lens: &[usize]| -> Result<()> {
            let sum = lens.iter().try_fold(0usize, |acc, &l| acc.checked_add(l));
            if sum != Some(square()?) {
                let sum = sum.map_or("more than the largest integer".to_string(), |s| s.to_string());
                return Err(Error::InvalidMask(format!(
                    "document lengths add up to {sum}, but the sequence has {q_len} tokens"
                )));
            }
            Ok(())
        };
        match self {
            MaskSpec::Full => Mask::full(q_len, k_len),
            MaskSpec::Causal => Mask::causal(q_len, k_len),
            MaskSpec::Window { left, right } => Mask::sliding_window(q_len, k_len, *left, *right),
            MaskSpec::WindowGlobal { left, right, global } => Mask::window_global(square()?, *left, *right, *global),
            MaskSpec::Documents { lens, kind } => {
                total(lens)?;
                Mask::documents(lens, *kind)
            }
            MaskSpec::RandomDocuments { seed, kind } => {
                Mask::documents(&super::long_tailed_doc_lens(square()?, *seed), *kind)
            }
            MaskSpec::Prefix { prefix } => Mask::prefix_lm(square()?, *prefix),
            MaskSpec::PrefixDocuments { docs } => {
                total(&docs.iter().map(|d| d.0).collect::<Vec<_>>())?;
                Mask::prefix_lm_documents(docs)
            }
            MaskSpec::SharedQuestion { question, answers } => {
                total(&[&[*question][..], answers].concat())?;
                Mask::shared_question(*question, answers)
            }
            MaskSpec::BlockCausal { block } => Mask::block_causal(square()?, *block),
            MaskSpec::BlockCausalDocuments { block, lens } => {
                total(lens)?;
                Mask::block_causal_documents(lens, *block)
            }
            MaskSpec::Blocks { block_q, block_k, keep } => Mask::block_mask(q_len, k_len, *block_q, *block_k, keep),
        }
    }

    /// Document lengths of a packed-documents mask over `n` tokens (for document-aware
    /// layouts), if the mask is one.
    pub fn doc_lens(&self, n: usize) -> Option<Vec<usize>> {
        match self {
            MaskSpec::Documents { lens, .. } | MaskSpec::BlockCausalDocuments { lens, .. } => Some(lens.clone()),
            MaskSpec::RandomDocuments { seed, .. } => Some(super::long_tailed_doc_lens(n, *seed)),
            MaskSpec::PrefixDocuments { docs } => Some(docs.iter().map(|d| d.0).collect()),
            _ => None,
        }
    }

    /// Whether the mask is causal-like (for the FLOP convention of reports).
    pub fn is_causal(&self) -> bool {
        matches!(self, MaskSpec::Causal)
    }
}

fn bad(spec: &str, reason: impl Into<String>) -> Error {
    Error::MaskSpec { spec: spec.to_string(), reason: reason.into() }
}

fn num(spec: &str, s: &str) -> Result<usize> {
    s.trim().parse().map_err(|_| bad(spec, format!("'{s}' is not a non-negative integer")))
}

fn opt_num(spec: &str, s: &str) -> Result<Option<usize>> {
    match s.trim() {
        "-" | "inf" => Ok(None),
        v => num(spec, v).map(Some),
    }
}

fn list(spec: &str, s: &str) -> Result<Vec<usize>> {
    s.split(',').map(|x| num(spec, x)).collect()
}

fn join(v: &[usize]) -> String {
    v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(",")
}

fn opt(v: &Option<usize>) -> String {
    v.map_or("-".to_string(), |x| x.to_string())
}

impl FromStr for MaskSpec {
    type Err = Error;

    fn from_str(spec: &str) -> Result<Self> {
        let (name, args) = spec.split_once(':').unwrap_or((spec, ""));
        let need_args = || -> Result<()> {
            if args.is_empty() {
                return Err(bad(spec, format!("'{name}' needs arguments, e.g. '{name}:…' (see --help)")));
            }
            Ok(())
        };
        match name {
            "full" | "causal" if !args.is_empty() => Err(bad(spec, format!("'{name}' takes no arguments"))),
            "full" => Ok(MaskSpec::Full),
            "causal" => Ok(MaskSpec::Causal),
            "window" => {
                need_args()?;
                let v: Vec<&str> = args.split(',').collect();
                let [l, r] = v[..] else { return Err(bad(spec, "expected window:LEFT,RIGHT")) };
                Ok(MaskSpec::Window { left: opt_num(spec, l)?, right: opt_num(spec, r)? })
            }
            "window-global" => {
                need_args()?;
                let v: Vec<&str> = args.split(',').collect();
                let [l, r, g] = v[..] else { return Err(bad(spec, "expected window-global:LEFT,RIGHT,GLOBAL")) };
                Ok(MaskSpec::WindowGlobal { left: opt_num(spec, l)?, right: opt_num(spec, r)?, global: num(spec, g)? })
            }
            "docs" | "docs-causal" => {
                need_args()?;
                let kind = if name == "docs" { DocKind::Full } else { DocKind::Causal };
                Ok(MaskSpec::Documents { lens: list(spec, args)?, kind })
            }
            "docs-random" | "docs-random-causal" => {
                need_args()?;
                let kind = if name == "docs-random" { DocKind::Full } else { DocKind::Causal };
                let seed = args.trim().parse().map_err(|_| bad(spec, format!("'{args}' is not a seed (u64)")))?;
                Ok(MaskSpec::RandomDocuments { seed, kind })
            }
            "prefix" => {
                need_args()?;
                Ok(MaskSpec::Prefix { prefix: num(spec, args)? })
            }
            "prefix-docs" => {
                need_args()?;
                let docs = args
                    .split(',')
                    .map(|d| {
                        let (l, p) = d.split_once('/').ok_or_else(|| bad(spec, "expected LEN/PREFIX pairs"))?;
                        Ok((num(spec, l)?, num(spec, p)?))
                    })
                    .collect::<Result<_>>()?;
                Ok(MaskSpec::PrefixDocuments { docs })
            }
            "shared-question" => {
                need_args()?;
                let v = list(spec, args)?;
                Ok(MaskSpec::SharedQuestion { question: v[0], answers: v[1..].to_vec() })
            }
            "block-causal" => {
                need_args()?;
                Ok(MaskSpec::BlockCausal { block: num(spec, args)? })
            }
            "block-causal-docs" => {
                need_args()?;
                let (b, lens) =
                    args.split_once(':').ok_or_else(|| bad(spec, "expected block-causal-docs:B:LEN,LEN,…"))?;
                Ok(MaskSpec::BlockCausalDocuments { block: num(spec, b)?, lens: list(spec, lens)? })
            }
            "blocks" => {
                need_args()?;
                let (sizes, bits) = args.split_once(':').ok_or_else(|| bad(spec, "expected blocks:BQ,BK:0101…"))?;
                let v = list(spec, sizes)?;
                let [bq, bk] = v[..] else { return Err(bad(spec, "expected two block sizes")) };
                let keep = bits
                    .chars()
                    .map(|c| match c {
                        '0' => Ok(false),
                        '1' => Ok(true),
                        _ => Err(bad(spec, format!("block bits must be 0 or 1, got '{c}'"))),
                    })
                    .collect::<Result<_>>()?;
                Ok(MaskSpec::Blocks { block_q: bq, block_k: bk, keep })
            }
            _ => Err(bad(
                spec,
                "expected one of full, causal, window, window-global, docs, docs-causal, docs-random, \
                 docs-random-causal, prefix, \
                 prefix-docs, shared-question, block-causal, block-causal-docs, blocks",
            )),
        }
    }
}

impl fmt::Display for MaskSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MaskSpec::Full => write!(f, "full"),
            MaskSpec::Causal => write!(f, "causal"),
            MaskSpec::Window { left, right } => write!(f, "window:{},{}", opt(left), opt(right)),
            MaskSpec::WindowGlobal { left, right, global } => {
                write!(f, "window-global:{},{},{global}", opt(left), opt(right))
            }
            MaskSpec::Documents { lens, kind: DocKind::Full } => write!(f, "docs:{}", join(lens)),
            MaskSpec::Documents { lens, kind: DocKind::Causal } => write!(f, "docs-causal:{}", join(lens)),
            MaskSpec::RandomDocuments { seed, kind: DocKind::Full } => write!(f, "docs-random:{seed}"),
            MaskSpec::RandomDocuments { seed, kind: DocKind::Causal } => write!(f, "docs-random-causal:{seed}"),
            MaskSpec::Prefix { prefix } => write!(f, "prefix:{prefix}"),
            MaskSpec::PrefixDocuments { docs } => {
                let v: Vec<String> = docs.iter().map(|(l, p)| format!("{l}/{p}")).collect();
                write!(f, "prefix-docs:{}", v.join(","))
            }
            MaskSpec::SharedQuestion { question, answers } => {
                write!(f, "shared-question:{question},{}", join(answers))
            }
            MaskSpec::BlockCausal { block } => write!(f, "block-causal:{block}"),
            MaskSpec::BlockCausalDocuments { block, lens } => write!(f, "block-causal-docs:{block}:{}", join(lens)),
            MaskSpec::Blocks { block_q, block_k, keep } => {
                let bits: String = keep.iter().map(|&b| if b { '1' } else { '0' }).collect();
                write!(f, "blocks:{block_q},{block_k}:{bits}")
            }
        }
    }
}
