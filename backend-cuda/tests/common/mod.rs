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
