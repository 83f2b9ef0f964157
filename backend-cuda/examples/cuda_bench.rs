//! Micro-benchmarks of the CUDA backend on the GPU machine:
//!
//! * HBM read roofline (vectorised read of 4 GiB) and GEMV GB/s (T = 1 and 4) for bf16 and each
//!   quantized weight format (q8_0, q4_g128, fp8_e4m3) on the 27B shapes (MLP gate/up, down,
//!   attention/GDN projections, lm_head), counted in stored bytes (codes + scales) and as a
//!   percentage of the measured HBM read ceiling (q4_g128 on both the tensor-core and the SIMT
//!   kernel; the other formats on the default choice and, where that is the stream-K kernel,
//!   also on gemv_pipe; each row names the kernel that ran; the column-packed integer q4 kernel
//!   also with x prepared by its producer, "(i8c, x prepared)": the GEMV without its x-prep
//!   launch, as decode runs it under the fused x prep); the timed calls cycle through copies of
//!   the weight that together exceed `KVSTREAM_BENCH_ROTATE_MIB` (default 512 MiB; `copies=` on
//!   each row), so no call finds its weight in L2 — a decode step reads each weight once;
//! * prefill GEMM TFLOP/s (bf16, q4_g128; T = 512 and 4096; MLP gate/up and down) on cuBLAS and
//!   on the SIMT kernel (`KVSTREAM_BENCH_SKIP_GEMM=1` skips);
//! * H2D copy-engine GB/s from registered (pinned) host memory at 256 KiB, 4 MiB and 16 MiB
//!   requests;
//! * streamed attention decode (widths 1 and 4) over 64 Ki tokens of Q8_0 K / Q4_0 V in the 27B
//!   geometry (4 KV heads × 256, 24 query heads, 256-token pages);
//! * the gated delta rule at T = 512 and 4096 in the 27B GDN geometry (16 k heads, 48 v heads,
//!   128 × 128): chunked (WY) kernels against the token recurrence, with their output difference.
//!
//! Usage: `cuda_bench [OUT_DIR]` (default `$OUT` or `.`); writes `cuda_bench.txt` there.
//! `KVSTREAM_BENCH_ONLY_GDN=1` runs only the gated delta rule section.

use kvstream_backend_cuda::{CudaBackend, GemvSk, PrefillGemm, Q4Gemv};
use kvstream_memory_contracts::attention::{
    attention_accumulate, attention_begin, attention_finish, AttentionShape,
};
use kvstream_memory_contracts::backend::WeightDType;
use kvstream_memory_contracts::host::{HostBytes, HostRange, PinnedHost};
use kvstream_memory_contracts::kv::format::{encode, KvType};
use kvstream_memory_contracts::kv::geometry::PageGeometry;
use kvstream_memory_contracts::kv::span::{Span, SpanPlan, SpanSource};
use kvstream_memory_contracts::ops::{
    ActivationOps, DeltaMode, DeltaShape, LinearOps, RecurrentOps, TensorOps, WeightData,
};
use kvstream_memory_contracts::transfer::{CopyEngine, DeviceMemory};
use kvstream_memory_contracts::{quant_layout, quantize};
use rand::{Rng, SeedableRng};
use std::error::Error;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Instant;

/// Appends one line to the report and prints it at once (a later failing section keeps it).
macro_rules! out {
    ($r:expr, $($arg:tt)*) => {{
        let line = format!($($arg)*);
        println!("{line}");
        writeln!($r, "{line}")
    }};
}

fn time<F: FnMut() -> Result<(), Box<dyn Error>>>(
    b: &CudaBackend,
    iters: usize,
    mut f: F,
) -> Result<f64, Box<dyn Error>> {
    f()?;
    b.synchronize()?;
    let t0 = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    b.synchronize()?;
    Ok(t0.elapsed().as_secs_f64() / iters as f64)
}

/// GPU time per call of `f` without the host's launch cost: `f` enqueued `per_graph` times into
/// one CUDA graph (after a warm-up call), the graph replayed `replays` times.
fn time_graph<F: FnMut() -> Result<(), Box<dyn Error>>>(
    b: &CudaBackend,
    per_graph: usize,
    replays: usize,
    mut f: F,
) -> Result<f64, Box<dyn Error>> {
    f()?;
    b.synchronize()?;
    let mut failed = None;
    let graph = b.capture(|| {
        for _ in 0..per_graph {
            if let Err(e) = f() {
                failed = Some(e.to_string());
                break;
            }
        }
        Ok(())
    })?;
    if let Some(e) = failed {
        return Err(e.into());
    }
    graph.launch()?;
    b.synchronize()?;
    let t0 = Instant::now();
    for _ in 0..replays {
        graph.launch()?;
    }
    b.synchronize()?;
    Ok(t0.elapsed().as_secs_f64() / (replays * per_graph) as f64)
}

