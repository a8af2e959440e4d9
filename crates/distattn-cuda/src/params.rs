//! The parameter structs the host passes to the kernels, each defined once: `kernel_params!`
//! gives the `#[repr(C)]` struct and its layout (every field's offset, the size), and every
//! module compiled ends with C++ `static_assert`s of those layouts against the declarations in
//! `kernels/params.cuh` ([`layout_asserts`]), so a struct that differs on the two sides fails
//! every NVRTC compile instead of passing garbage to a kernel.

use cudarc::driver::DeviceRepr;
use std::fmt::Write;
use std::mem::{offset_of, size_of};

/// A parameter struct's layout on the host: its name (the C++ struct's), size and each field's
/// (name, offset), in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StructLayout {
    pub name: &'static str,
    pub size: usize,
    pub fields: &'static [(&'static str, usize)],
}

/// Defines each parameter struct (`#[repr(C)]`, a kernel argument by value) and `PARAM_LAYOUTS`,
/// their layouts in order.
macro_rules! kernel_params {
    ($($(#[$meta:meta])* struct $name:ident { $($field:ident: $ty:ty),* $(,)? })*) => {
        $(
            $(#[$meta])*
            #[repr(C)]
            #[derive(Debug, Clone, Copy)]
            pub(crate) struct $name {
                $(pub(crate) $field: $ty),*
            }
            // No padding, not even at the end (the `pad_` fields fill the gaps): every byte the
            // launch copies is a field's.
            const _: () = assert!(
                size_of::<$name>() == 0 $(+ size_of::<$ty>())*,
                concat!(stringify!($name), " has padding: add a pad_ field")
            );
            // SAFETY: `repr(C)` and plain numbers (u64 addresses, integers, f32) with no padding
            // (asserted above), laid out as the kernels declare the struct: the generated
            // assertions check its size and every field's offset at every compile.
            unsafe impl DeviceRepr for $name {}
        )*

        const PARAM_LAYOUTS: &[StructLayout] = &[$(StructLayout {
            name: stringify!($name),
            size: size_of::<$name>(),
            fields: &[$((stringify!($field), offset_of!($name, $field))),*],
        }),*];
    };
}

kernel_params! {
    /// The forward's (`flash_fwd`, `flash_fwd_ws`): device addresses, then sizes.
    struct FwdParams {
        q: u64,
        k: u64,
        v: u64,
        o: u64,
        o_f32: u64,
        lse: u64,
        tile_ptr: u64,
        tiles: u64,
        bits: u64,
        batch: i32,
        q_len: i32,
        k_len: i32,
        heads: i32,
        kv_heads: i32,
        n_tiles: i32,
        scale_log2: f32,
        // (batch, KV head) pairs per group of the launch order (launch_group)
        group: i32,
        // o_f32 and lse hold a partial result to merge into (sm_90a warp-specialized kernel)
        merge: i32,
        // launch-order distance to the block whose Q tile a block prefetches into the L2 (0: none)
        prefetch: i32,
    }

    /// The FP8 forward's (`flash_fwd_e4m3_*`): the forward's, and per-(batch, KV head) f32
    /// descales of Q, K and V (0: none).
    struct E4m3FwdParams {
        f: FwdParams,
        q_descale: u64,
        k_descale: u64,
        v_descale: u64,
    }

    /// V's transpose for the FP8 forward (`transpose_v_e4m3`).
    struct TransposeVParams {
        v: u64,
        vt: u64,
        k_len: i32,
        kv_heads: i32,
        k_pad: i32,
        pad_: i32,
    }

    /// The dK/dV kernels' (`flash_bwd_dkdv`, `flash_bwd_dkdv2`, `flash_bwd_ws`).
    struct BwdParams {
        q: u64,
        k: u64,
        v: u64,
        dout: u64,
        lse: u64,
        delta: u64,
        dq_acc: u64,
        // dQ of the input dtype, written by the by-query dQ job of a whole backward; 0: added
        // into dq_acc
        dq: u64,
        dk: u64,
        dv: u64,
        tile_ptr: u64,
        tiles: u64,
        bits: u64,
        batch: i32,
        q_len: i32,
        k_len: i32,
        heads: i32,
        kv_heads: i32,
        n_tiles: i32,
        scale_log2: f32,
        scale: f32,
        // (batch, KV head) pairs per group of the launch order (launch_group)
        group: i32,
        // 1: dk and dv are f32 accumulators the kernel adds into; 0: the input dtype, written
        dkdv_acc: i32,
    }

    /// The row delta's (`delta_o_elem`, `delta_o_f32`).
    struct DeltaParams {
        o: u64,
        dout: u64,
        delta: u64,
        rows: i64,
        head_dim: i32,
        q_len: i32,
        heads: i32,
        // lanes a row: head_dim / 8 rounded up to a power of two (delta_lanes)
        lanes: i32,
    }

    /// The spec merge's (`merge_pieces`).
    struct MergeParams {
        o: u64,
        lse: u64,
        oacc: u64,
        lacc: u64,
        tp: u64,
        total: i64,
        ns: i64,
        nd: i64,
        n_pieces: i32,
        batch: i32,
        nh: i32,
        hs: i32,
        hd: i32,
        hs0: i32,
        hd0: i32,
        d: i32,
    }

    /// The decode kernel's (`flash_decode`).
    struct DecodeParams {
        q: u64,
        k: u64,
        v: u64,
        o: u64,
        lse: u64,
        page_table: u64,
        seqlens: u64,
        cu_tiles: u64,
        part_o: u64,
        part_lse: u64,
        counters: u64,
        batch: i32,
        q_rows: i32,
        heads: i32,
        kv_heads: i32,
        page_size: i32,
        max_pages: i32,
        segs_per_request: i32,
        seqlen_add: i32,
        causal: i32,
        page_shift: i32,
        scale_log2: f32,
        row_table: i32,
        o_f32: i32,
        pad_: i32,
    }

    /// The KV append's (`append_kv`).
    struct AppendParams {
        k_new: u64,
        v_new: u64,
        k_cache: u64,
        v_cache: u64,
        page_table: u64,
        seqlens: u64,
        chunks: i64,
        new_tokens: i32,
        row_chunks: i32,
        page_size: i32,
        max_pages: i32,
    }
}

/// Every struct the kernels take by value, as laid out on the host: the parameter structs and
/// the TMA descriptor.
pub fn layouts() -> Vec<StructLayout> {
    PARAM_LAYOUTS.iter().copied().chain([crate::tma::TMA_MAP_LAYOUT]).collect()
}

/// C++ `static_assert`s that the structs of `layouts`, as the kernels declare them, have those
/// sizes and field offsets. NVRTC accepts neither `offsetof` nor `__builtin_offsetof` in a
/// constant expression; its front end's `__INTADDR__` folds a member's address in a null object
/// to the member's offset.
pub fn layout_asserts(layouts: &[StructLayout]) -> String {
    let mut out = String::from("\n// Host layouts of the kernels' parameter structs (src/params.rs).\n");
    for l in layouts {
        let n = l.name;
        // (Writing to a String cannot fail.)
        let _ = writeln!(out, "static_assert(sizeof({n}) == {}, \"{n}: {} bytes on the host\");", l.size, l.size);
        for (f, off) in l.fields {
            let _ = writeln!(
                out,
                "static_assert(__INTADDR__(&(({n}*)0)->{f}) == {off}, \"{n}.{f}: at byte {off} on the host\");"
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compile::{self, KernelConfig, ModuleKind};
    use distattn_core::DType;
    use std::collections::BTreeMap;

    /// C++ source with comments removed.
    fn strip_comments(src: &str) -> String {
        src.lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n")
    }

    /// The structs of a header and their fields' names, in order (`struct [__align__(n)] Name {
    /// type a, b; type* c; type d[n]; };`).
    fn cpp_structs(header: &str) -> BTreeMap<String, Vec<String>> {
        let src = strip_comments(header);
        let mut out = BTreeMap::new();
        let mut rest = src.as_str();
        while let Some(i) = rest.find("struct ") {
            rest = &rest[i + "struct ".len()..];
            let (Some(open), Some(close)) = (rest.find('{'), rest.find('}')) else { break };
            let name = rest[..open].split_whitespace().last().unwrap_or("").to_string();
            let mut fields = Vec::new();
            for decl in rest[open + 1..close].split(';').map(str::trim).filter(|d| !d.is_empty()) {
                for (k, declarator) in decl.split(',').enumerate() {
                    let declarator = declarator.split('[').next().unwrap_or("");
                    let ident = if k == 0 { declarator.split_whitespace().last() } else { Some(declarator.trim()) };
                    fields.push(ident.unwrap_or("").trim_start_matches('*').to_string());
                }
            }
            out.insert(name, fields);
            rest = &rest[close..];
        }
        out
    }

    /// The types that kernels (`extern "C" __global__`) of `src` take by value, among `structs`.
    fn by_value_params(src: &str, structs: &BTreeMap<String, Vec<String>>) -> Vec<String> {
        let src = strip_comments(src);
        let mut out = Vec::new();
        for kernel in src.split("extern \"C\" __global__").skip(1) {
            let head = kernel.split('{').next().unwrap_or("");
            let params = head.rsplit_once(')').and_then(|(l, _)| l.rsplit_once('(')).map(|(_, p)| p).unwrap_or("");
            for p in params.split(',').filter(|p| !p.contains('*')) {
                out.extend(p.split_whitespace().filter(|w| structs.contains_key(*w)).map(String::from));
            }
        }
        out
    }

    #[test]
    fn layout_asserts_cover_every_field() {
        let header = compile::KERNEL_HEADERS.iter().find(|(n, _)| *n == "params.cuh").unwrap().1;
        let structs = cpp_structs(header);
        assert_eq!(structs["BwdParams"].len(), 23, "{:?}", structs["BwdParams"]);
        assert_eq!(structs["TmaMap"], ["v"]);
        let roots = [ModuleKind::Flash(KernelConfig::new(DType::BF16, 128).unwrap()), ModuleKind::Aux(DType::BF16)]
            .map(|k| k.root().1);
        let sources = roots.iter().copied().chain(compile::KERNEL_HEADERS.iter().map(|(_, text)| *text));
        let mut taken: Vec<String> = sources.flat_map(|src| by_value_params(src, &structs)).collect();
        taken.sort();
        taken.dedup();
        let layouts = layouts();
        let mut described: Vec<String> = layouts.iter().map(|l| l.name.to_string()).collect();
        described.sort();
        assert_eq!(described, taken, "the host describes exactly the structs kernels take by value");
        let asserts = layout_asserts(&layouts);
        for name in &taken {
            assert!(asserts.contains(&format!("sizeof({name}) ==")), "{name}: no size assertion");
            for f in &structs[name] {
                assert!(asserts.contains(&format!("(({name}*)0)->{f})")), "{name}.{f}: no offset assertion");
            }
        }
        for l in &layouts {
            let host: Vec<&str> = l.fields.iter().map(|(f, _)| *f).collect();
            assert_eq!(host, structs[l.name], "{}: fields in the same order on both sides", l.name);
        }
    }

    #[test]
    #[ignore = "needs NVRTC: .ci/nvrtc.sh runs it"]
    fn a_wrong_layout_fails_the_compile_with_nvrtc() {
        assert!(compile::nvrtc_available(), "NVRTC does not load");
        let kind = ModuleKind::Aux(DType::BF16);
        let (name, root) = kind.root();
        let opts = kind.options("sm_80", &[], false);
        let compile_with = |layouts: &[StructLayout]| {
            compile::nvrtc_compile(&format!("{root}{}", layout_asserts(layouts)), name, compile::KERNEL_HEADERS, &opts)
        };
        compile_with(&layouts()).expect("the host layouts match the kernels'");
        // DeltaParams with `dout` and `delta` swapped on the host.
        let delta = PARAM_LAYOUTS.iter().find(|l| l.name == "DeltaParams").unwrap();
        let fields: Vec<(&'static str, usize)> = delta
            .fields
            .iter()
            .map(|&(f, off)| match f {
                "dout" => (f, offset_of!(DeltaParams, delta)),
                "delta" => (f, offset_of!(DeltaParams, dout)),
                _ => (f, off),
            })
            .collect();
        let swapped = StructLayout { fields: fields.leak(), ..*delta };
        let err = compile_with(&[swapped]).expect_err("a swapped field must fail").to_string();
        assert!(err.contains("DeltaParams.dout: at byte 16 on the host"), "{err}");
        // FwdParams one field short on the host (its size is checked too).
        let fwd = PARAM_LAYOUTS.iter().find(|l| l.name == "FwdParams").unwrap();
        let short = StructLayout { size: fwd.size - 8, fields: &fwd.fields[..fwd.fields.len() - 2], ..*fwd };
        let err = compile_with(&[short]).expect_err("a short struct must fail").to_string();
        assert!(err.contains("FwdParams: 104 bytes on the host"), "{err}");
    }
}
