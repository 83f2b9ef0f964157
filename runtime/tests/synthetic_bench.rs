//! Benchmark support: synthetic engines, synthetic histories and rolled-back timed steps.

mod common;

use kvstream_backend_cpu::CpuBackend;
use kvstream_memory_contracts::backend::WeightDType;
use kvstream_memory_contracts::kv::format::KvType;
use kvstream_model_qwen::QwenConfig;
use kvstream_runtime::Engine;

fn engine() -> Engine<CpuBackend> {
    let name = "tiny-gqa-f32";
    let cfg = common::tiny_arena(name, KvType::F16, KvType::Q8_0, 16, 32);
    let qc = QwenConfig::from_model_dir(&common::dir(name)).expect("config");
    Engine::load_synthetic(CpuBackend::new(), cfg, qc, WeightDType::Bf16, 11).expect("load")
}

#[test]
fn timed_steps_roll_back_and_synthetic_histories_are_deterministic() {
    let mut e = engine();
    assert!(e.weight_bytes() > 0);
    let vocab = e.model_config().vocab_size() as u32;
    let tok = 7 % vocab;

    e.fill_synthetic_history(300, 320, 5).expect("fill");
    assert_eq!(e.session_len(), 300);
    for w in 1..=4u32 {
        let toks: Vec<u32> = (0..w).map(|i| (3 + 5 * i) % vocab).collect();
        let s = e.timed_step(&toks).expect("timed step");
        assert_eq!(s.width, w as usize);
        assert!(s.seconds > 0.0);
        // 300 tokens in 16-token pages through a 3-slot ring: the step streams.
        assert!(s.h2d_bytes > 0, "width {w}: {s:?}");
        assert_eq!(e.session_len(), 300, "width {w} was not rolled back");
    }
    let after_timed = e.decode_step(tok).expect("decode");

    e.fill_synthetic_history(300, 320, 5).expect("refill");
    let fresh = e.decode_step(tok).expect("decode");
    assert_eq!(
        after_timed, fresh,
        "timed steps left a trace in the session"
    );

    e.fill_synthetic_history(300, 320, 6).expect("other seed");
    let other = e.decode_step(tok).expect("decode");
    assert_ne!(
        fresh, other,
        "the synthetic history did not reach attention"
    );
    assert!(e.fill_synthetic_history(0, 8, 1).is_err());
    assert!(e.fill_synthetic_history(10_000, 10_000, 1).is_err());
}