/// How many copies of a `bytes`-byte weight the GEMV rows cycle through: together at least
/// `KVSTREAM_BENCH_ROTATE_MIB` MiB (default 512, ten times an H100's or H200's 50 MiB L2; `0`:
/// one copy, every call re-reading the same weight as the rows of sessions ≤ 16 did), so a timed
/// call never finds its weight in L2, as in a decode step that reads each weight once.
fn rotation_copies(bytes: usize) -> usize {
    let mib = std::env::var("KVSTREAM_BENCH_ROTATE_MIB")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .unwrap_or(512);
    (mib << 20).div_ceil(bytes.max(1)).clamp(1, 64)
}

/// `NxK,NxK,...` as (rows, columns) pairs.
fn parse_shapes(list: &str) -> Result<Vec<(usize, usize)>, Box<dyn Error>> {
    list.split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| {
            let (n, k) = s
                .trim()
                .split_once('x')
                .ok_or_else(|| format!("shape {s:?} is not NxK"))?;
            Ok((n.parse()?, k.parse()?))
        })
        .collect()
}

/// What one small op costs: `n` element-wise adds of one 5120-wide row (output allocation from
/// the cache + launch), as host issue time, wall time per op, and GPU time per op inside a
/// graph (no host cost). Issue ≈ wall means the host bounds a stream of small ops.
fn launch_floor(b: &CudaBackend, report: &mut String) -> Result<(), Box<dyn Error>> {
    let n = 2000usize;
    let x = b.tensor_from_f32(&vec![0.5f32; 5120], &[1, 5120])?;
    let run = || -> Result<(), Box<dyn Error>> {
        let mut y = b.add(&x, &x)?;
        for _ in 1..n {
            y = b.add(&y, &x)?;
        }
        Ok(())
    };
    run()?;
    b.synchronize()?;
    let t0 = Instant::now();
    run()?;
    let issue = t0.elapsed().as_secs_f64();
    b.synchronize()?;
    let wall = t0.elapsed().as_secs_f64();
    let graph = time_graph(b, 1, 5, run)?;
    out!(
        report,
        "launch floor ({n} dependent adds of [1, 5120]): host issue {:.2} us/op, wall {:.2} us/op, \
         in a graph {:.2} us/op",
        issue / n as f64 * 1e6,
        wall / n as f64 * 1e6,
        graph / n as f64 * 1e6
    )?;
    Ok(())
}

/// A weight blob of `dt` `[n, k]` for bandwidth runs: a 1 MiB block of valid encoded values
/// (random, |w| < 0.05) tiled over the code section, and (quantized) constant 0.01 scales; no NaN
/// codes. Tiling keeps set-up fast on the 2.5 GB lm_head while the data still far exceeds L2.
fn synthetic_blob(
    dt: WeightDType,
    n: usize,
    k: usize,
    rng: &mut rand::rngs::StdRng,
) -> Result<Vec<u8>, Box<dyn Error>> {
    let l = quant_layout(dt, &[n, k])?;
    let codes = if dt.is_quantized() {
        l.scales_offset
    } else {
        l.total
    };
    const PAT: usize = 1 << 20;
    let pat: Vec<u8> = if dt.is_quantized() {
        (0..PAT)
            .map(|_| {
                let b: u8 = rng.random();
                if dt == WeightDType::F8E4M3 {
                    b & 0xf7 // clears the lowest exponent bit: never 0x7f / 0xff (NaN)
                } else {
                    b
                }
            })
            .collect()
    } else {
        let vals: Vec<f32> = (0..PAT / dt.size())
            .map(|_| rng.random_range(-0.05f32..0.05))
            .collect();
        quantize(dt, &vals, &[vals.len()])?
    };
    let mut blob: Vec<u8> = pat.iter().copied().cycle().take(codes).collect();
    blob.resize(l.total, 0);
    let scales = &mut blob[codes..];
    if dt == WeightDType::F8E4M3 {
        for c in scales.chunks_exact_mut(4) {
            c.copy_from_slice(&0.01f32.to_le_bytes());
        }
    } else {
        for c in scales.chunks_exact_mut(2) {
            c.copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
        }
    }
    Ok(blob)
}

