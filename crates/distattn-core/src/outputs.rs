//! What attention returns: the output and its log-sum-exp, and the gradients.
//!
//! Layouts (see [`crate::AttnShape`]): O, dQ like Q `[batch, q_len, heads, head_dim]`; dK, dV
//! like K `[batch, k_len, kv_heads, head_dim]`; LSE `[batch, heads, q_len]` in f32, natural
//! log, −inf for rows that see no key (their O is 0). Outputs are f32 unless a caller asks for
//! another element type.

use crate::Element;

/// Output of the forward pass.
#[derive(Debug, Clone, PartialEq)]
pub struct Forward<T = f32> {
    /// `[batch, q_len, heads, head_dim]`.
    pub o: Vec<T>,
    /// `[batch, heads, q_len]`, natural log; −inf for rows that see no key.
    pub lse: Vec<f32>,
}

/// Gradients of the backward pass (dK and dV summed over the query heads of each KV head).
#[derive(Debug, Clone, PartialEq)]
pub struct Grads<T = f32> {
    pub dq: Vec<T>,
    pub dk: Vec<T>,
    pub dv: Vec<T>,
}

/// `x` as a vector of `U`: the same vector when `U` is `T`, else converted (rounded to nearest
/// even).
pub fn convert_vec<T: Element, U: Element>(x: Vec<T>) -> Vec<U> {
    if T::DTYPE == U::DTYPE {
        // Same dtype, so the same type (Element is sealed): a cast, not a copy.
        return bytemuck::allocation::cast_vec(x);
    }
    let mut f = vec![0f32; x.len()];
    T::convert_to_f32(&x, &mut f);
    let mut out = vec![U::default(); x.len()];
    U::convert_from_f32(&f, &mut out);
    out
}

impl<T: Element> Forward<T> {
    /// The output in element type `U` (rounded to nearest even); LSE stays f32.
    pub fn into_dtype<U: Element>(self) -> Forward<U> {
        Forward { o: convert_vec(self.o), lse: self.lse }
    }
}

impl<T: Element> Grads<T> {
    /// The gradients in element type `U` (rounded to nearest even).
    pub fn into_dtype<U: Element>(self) -> Grads<U> {
        Grads { dq: convert_vec(self.dq), dk: convert_vec(self.dk), dv: convert_vec(self.dv) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn outputs_change_dtype() {
        let f = Forward { o: vec![1.0f32, 1.0 + 1.0 / 512.0], lse: vec![0.5] };
        let b: Forward<bf16> = f.clone().into_dtype();
        assert_eq!(b.o, vec![bf16::ONE, bf16::ONE]);
        assert_eq!(b.lse, f.lse);
        assert_eq!(f.clone().into_dtype::<f32>(), f);
        let g = Grads { dq: vec![2.0f32], dk: vec![-1.0], dv: vec![0.25] }.into_dtype::<half::f16>();
        assert_eq!(g.into_dtype::<f32>(), Grads { dq: vec![2.0], dk: vec![-1.0], dv: vec![0.25] });
    }
}
