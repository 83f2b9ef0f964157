//! # kvstream kernels
//!
//! The CUDA C sources of kvstream's device kernels and their launch metadata. The sources are
//! embedded here and compiled at run time with NVRTC for the device's own architecture by
//! `kvstream-backend-cuda` (which caches the compiled modules on disk). This crate has no CUDA
//! dependency: it is plain data, so CI without a GPU can still list and check every kernel
//! (`scripts/check_kernels.py` compiles every module with the NVRTC wheel).
//!
//! Every module is compiled as [`COMMON`] followed by the module's own source, with
//! [`NVRTC_OPTIONS`] plus `--gpu-architecture=sm_XY`.

/// Helpers prepended to every module (dtype conversions, reductions, KV dequantisation).
pub const COMMON: &str = include_str!("cu/common.cuh");

/// NVRTC options shared by every module (the architecture is added by the compiler).
pub const NVRTC_OPTIONS: &[&str] = &["--std=c++17", "-default-device"];

/// One kernel module: a `.cu` source and the `extern "C"` kernels it defines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelModule {
    /// Module name (the file stem of `kernels/src/cu/<module>.cu`).
    pub module: &'static str,
    /// The module's own source (without [`COMMON`]).
    pub source: &'static str,
    /// Names of the kernels the module defines.
    pub kernels: &'static [&'static str],
}

impl KernelModule {
    /// The full source NVRTC compiles: [`COMMON`] then the module.
    pub fn full_source(&self) -> String {
        compose_source(COMMON, self.source)
    }
}

/// What NVRTC compiles for a module: `common` (the [`COMMON`] helpers, or a replacement) then
/// the module's own source, on the next line.
pub fn compose_source(common: &str, own: &str) -> String {
    let mut s = String::with_capacity(common.len() + own.len() + 1);
    s.push_str(common);
    s.push('\n');
    s.push_str(own);
    s
}