/// The gated delta rule in the 27B GDN geometry: chunked kernels vs the token recurrence.
fn bench_gdn(
    b: &CudaBackend,
    report: &mut String,
    rng: &mut rand::rngs::StdRng,
) -> Result<(), Box<dyn Error>> {
    let mut r = |n: usize, lo: f32, hi: f32| -> Vec<f32> {
        (0..n).map(|_| rng.random_range(lo..hi)).collect()
    };
    for tokens in [512usize, 4096] {
        let s = DeltaShape {
            tokens,
            k_heads: 16,
            v_heads: 48,
            k_dim: 128,
            v_dim: 128,
        };
        let qk = tokens * s.k_heads * s.k_dim;
        let q = b.tensor_from_f32(&r(qk, -1.0, 1.0), &[tokens, s.k_heads, s.k_dim])?;
        let k = b.tensor_from_f32(&r(qk, -1.0, 1.0), &[tokens, s.k_heads, s.k_dim])?;
        let v = b.tensor_from_f32(
            &r(tokens * s.v_heads * s.v_dim, -1.0, 1.0),
            &[tokens, s.v_heads, s.v_dim],
        )?;
        let a = b.tensor_from_f32(&r(tokens * s.v_heads, -2.0, 2.0), &[tokens, s.v_heads])?;
        let bb = b.tensor_from_f32(&r(tokens * s.v_heads, -2.0, 2.0), &[tokens, s.v_heads])?;
        let f32w = |vals: Vec<f32>| {
            let bytes = quantize(WeightDType::F32, &vals, &[vals.len()])?;
            b.load_weight(
                "w",
                WeightDType::F32,
                &[vals.len()],
                WeightData::from_vec(bytes),
            )
        };
        let a_log = f32w(r(s.v_heads, -3.0, -1.0))?;
        let dt_bias = f32w(r(s.v_heads, -1.0, 1.0))?;
        let st0 = r(s.v_heads * s.k_dim * s.v_dim, -0.1, 0.1);
        let mut outs = Vec::new();
        let mut secs = Vec::new();
        for mode in [DeltaMode::Chunked { chunk: 64 }, DeltaMode::Recurrent] {
            let mut st = b.tensor_from_f32(&st0, &[s.v_heads, s.k_dim, s.v_dim])?;
            let o = b.gated_delta_rule(&s, &q, &k, &v, &a, &bb, &a_log, &dt_bias, &mut st, mode)?;
            outs.push(b.tensor_to_f32(&o)?);
            secs.push(time(b, 5, || {
                b.gated_delta_rule(&s, &q, &k, &v, &a, &bb, &a_log, &dt_bias, &mut st, mode)?;
                Ok(())
            })?);
        }
        let rms = (outs[1].iter().map(|x| x * x).sum::<f32>() / outs[1].len() as f32).sqrt();
        let diff = outs[0]
            .iter()
            .zip(&outs[1])
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        out!(
            report,
            "gated_delta_rule 27B geometry T={tokens}: chunked {:.3} ms, per-token {:.3} ms \
             ({:.1}x); max |diff| {diff:.2e} = {:.2e} of output rms",
            secs[0] * 1e3,
            secs[1] * 1e3,
            secs[1] / secs[0],
            diff / rms
        )?;
    }
    Ok(())
}

