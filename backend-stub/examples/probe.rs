//! Prints what the wgpu stub finds on this machine: every adapter, the capability table, and
//! the first missing capability (what `kvstream inspect --backend wgpu` reports).
//!
//! `cargo run -p kvstream-backend-stub --example probe`

use kvstream_backend_stub::StubBackend;
use kvstream_memory_contracts::report::render_capability_table;
use kvstream_memory_contracts::Backend;

fn main() {
    let b = StubBackend::probe();
    if b.adapters().is_empty() {
        println!("adapters: none");
    }
    for (i, a) in b.adapters().iter().enumerate() {
        println!("adapter {i}: {a}");
    }
    print!("{}", render_capability_table(&b.capabilities()));
    match b.check_model_support() {
        Ok(()) => println!("model support: yes"),
        Err(e) => {
            println!("model support: no: {e}");
            std::process::exit(1);
        }
    }
}
