//! Uninhabited associated types: what the stub can never produce.
//!
//! burn's `GraphUnsupported` pattern. The stub has no kernels, no fences and no host
//! registration, so its [`Backend::Tensor`](kvstream_memory_contracts::Backend::Tensor),
//! `Weight`, `Fence` and `HostRegistration` are enums with **no variants**. Every constructor
//! of them returns a [`CapabilityError`](kvstream_memory_contracts::CapabilityError); every
//! operation that *takes* one is `match *value {}`, which the compiler proves unreachable.
//! No code path can hold a stub tensor by accident, and no stub op can silently fall back.

use kvstream_memory_contracts::backend::{DeviceTensor, DeviceWeight, Fence, WeightDType};

macro_rules! uninhabited {
    ($(#[$m:meta])* $name:ident) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum $name {}
    };
}

uninhabited!(
    /// The stub's activation tensor: never constructed (no compute kernels).
    StubTensor
);
uninhabited!(
    /// The stub's weight: never constructed (weights cannot be uploaded for ops that do not exist).
    StubWeight
);
uninhabited!(
    /// The stub's fence: never constructed (no copy engine, no compute queue fences).
    StubFence
);
uninhabited!(
    /// The stub's pinned-host registration token: never constructed (no page-locking).
    StubHostRegistration
);

impl DeviceTensor for StubTensor {
    fn dims(&self) -> &[usize] {
        match *self {}
    }
}

impl DeviceWeight for StubWeight {
    fn dims(&self) -> &[usize] {
        match *self {}
    }
    fn dtype(&self) -> WeightDType {
        match *self {}
    }
    fn device_bytes(&self) -> usize {
        match *self {}
    }
}

impl Fence for StubFence {
    fn is_complete(&self) -> bool {
        match *self {}
    }
}
