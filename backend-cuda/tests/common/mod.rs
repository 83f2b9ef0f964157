//! Helpers shared by the GPU test files (each file is its own crate and uses a subset).
#![allow(dead_code)]

use kvstream_backend_cuda::CudaBackend;
use rand::rngs::StdRng;
use rand::Rng;

/// The CUDA backend of device 0; these tests are `#[ignore]`d without a GPU.
pub fn gpu() -> CudaBackend {
    match CudaBackend::new(0) {
        Ok(b) => b,
        Err(e) => panic!("this test needs a CUDA GPU: {e}"),
    }
}

/// `n` uniform values in ±`amp`, never exactly zero.
pub fn rnd(rng: &mut StdRng, n: usize, amp: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let x = rng.random_range(-amp..amp);
            if x == 0.0 {
                amp * 0.25
            } else {
                x
            }
        })
        .collect()
}

/// MTP verification relies on it: with `full` = `run(x, 8)` (8 rows of `k` values, `n` outputs
/// each), every prefix call `run(x[..t·k], t)` and every single row `run(x[(t−1)·k..t·k], 1)`
/// gives the same outputs bit for bit, for t in 1..=8. `what` names the case in a failure.
pub fn assert_rows_independent_of_width(
    what: &str,
    n: usize,
    k: usize,
    x: &[f32],
    full: &[f32],
    run: impl Fn(&[f32], usize) -> Vec<f32>,
) {
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<u32>>();
    let full = bits(full);
    for t in 1..=8 {
        let part = bits(&run(&x[..t * k], t));
        assert_eq!(part[..], full[..t * n], "{what}: T={t} differs from T=8");
        let one = bits(&run(&x[(t - 1) * k..t * k], 1));
        assert_eq!(
            one[..],
            full[(t - 1) * n..t * n],
            "{what}: row {} alone differs",
            t - 1
        );
    }
}
