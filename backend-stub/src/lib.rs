//! # kvstream-backend-stub: the wgpu stub backend
//!
//! A backend that implements **every** memory-contracts trait, so it is a
//! [`ModelBackend`](kvstream_memory_contracts::ops::ModelBackend), and compiles on any machine,
//! but only does what wgpu really gives it:
//!
//! | contract | stub behaviour |
//! |---|---|
//! | [`Backend`](kvstream_memory_contracts::Backend) | real: adapter name, API, type, driver and limits in `capabilities()`; nothing streamable advertised |
//! | [`DeviceMemory`](kvstream_memory_contracts::transfer::DeviceMemory) | real where a device exists: `wgpu::Buffer` allocation, synchronous upload and readback |
//! | [`PinnedHost`](kvstream_memory_contracts::host::PinnedHost) | `HostError::Capability` (operation `register_host`) |
//! | [`CopyEngine`](kvstream_memory_contracts::transfer::CopyEngine) | `TransferError::Capability` (`copy_h2d`, `copy_d2h`, `record_compute_fence`) |
//! | [`StreamedAttention`](kvstream_memory_contracts::attention::StreamedAttention) | `AttentionError::Capability` (`streamed_attention`) |
//! | ops ([`kvstream_memory_contracts::ops`]) | `OpError::Capability` from every constructor (`tensor_from_f32`, `zeros`, `load_weight`) |
//!
//! Every capability error names backend `wgpu`, the operation, why, and suggests
//! `--backend cuda or --backend cpu`. The stub's tensor, weight, fence and host-registration
//! types are uninhabited ([`never`]), so an operation that would need one cannot be reached:
//! there is no panic and no silent fallback anywhere.
//!
//! Construction: [`StubBackend::new`] fails with "no wgpu adapter found on this machine" when
//! there is no adapter; [`StubBackend::probe`] always succeeds (for `kvstream inspect`);
//! [`StubBackend::noop`] uses wgpu's host-memory Noop adapter so the real buffer paths run in CI.
//! Adapters are ranked discrete > integrated > virtual > CPU; a software adapter (Mesa llvmpipe
//! through GL) counts as an adapter and is reported as `(Gl, Cpu, ...)`.
//!
//! What a front end does with it (`kvstream generate/inspect --backend wgpu`):
//!
//! ```no_run
//! use kvstream_backend_stub::StubBackend;
//! use kvstream_memory_contracts::report::render_capability_table;
//! use kvstream_memory_contracts::Backend;
//!
//! let b = StubBackend::probe();
//! print!("{}", render_capability_table(&b.capabilities()));
//! if let Err(e) = b.check_model_support() {
//!     // "backend `wgpu` cannot do `pinned_host`: ...; use --backend cuda or --backend cpu"
//!     // or, without an adapter, "backend `wgpu` cannot do `adapter`: no wgpu adapter found ..."
//!     eprintln!("error: {e}");
//!     std::process::exit(2);
//! }
//! ```
//!
//! The stub is the starting template of a port: see `docs/porting.md`.

pub mod adapter;
pub mod backend;
pub mod memory;
pub mod never;
pub mod unsupported;

pub use adapter::AdapterSummary;
pub use backend::{StubBackend, BACKEND, NO_ADAPTER};
pub use memory::StubBuffer;
pub use never::{StubFence, StubHostRegistration, StubTensor, StubWeight};
