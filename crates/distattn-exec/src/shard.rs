//! Between whole tensors and the shards of a plan's buffers, on the host: the part of a full
//! tensor a buffer holds ([`shard`]), and the full outputs from every rank's output shards
//! ([`gather_forward`], [`gather_grads`]).

use crate::pieces::pieces;
use distattn_core::plan::{BufDesc, Tensor, TokenSet};
use distattn_core::{AttnShape, Forward, Grads};

/// The descriptor of the whole of `desc`'s tensor.
fn whole(desc: &BufDesc, shape: &AttnShape) -> BufDesc {
    let (n, h) = if desc.tensor.is_kv() { (shape.k_len, shape.kv_heads) } else { (shape.q_len, shape.heads) };
    BufDesc::new(desc.tensor, TokenSet::range(0..n), 0..h)
}

/// The elements of a full tensor (`[b, n, H, d]`, or `[b, H, n]` for LSE and D) that belong
/// to a buffer of descriptor `desc`, in the buffer's order.
pub fn shard<T: Copy>(full: &[T], desc: &BufDesc, shape: &AttnShape) -> Vec<T> {
    let mut runs: Vec<_> = pieces(&whole(desc, shape), desc, shape).into_iter().flat_map(|p| p.row_runs()).collect();
    runs.sort_by_key(|x| x.1);
    let mut out = Vec::with_capacity(desc.elems(shape));
    for (s, _, n) in runs {
        out.extend_from_slice(&full[s..s + n]);
    }
    out
}

/// Writes a shard back into the full tensor.
pub fn unshard_into<T: Copy>(part: &[T], desc: &BufDesc, shape: &AttnShape, full: &mut [T]) {
    for (s, d, n) in pieces(desc, &whole(desc, shape), shape).into_iter().flat_map(|p| p.row_runs()) {
        full[d..d + n].copy_from_slice(&part[s..s + n]);
    }
}

/// One rank's output shard: which tensor, which part of it, and its values.
#[derive(Debug, Clone, PartialEq)]
pub struct Shard {
    pub tensor: Tensor,
    pub desc: BufDesc,
    pub data: Vec<f32>,
}

/// The full (O, LSE) from every rank's output shards.
pub fn gather_forward(shape: &AttnShape, shards: impl IntoIterator<Item = Shard>) -> Forward {
    let mut f = Forward { o: vec![0f32; shape.q_elems()], lse: vec![f32::NEG_INFINITY; shape.lse_elems()] };
    for s in shards {
        match s.tensor {
            Tensor::O => unshard_into(&s.data, &s.desc, shape, &mut f.o),
            Tensor::Lse => unshard_into(&s.data, &s.desc, shape, &mut f.lse),
            _ => {}
        }
    }
    f
}

/// The full (dQ, dK, dV) from every rank's output shards.
pub fn gather_grads(shape: &AttnShape, shards: impl IntoIterator<Item = Shard>) -> Grads {
    let mut g =
        Grads { dq: vec![0f32; shape.q_elems()], dk: vec![0f32; shape.kv_elems()], dv: vec![0f32; shape.kv_elems()] };
    for s in shards {
        match s.tensor {
            Tensor::DQ => unshard_into(&s.data, &s.desc, shape, &mut g.dq),
            Tensor::DK => unshard_into(&s.data, &s.desc, shape, &mut g.dk),
            Tensor::DV => unshard_into(&s.data, &s.desc, shape, &mut g.dv),
            _ => {}
        }
    }
    g
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_of_a_layout_reassemble_the_tensor() {
        let shape = AttnShape::new(2, 13, 13, 4, 2, 3).unwrap();
        let layout = distattn_core::plan::Layout::zigzag(13, 13, 3);
        for tensor in [Tensor::Q, Tensor::K, Tensor::Lse] {
            let n = if tensor.is_kv() {
                shape.kv_elems()
            } else if tensor.is_stats() {
                shape.lse_elems()
            } else {
                shape.q_elems()
            };
            let full: Vec<usize> = (0..n).collect();
            let mut back = vec![usize::MAX; n];
            let heads = if tensor.is_kv() { 0..2 } else { 0..4 };
            for r in 0..3 {
                let tokens = if tensor.is_kv() { layout.k[r].clone() } else { layout.q[r].clone() };
                let desc = BufDesc::new(tensor, tokens, heads.clone());
                let part = shard(&full, &desc, &shape);
                assert_eq!(part.len(), desc.elems(&shape));
                unshard_into(&part, &desc, &shape, &mut back);
            }
            assert_eq!(back, full, "{tensor:?}");
        }
    }
}
