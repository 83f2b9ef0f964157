//! The one place that names concrete backends: `--backend` → a `ModelBackend` value.

use crate::args::BackendKind;
use anyhow::{bail, Result};
use kvstream_memory_contracts::ops::ModelBackend;

/// Work that runs on whichever backend the user picked.
pub trait OnBackend {
    type Output;
    fn run<B: ModelBackend>(self, backend: B) -> Result<Self::Output>;
}

/// Instantiates the backend `kind` and runs `work` on it.
pub fn dispatch<W: OnBackend>(kind: BackendKind, device: usize, work: W) -> Result<W::Output> {
    let _ = device;
    match kind {
        BackendKind::Cpu => work.run(kvstream_backend_cpu::CpuBackend::new()),
        BackendKind::Cuda => {
            #[cfg(feature = "cuda")]
            {
                let b = kvstream_backend_cuda::CudaBackend::new(device)?;
                work.run(b)
            }
            #[cfg(not(feature = "cuda"))]
            {
                bail!("this kvstream was built without CUDA: rebuild with `cargo build --release --features cuda`, or use --backend cpu")
            }
        }
        BackendKind::Wgpu => {
            #[cfg(feature = "wgpu")]
            {
                let b = kvstream_backend_stub::StubBackend::probe();
                // The missing adapter first, then the first missing capability.
                b.check_model_support()?;
                work.run(b)
            }
            #[cfg(not(feature = "wgpu"))]
            {
                bail!("this kvstream was built without wgpu: rebuild with `--features wgpu`, or use --backend cpu / --backend cuda")
            }
        }
    }
}

/// Whether backend `kind` can run a model: `Err` names the first missing capability (for the
/// wgpu stub, a missing adapter first) and suggests another backend.
pub fn model_support(
    kind: BackendKind,
    caps: &kvstream_memory_contracts::Capabilities,
) -> Result<()> {
    #[cfg(feature = "wgpu")]
    if kind == BackendKind::Wgpu {
        kvstream_backend_stub::StubBackend::probe().check_model_support()?;
    }
    let _ = kind;
    match kvstream_memory_contracts::report::first_missing_capability(caps) {
        Some(missing) => bail!("{missing}"),
        None => Ok(()),
    }
}

/// The capabilities of backend `kind` (for `inspect`), without running anything.
#[allow(unused_imports)]
pub fn capabilities(
    kind: BackendKind,
    device: usize,
) -> Result<kvstream_memory_contracts::Capabilities> {
    #[allow(unused_imports)]
    use kvstream_memory_contracts::backend::Backend;
    struct Caps;
    impl OnBackend for Caps {
        type Output = kvstream_memory_contracts::Capabilities;
        fn run<B: ModelBackend>(self, backend: B) -> Result<Self::Output> {
            Ok(backend.capabilities())
        }
    }
    match kind {
        #[cfg(feature = "wgpu")]
        BackendKind::Wgpu => Ok(kvstream_backend_stub::StubBackend::probe().capabilities()),
        _ => dispatch(kind, device, Caps),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Name;
    impl OnBackend for Name {
        type Output = &'static str;
        fn run<B: ModelBackend>(self, backend: B) -> Result<&'static str> {
            Ok(backend.name())
        }
    }

    #[test]
    fn cpu_dispatches_and_missing_features_are_errors() {
        assert_eq!(dispatch(BackendKind::Cpu, 0, Name).ok(), Some("cpu"));
        #[cfg(not(feature = "cuda"))]
        assert!(dispatch(BackendKind::Cuda, 0, Name)
            .err()
            .is_some_and(|e| e.to_string().contains("--features cuda")));
    }
}