/// Prefill GEMM TFLOP/s (2·T·N·K per call) on the 27B MLP shapes, bf16 and q4_g128, T = 512 and
/// 4096, through cuBLAS (when it loads) and the SIMT kernel. `KVSTREAM_BENCH_SKIP_GEMM=1` skips.
fn prefill_gemm(
    b: &CudaBackend,
    report: &mut String,
    rng: &mut rand::rngs::StdRng,
) -> Result<(), Box<dyn Error>> {
    if std::env::var_os("KVSTREAM_BENCH_SKIP_GEMM").is_some() {
        return Ok(());
    }
    let cublas = b.set_prefill_gemm(PrefillGemm::Cublas).is_ok();
    if !cublas {
        out!(report, "gemm: cuBLAS unavailable, SIMT only")?;
    }
    for (n, k) in [(17408usize, 5120usize), (5120, 17408)] {
        for dt in [
            WeightDType::Bf16,
            WeightDType::Q4G128,
            WeightDType::Q4NlG128,
        ] {
            let blob = synthetic_blob(dt, n, k, rng)?;
            let wt = b.load_weight("w", dt, &[n, k], WeightData::from_vec(blob))?;
            for t in [512usize, 4096] {
                let x: Vec<f32> = (0..t * k).map(|_| rng.random_range(-1.0f32..1.0)).collect();
                let xt = b.tensor_from_f32(&x, &[t, k])?;
                for (path, iters) in [(PrefillGemm::Cublas, 10), (PrefillGemm::Simt, 2)] {
                    if path == PrefillGemm::Cublas && !cublas {
                        continue;
                    }
                    b.set_prefill_gemm(path)?;
                    let secs = time(b, iters, || {
                        b.matmul(&xt, &wt)?;
                        Ok(())
                    })?;
                    out!(
                        report,
                        "gemm {:<8} [{n}x{k}] T={t:<4} {:<6}: {:>8.2} ms, {:>6.1} TFLOP/s",
                        dt.name(),
                        format!("{path:?}").to_lowercase(),
                        secs * 1e3,
                        2.0 * (t * n * k) as f64 / secs / 1e12
                    )?;
                }
            }
        }
    }
    if cublas {
        b.set_prefill_gemm(PrefillGemm::Cublas)?;
    }
    Ok(())
}

/// The GEMV path a benchmark row measures.
#[derive(Debug, Clone, Copy)]
enum GemvPath {
    /// A q4_g128 kernel family.
    Q4(Q4Gemv),
    /// The element / 8-bit weights' choice of gemv_pipe or stream-K.
    Sk(GemvSk),
}

