//! Arena loans on the CUDA backend (`DeviceMemory::begin_region_allocations`): tensors and
//! weights made during a loan are ranges of the lent region, ops on them are correct, a request
//! that does not fit is a typed out-of-memory error, freed ranges are reused, the report counts
//! what is still alive, and after the loan allocations are the driver's again. Run on a GPU
//! machine with `--ignored`.

use kvstream_memory_contracts::backend::WeightDType;
use kvstream_memory_contracts::error::OpError;
use kvstream_memory_contracts::ops::{LinearOps, TensorOps, WeightData};
use kvstream_memory_contracts::transfer::DeviceMemory;
use rand::rngs::StdRng;
use rand::SeedableRng;

mod common;
use common::{gpu, rnd};

#[test]
#[ignore = "needs a CUDA GPU"]
fn lent_region_holds_tensors_and_weights_until_the_loan_ends() {
    let b = gpu();
    b.set_region_lending(true);
    let mut rng = StdRng::seed_from_u64(3);
    let arena = b.alloc_buffer(1 << 20).expect("arena");
    let (off, len) = (64 * 1024, 256 * 1024);
    let lo = arena.ptr() + off as u64;
    let hi = lo + len as u64;
    let inside = |p: u64| (lo..hi).contains(&p);

    b.begin_region_allocations(&arena, off, len).expect("lend");
    assert!(
        b.begin_region_allocations(&arena, off, len).is_err(),
        "a second loan while one is active is refused"
    );
    // A weight and an activation inside the region; a matmul on them matches the host result.
    let (n, k) = (32, 256);
    let w = rnd(&mut rng, n * k, 0.5);
    let x = rnd(&mut rng, k, 1.0);
    let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
    let wt = b
        .load_weight("w", WeightDType::F32, &[n, k], WeightData::from_vec(bytes))
        .expect("weight in the region");
    let xt = b.tensor_from_f32(&x, &[1, k]).expect("x in the region");
    assert!(
        inside(wt.ptr()) && inside(xt.ptr()),
        "not carved from the region"
    );
    let y = b.matmul(&xt, &wt).expect("matmul in the region");
    assert!(inside(y.ptr()));
    let got = b.tensor_to_f32(&y).expect("y");
    for (r, g) in got.iter().enumerate() {
        let want: f32 = (0..k).map(|c| w[r * k + c] * x[c]).sum();
        assert!(
            (g - want).abs() <= 1e-4 * (1.0 + want.abs()),
            "row {r}: {g} vs {want}"
        );
    }
    // Too large for what is left: a typed out-of-memory error naming the region.
    match b.tensor_from_f32(&vec![1.0; len / 4], &[len / 4]) {
        Err(OpError::OutOfMemory { what, .. }) => {
            assert!(what.contains("lent arena region"), "{what}")
        }
        other => panic!("expected out of memory, got {other:?}"),
    }
    // Freed ranges are reused.
    let p = y.ptr();
    drop(y);
    let again = b.tensor_from_f32(&x[..32], &[32]).expect("reuse");
    assert_eq!(again.ptr(), p, "first fit reuses the freed range");
    drop(again);
    // `xt` is still alive: the report counts it.
    let report = b.end_region_allocations().expect("end");
    assert_eq!(report.region_bytes, len);
    assert_eq!(report.live_count, 2, "weight and x still alive");
    assert!(report.peak_bytes >= n * k * 4 + k * 4 + n * 4);
    drop((wt, xt));
    // After the loan, allocations are the driver's again.
    let own = b.tensor_from_f32(&x, &[k]).expect("own");
    assert!(!inside(own.ptr()));
    // Out-of-range or misaligned regions are refused.
    assert!(b.begin_region_allocations(&arena, 1 << 20, 256).is_err());
    assert!(b.begin_region_allocations(&arena, 100, 4096).is_err());
    assert_eq!(b.end_region_allocations().expect("no loan").live_count, 0);
    // Lending off: a loan is accounting only, allocations stay the driver's.
    b.set_region_lending(false);
    b.begin_region_allocations(&arena, off, len)
        .expect("no-op loan");
    let t = b.tensor_from_f32(&x, &[k]).expect("own");
    assert!(!inside(t.ptr()));
    assert_eq!(b.end_region_allocations().expect("end"), Default::default());
}