/// Every kernel module. `scripts/check_kernels.py` parses this table: keep one
/// `module: "..."` / `kernels: &[...]` pair per entry.
pub const MODULES: &[KernelModule] = &[
    KernelModule {
        module: "elementwise",
        source: include_str!("cu/elementwise.cu"),
        kernels: &[
            "add_f32",
            "swiglu_f32",
            "sigmoid_gate_f32",
            "swiglu_prep_f32",
            "sigmoid_gate_prep_f32",
            "copy_cols_f32",
            "split_cols_f32",
            "embedding_gather",
            "argmax_rows_f32",
            "l2_prefetch",
        ],
    },
    KernelModule {
        module: "norm",
        source: include_str!("cu/norm.cu"),
        kernels: &["rms_norm_f32", "add_rms_norm_f32", "gated_rms_norm_f32"],
    },
    KernelModule {
        module: "rope",
        source: include_str!("cu/rope.cu"),
        kernels: &["rope_f32"],
    },
    KernelModule {
        module: "linear",
        source: include_str!("cu/linear.cu"),
        kernels: &[
            "gemv_f32_t1",
            "gemv_f32_t4",
            "gemv_f32_t8",
            "gemv_f16_t1",
            "gemv_f16_t4",
            "gemv_f16_t8",
            "gemv_bf16_t1",
            "gemv_bf16_t4",
            "gemv_bf16_t8",
            "gemv_q8_0_t1",
            "gemv_q8_0_t4",
            "gemv_q8_0_t8",
            "gemv_q4g128_t1",
            "gemv_q4g128_t4",
            "gemv_q4g128_t8",
            "gemv_q4g128x_t1",
            "gemv_q4g128x_t4",
            "gemv_q4g128x_t8",
            "gemv_f8e4m3_t1",
            "gemv_f8e4m3_t4",
            "gemv_f8e4m3_t8",
            "gemv_q4nl_t1",
            "gemv_q4nl_t4",
            "gemv_q4nl_t8",
            "gemv_sk_f32_t1",
            "gemv_sk_f32_t4",
            "gemv_sk_f32_t8",
            "gemv_sk_f16_t1",
            "gemv_sk_f16_t4",
            "gemv_sk_f16_t8",
            "gemv_sk_bf16_t1",
            "gemv_sk_bf16_t4",
            "gemv_sk_bf16_t8",
            "gemv_sk_q8_0_t1",
            "gemv_sk_q8_0_t4",
            "gemv_sk_q8_0_t8",
            "gemv_sk_f8e4m3_t1",
            "gemv_sk_f8e4m3_t4",
            "gemv_sk_f8e4m3_t8",
            "gemv_scalar",
            "gemm_f32out",
            "f32_to_bf16x2_rows",
            "dequant_rows_bf16x2",
            "embedding_rows_q",
        ],
    },
    KernelModule {
        module: "gemv_mma",
        source: include_str!("cu/gemv_mma.cu"),
        kernels: &[
            "gemv_q4mma_xprep",
            "gemv_q4mmap",
            "gemv_q4mmap_xs",
            "gemv_q4mmap3",
            "gemv_q4mmap3_xs",
            "gemv_q4nlmmap",
            "gemv_q4nlmmap_xs",
            "gemv_q4nlmmap3",
            "gemv_q4nlmmap3_xs",
            "gemv_q4i8_xprep",
            "gemv_q4i8p",
            "gemv_q4i8p_xs",
            "gemv_q4i8p1",
            "gemv_q4i8p1_xs",
            "gemv_q4nl_i8_xprep",
            "gemv_q4nli8p",
            "gemv_q4nli8p_xs",
            "gemv_q4nli8p1",
            "gemv_q4nli8p1_xs",
            "gemv_q4i8c_xprep",
            "gemv_q4nl_i8c_xprep",
            "gemv_q4i8c1",
            "gemv_q4i8c1_xs",
            "gemv_q4i8c2",
            "gemv_q4i8c2_xs",
            "gemv_q4i8c4",
            "gemv_q4i8c4_xs",
            "gemv_q4nli8c1",
            "gemv_q4nli8c1_xs",
            "gemv_q4nli8c2",
            "gemv_q4nli8c2_xs",
            "gemv_q4nli8c4",
            "gemv_q4nli8c4_xs",
            "gemv_q4i8t1",
            "gemv_q4i8t1_xs",
            "gemv_q4i8t2",
            "gemv_q4i8t2_xs",
            "gemv_q4i8t4",
            "gemv_q4i8t4_xs",
            "gemv_q4nli8t1",
            "gemv_q4nli8t1_xs",
            "gemv_q4nli8t2",
            "gemv_q4nli8t2_xs",
            "gemv_q4nli8t4",
            "gemv_q4nli8t4_xs",
        ],
    },
    KernelModule {
        module: "recurrent",
        source: include_str!("cu/recurrent.cu"),
        kernels: &[
            "causal_conv1d_f32",
            "gdn_qk_norm",
            "gdn_gates",
            "gdn_recurrent",
            "gdn_recurrent_fused",
            "gdn_chunk_prep",
            "gdn_chunk_scan",
        ],
    },
    KernelModule {
        module: "kv",
        source: include_str!("cu/kv.cu"),
        kernels: &["kv_write"],
    },
    KernelModule {
        module: "attention",
        source: include_str!("cu/attention.cu"),
        kernels: &[
            "attn_accumulate",
            "attn_q8q4_n1_d64",
            "attn_q8q4_n2_d64",
            "attn_q8q4_n3_d64",
            "attn_q8q4_n4_d64",
            "attn_q8q4_n1_d128",
            "attn_q8q4_n2_d128",
            "attn_q8q4_n3_d128",
            "attn_q8q4_n4_d128",
            "attn_q8q4_n1_d256",
            "attn_q8q4_n2_d256",
            "attn_q8q4_n3_d256",
            "attn_q8q4_n4_d256",
            "attn_finish",
        ],
    },
    KernelModule {
        module: "vision",
        source: include_str!("cu/vision.cu"),
        kernels: &[
            "add_bias_f32",
            "layer_norm_f32",
            "gelu_f32",
            "vision_rotary_f32",
            "vision_attn_f32",
        ],
    },
    KernelModule {
        module: "bench",
        source: include_str!("cu/bench.cu"),
        kernels: &["read_sum_f32"],
    },
];