fn main() -> Result<(), Box<dyn Error>> {
    let out_dir = std::env::args()
        .nth(1)
        .or_else(|| std::env::var("OUT").ok())
        .unwrap_or_else(|| ".".into());
    let b = CudaBackend::new(0)?;
    let mut report = String::new();
    out!(
        report,
        "device: {}",
        kvstream_memory_contracts::Backend::capabilities(&b).device
    )?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    bench_gdn(&b, &mut report, &mut rng)?;
    if std::env::var_os("KVSTREAM_BENCH_ONLY_GDN").is_some() {
        let path = std::path::Path::new(&out_dir).join("cuda_bench.txt");
        std::fs::write(&path, &report)?;
        eprintln!("wrote {}", path.display());
        return Ok(());
    }

    // HBM read roofline.
    let hbm_bytes = 4usize << 30;
    let big = b.alloc_buffer(hbm_bytes)?;
    let secs = time(&b, 10, || Ok(b.bench_read(&big, hbm_bytes)?))?;
    let hbm = hbm_bytes as f64 / secs / 1e9;
    out!(report, "hbm_read 4GiB: {:.3} ms, {hbm:.0} GB/s", secs * 1e3)?;
    drop(big);

    // Per-op floor: a decode step is ~1,500 small launches, so what one costs bounds the step.
    launch_floor(&b, &mut report)?;

    // GEMV per weight format on the 27B shapes as the model runs them (fused projections,
    // docs/weights.md): MLP [gate; up] [34816, 5120], down [5120, 17408], GDN [qkv; z]
    // [16384, 5120], attention [q+gate; k; v] [14336, 5120], the output projections [5120, 6144]
    // and lm_head [248320, 5120]. `KVSTREAM_BENCH_GEMV_SHAPES=NxK,...` replaces the list (e.g.
    // the unfused 17408x5120 of earlier runs). Bytes = the stored blob (codes + scales).
    let formats = [
        WeightDType::Bf16,
        WeightDType::Q8_0,
        WeightDType::Q4G128,
        WeightDType::Q4NlG128,
        WeightDType::F8E4M3,
    ];
    // KVSTREAM_BENCH_SKIP_GEMV=1 skips this section (e.g. when only attention changed).
    let gemv_shapes: Vec<(usize, usize)> = if std::env::var_os("KVSTREAM_BENCH_SKIP_GEMV").is_some()
    {
        Vec::new()
    } else if let Ok(list) = std::env::var("KVSTREAM_BENCH_GEMV_SHAPES") {
        parse_shapes(&list)?
    } else {
        vec![
            (34_816, 5120),
            (5120, 17_408),
            (16_384, 5120),
            (14_336, 5120),
            (5120, 6144),
            (248_320, 5120),
        ]
    };
    let default_q4 = b.q4_gemv();
    let default_sk = b.gemv_sk();
    for &(n, k) in &gemv_shapes {
        for dt in formats {
            // KVSTREAM_BENCH_DTYPES=q4_g128,bf16 keeps only the named formats.
            if let Ok(keep) = std::env::var("KVSTREAM_BENCH_DTYPES") {
                if !keep.split(',').any(|d| d.trim() == dt.name()) {
                    continue;
                }
            }
            let blob = synthetic_blob(dt, n, k, &mut rng)?;
            let bytes = blob.len();
            // Copies of the weight the timed calls cycle through (see `rotation_copies`): a
            // decode step reads each weight once, so no call may find its weight in L2.
            let copies = rotation_copies(bytes);
            let mut wts = Vec::with_capacity(copies);
            for _ in 1..copies {
                wts.push(b.load_weight("w", dt, &[n, k], WeightData::from_vec(blob.clone()))?);
            }
            wts.push(b.load_weight("w", dt, &[n, k], WeightData::from_vec(blob))?);
            let wt = &wts[0];
            // q4_g128: the tensor-core kernels (integer, split bf16) and the SIMT one; q4_nl_g128
            // (the lookup-cost A/B against the q4_g128 rows): the same three. The other
            // formats: the default choice, and the stream-K kernel as well where its Auto rule
            // would take it (KVSTREAM_GEMV_SK A/B in one run).
            b.set_gemv_sk(GemvSk::Auto);
            let sk_auto = b.matmul_kernel(wt, 1).starts_with("gemv_sk_");
            b.set_gemv_sk(default_sk);
            let paths: Vec<GemvPath> = if dt.is_q4() {
                vec![
                    GemvPath::Q4(Q4Gemv::Int8Cols),
                    GemvPath::Q4(Q4Gemv::Int8),
                    GemvPath::Q4(Q4Gemv::MmaPersistent),
                    GemvPath::Q4(Q4Gemv::Simt),
                ]
            } else if sk_auto && default_sk != GemvSk::Auto {
                vec![GemvPath::Sk(GemvSk::Auto), GemvPath::Sk(default_sk)]
            } else if sk_auto {
                vec![GemvPath::Sk(default_sk), GemvPath::Sk(GemvSk::Off)]
            } else {
                vec![GemvPath::Sk(default_sk)]
            };
            for path in paths {
                match path {
                    GemvPath::Q4(p) => b.set_q4_gemv(p),
                    GemvPath::Sk(m) => b.set_gemv_sk(m),
                }
                let tag = match path {
                    GemvPath::Q4(Q4Gemv::MmaPersistent) => " (mmap)",
                    GemvPath::Q4(Q4Gemv::Simt) => " (simt)",
                    GemvPath::Q4(Q4Gemv::Int8) => " (i8)",
                    GemvPath::Q4(Q4Gemv::Int8Cols) => " (i8c)",
                    GemvPath::Q4(Q4Gemv::Auto) => " (auto)",
                    GemvPath::Sk(_) => "",
                };
                // The column-packed integer kernel also with x prepared by its producer (the
                // fused x prep: no x-prep launch, the GEMV alone), x made by a SwiGLU.
                let prepared_too = matches!(path, GemvPath::Q4(Q4Gemv::Int8Cols));
                let fused_default = b.fused_prep();
                for (t, prepared) in [(1usize, false), (4, false), (1, true), (4, true)] {
                    if prepared && !prepared_too {
                        continue;
                    }
                    let x: Vec<f32> = (0..t * k).map(|_| rng.random_range(-1.0f32..1.0)).collect();
                    let raw = b.tensor_from_f32(&x, &[t, k])?;
                    let ones = b.tensor_from_f32(&vec![1.0f32; t * k], &[t, k])?;
                    let made = if prepared {
                        b.set_fused_prep(true);
                        let p = b.swiglu(&raw, &ones);
                        b.set_fused_prep(fused_default);
                        let p = p?;
                        if !p.has_prepared_x() {
                            continue;
                        }
                        Some(p)
                    } else {
                        None
                    };
                    let xt = made.as_ref().unwrap_or(&raw);
                    let tag = if prepared { " (i8c, x prepared)" } else { tag };
                    let mut next = 0usize;
                    let mut call = || -> Result<(), Box<dyn Error>> {
                        b.matmul(xt, &wts[next % copies])?;
                        next += 1;
                        Ok(())
                    };
                    let secs = time(&b, 50.max(copies), &mut call)?;
                    let gsecs = time_graph(&b, 20.max(copies), 10, &mut call)?;
                    let gbs = bytes as f64 / secs / 1e9;
                    let ggbs = bytes as f64 / gsecs / 1e9;
                    out!(
                        report,
                        "gemv {:<8} [{n}x{k}] T={t}: {:>8.1} us, {gbs:>5.0} GB/s ({:>3.0}% of HBM read); \
                         graph {:>8.1} us, {ggbs:>5.0} GB/s ({:>3.0}%){tag} [{}] copies={copies}",
                        dt.name(),
                        secs * 1e6,
                        100.0 * gbs / hbm,
                        gsecs * 1e6,
                        100.0 * ggbs / hbm,
                        b.matmul_kernel(wt, t)
                    )?;
                    if prepared {
                        // The in-model pair: the SwiGLU that writes the prepared x, then the GEMV
                        // (its programmatic dependent), per call; the GEMV's bytes over the
                        // pair's time, so the producer counts against the GEMV.
                        let mut pair = || -> Result<(), Box<dyn Error>> {
                            b.set_fused_prep(true);
                            let p = b.swiglu(&raw, &ones);
                            b.set_fused_prep(fused_default);
                            b.matmul(&p?, &wts[next % copies])?;
                            next += 1;
                            Ok(())
                        };
                        let psecs = time_graph(&b, 20.max(copies), 10, &mut pair)?;
                        let pgbs = bytes as f64 / psecs / 1e9;
                        out!(
                            report,
                            "gemv {:<8} [{n}x{k}] T={t}: SwiGLU-prep + GEMV pair in a graph {:>8.1} us, \
                             {pgbs:>5.0} GB/s ({:>3.0}% of HBM read, GEMV bytes) [{}] copies={copies}",
                            dt.name(),
                            psecs * 1e6,
                            100.0 * pgbs / hbm,
                            b.matmul_kernel(wt, t)
                        )?;
                    }
                }
            }
            b.set_gemv_sk(default_sk);
            b.set_q4_gemv(default_q4);
        }
    }
    prefill_gemm(&b, &mut report, &mut rng)?;

    // H2D from registered host memory.
    let h2d_bytes = 256usize << 20;
    let host = Arc::new(HostBytes::new(h2d_bytes)?);
    let reg_t0 = Instant::now();
    let reg = b.register_host(&host)?;
    out!(
        report,
        "host register 256MiB: {:.1} ms",
        reg_t0.elapsed().as_secs_f64() * 1e3
    )?;
    let dst = b.alloc_buffer(h2d_bytes)?;
    for req in [256usize << 10, 4 << 20, 16 << 20] {
        let secs = time(&b, 5, || {
            let mut last = None;
            for off in (0..h2d_bytes).step_by(req) {
                let src = HostRange {
                    bytes: Arc::clone(&host),
                    offset: off,
                    len: req,
                };
                last = Some(b.copy_h2d(&src, &dst, off, &[])?);
            }
            if let Some(f) = last {
                b.host_wait(&f)?;
            }
            Ok(())
        })?;
        out!(
            report,
            "h2d {} KiB requests: {:.1} GB/s",
            req >> 10,
            h2d_bytes as f64 / secs / 1e9
        )?;
    }
    drop(reg);

    // Streamed attention decode over 64 Ki tokens, Q8_0 K / Q4_0 V, 27B geometry.
    let g = PageGeometry::new(256, 4, 256, KvType::Q8_0, KvType::Q4_0)?;
    let total = 65_536usize;
    let pages = g.pages_for(total);
    let mut page = vec![0u8; g.page_bytes()];
    for t in 0..256 {
        let k: Vec<f32> = (0..g.row_values())
            .map(|_| rng.random_range(-2.0f32..2.0))
            .collect();
        let v: Vec<f32> = (0..g.row_values())
            .map(|_| rng.random_range(-2.0f32..2.0))
            .collect();
        let ko = g.k_row_offset(0, 0, t);
        let vo = g.v_row_offset(0, 0, t);
        encode(g.k_type(), &k, &mut page[ko..ko + g.k_row_bytes()])?;
        encode(g.v_type(), &v, &mut page[vo..vo + g.v_row_bytes()])?;
    }
    let pool_bytes = pages * g.page_bytes();
    let pool = b.alloc_buffer(pool_bytes)?;
    let image: Vec<u8> = page.iter().copied().cycle().take(pool_bytes).collect();
    b.write_buffer(&pool, 0, &image)?;
    let plan = SpanPlan::new(
        g,
        pool_bytes,
        0,
        total,
        vec![Span {
            source: SpanSource::Resident {
                layer: 0,
                first_page: 0,
            },
            first_token: 0,
            count: total,
            offset: 0,
        }],
    )?;
    // Full evaluation (begin + accumulate + finish) and the accumulate launch alone, widths 1 and
    // 4; the history is read once per evaluation whatever the width.
    let mut times = Vec::new();
    // KVSTREAM_BENCH_SKIP_ATTN=1 skips the attention timings (e.g. when only the GEMV changed).
    let widths: &[usize] = if std::env::var_os("KVSTREAM_BENCH_SKIP_ATTN").is_some() {
        &[]
    } else {
        &[1, 4]
    };
    for &width in widths {
        let shape = AttentionShape {
            q_heads: 24,
            kv_heads: 4,
            head_dim: 256,
            width,
            total,
            scale: 1.0 / 16.0,
            k_type: KvType::Q8_0,
            v_type: KvType::Q4_0,
        };
        let q: Vec<f32> = (0..shape.query_len())
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let qt = b.tensor_from_f32(&q, &[width, 24, 256])?;
        let path = b
            .fast_attention_kernel(&shape, &g)
            .unwrap_or("generic kernel");
        let secs = time(&b, 100, || {
            let mut acc = attention_begin(&b, shape)?;
            attention_accumulate(&b, &mut acc, &qt, &pool, &plan)?;
            attention_finish(&b, acc)?;
            Ok(())
        })?;
        // Each accumulate launch starts every split fresh, so one state can be reused.
        let mut state =
            kvstream_memory_contracts::attention::StreamedAttention::attn_state_new(&b, &shape)?;
        let ksecs = time(&b, 100, || {
            kvstream_memory_contracts::attention::StreamedAttention::attn_accumulate_unchecked(
                &b, &shape, &qt, &pool, &plan, &mut state,
            )?;
            Ok(())
        })?;
        let gbs = pool_bytes as f64 / secs / 1e9;
        let kgbs = pool_bytes as f64 / ksecs / 1e9;
        let gsecs = time_graph(&b, 20, 10, || {
            kvstream_memory_contracts::attention::StreamedAttention::attn_accumulate_unchecked(
                &b, &shape, &qt, &pool, &plan, &mut state,
            )?;
            Ok(())
        })?;
        out!(
            report,
            "attention q8_0/q4_0 64Ki tokens width {width}: accumulate kernel in a graph {:.1} us ({:.0}% of HBM read)",
            gsecs * 1e6,
            100.0 * pool_bytes as f64 / gsecs / 1e9 / hbm
        )?;
        // The finish (split combine) alone, on the state the accumulate launches left.
        let fsecs = time_graph(&b, 20, 10, || {
            let _out =
                kvstream_memory_contracts::attention::StreamedAttention::attn_finish_unchecked(
                    &b, &shape, &state,
                )?;
            Ok(())
        })?;
        out!(
            report,
            "attention q8_0/q4_0 64Ki tokens width {width}: finish kernel in a graph {:.1} us ({} splits)",
            fsecs * 1e6,
            b.attn_splits(&shape).count
        )?;
        out!(
            report,
            "attention q8_0/q4_0 64Ki tokens width {width} ({path}): evaluation {:.1} us, \
             {gbs:.0} GB/s of KV ({:.0}% of HBM read); accumulate kernel {:.1} us, {kgbs:.0} GB/s \
             ({:.0}%)",
            secs * 1e6,
            100.0 * gbs / hbm,
            ksecs * 1e6,
            100.0 * kgbs / hbm
        )?;
        times.push((secs, ksecs));
    }
    if let [(e1, k1), (e4, k4)] = times[..] {
        out!(
            report,
            "attention width 4 / width 1: evaluation {:.2}x, accumulate kernel {:.2}x (target <= 1.3x)",
            e4 / e1,
            k4 / k1
        )?;
    }

    let path = std::path::Path::new(&out_dir).join("cuda_bench.txt");
    std::fs::write(&path, &report)?;
    eprintln!("wrote {}", path.display());
    Ok(())
}