/// Launch constants shared between the sources and the launcher.
pub mod launch {
    /// Rows (tokens) the GEMV kernel handles in one launch; wider inputs use the GEMM kernel.
    pub const GEMV_MAX_T: usize = 8;
    /// Output tile of the GEMM kernel (square).
    pub const GEMM_TILE: usize = 64;
    /// Largest conv1d kernel length.
    pub const CONV_MAX_K: usize = 8;
    /// Largest `k_dim` of the gated delta rule kernel (8 slices × 32 registers).
    pub const GDN_MAX_K_DIM: usize = 256;
    /// Largest chunk of the chunked gated delta rule kernels (`GDN_C` in recurrent.cu).
    pub const GDN_CHUNK: usize = 64;
    /// Largest `k_dim` of the chunked kernels (`GDN_CK_MAX`: the state slice `[k_dim, 32]` lives in
    /// shared memory); larger heads use the token recurrence.
    pub const GDN_CHUNK_MAX_K_DIM: usize = 128;
    /// Granule of attention split ownership: the evaluation's tokens form 64-token chunks dealt
    /// round robin over the splits (chunk `c` belongs to split `c % n_splits`); a multiple of the
    /// fast kernel's chunk and of every generic unit (`ATT_CHUNK` in attention.cu).
    pub const ATT_TILE: usize = 64;
    /// Queries per attention block (decode widths 1..=4 read each K/V tile once).
    pub const ATT_QW: usize = 4;
    /// Threads per block of the generic attention kernel (`attn_accumulate`).
    pub const ATT_THREADS: usize = 256;
    /// Most splits of one evaluation (`attn_finish` holds one weight per split in shared memory).
    pub const ATT_MAX_SPLITS: usize = 256;
    /// Dims per block of `attn_finish` (`ATT_FINISH_DIMS`; grid y = ceil(head_dim / 32)).
    pub const ATT_FINISH_DIMS: usize = 32;
    /// Threads per block of `attn_finish`: 8 split groups × 32 dims (`ATT_FINISH_GROUPS`).
    pub const ATT_FINISH_THREADS: usize = 256;
    /// Tokens per chunk of the fast Q8_0/Q4_0 decode kernel (`attn_q8q4_n*_d*`, `FA_CHUNK`);
    /// pages must hold at least this many tokens for the fast kernel.
    pub const ATT_FAST_CHUNK: usize = 64;
    /// Threads per block of the fast kernel (4 warps, `FA_THREADS`).
    pub const ATT_FAST_THREADS: usize = 128;
    /// Most query rows (group × width) of one fast-kernel block (`FA_ROWS`).
    pub const ATT_FAST_ROWS: usize = 32;
    /// f32 stride of one score row in the fast kernel's shared memory (`FA_SROW`).
    pub const ATT_FAST_SROW: usize = 68;
    /// Query rows (one warp each) per block of the ViT attention kernel (`VA_WARPS`).
    pub const VISION_ATT_WARPS: usize = 4;
    /// Largest head dim of the ViT attention kernel (4 values per lane, `VA_MAX_HD`).
    pub const VISION_ATT_MAX_HEAD_DIM: usize = 128;
}

/// Finds the module that defines `kernel`.
pub fn module_of(kernel: &str) -> Option<&'static KernelModule> {
    MODULES.iter().find(|m| m.kernels.contains(&kernel))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn every_listed_kernel_is_defined_in_its_source() {
        let mut seen = HashSet::new();
        for m in MODULES {
            for k in m.kernels {
                assert!(seen.insert(*k), "kernel {k} listed twice");
                let needle = format!("__global__ void {k}(");
                assert!(
                    m.source.contains(&needle),
                    "module {} does not define {k}",
                    m.module
                );
            }
        }
        assert_eq!(
            module_of("attn_finish").map(|m| m.module),
            Some("attention")
        );
        assert!(module_of("no_such_kernel").is_none());
    }

    #[test]
    fn every_defined_kernel_is_listed() {
        for m in MODULES {
            for line in m.source.lines() {
                if let Some(rest) = line.split("__global__ void ").nth(1) {
                    let name = rest.split('(').next().unwrap_or_default();
                    assert!(
                        m.kernels.contains(&name),
                        "{}: kernel {name} missing from the table",
                        m.module
                    );
                }
            }
        }
    }
}
