//! Adapter discovery: the part of the stub that is fully real.
//!
//! [`discover`] asks one `wgpu::Instance` (every native backend: Vulkan, Metal, DX12, GL) for its
//! adapters, ranks them (discrete > integrated > virtual > CPU > other) and opens a device on the
//! best one with that adapter's own limits. Nothing here panics on a machine without a GPU: no
//! adapter is an ordinary outcome, reported as [`Discovery::gpu`] = `None`.

use std::fmt;

/// What the stub reports about one adapter: identity and the limits a port would care about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterSummary {
    /// Adapter name as the driver reports it.
    pub name: String,
    /// Graphics API (`Vulkan`, `Metal`, `Dx12`, `Gl`, `Noop`).
    pub api: String,
    /// Device type (`DiscreteGpu`, `IntegratedGpu`, `VirtualGpu`, `Cpu`, `Other`).
    pub device_type: String,
    /// Driver name and version info, possibly empty.
    pub driver: String,
    /// Largest buffer the adapter can create (bounds the arena parent allocation).
    pub max_buffer_size: u64,
    /// Largest storage-buffer binding a shader can see at once (bounds one kernel's view).
    pub max_storage_buffer_binding_size: u64,
    /// Workgroup shared memory in bytes (bounds an attention tile).
    pub max_compute_workgroup_storage_size: u32,
    /// Invocations per workgroup.
    pub max_compute_invocations_per_workgroup: u32,
}

impl AdapterSummary {
    pub(crate) fn from_adapter(adapter: &wgpu::Adapter) -> Self {
        let info = adapter.get_info();
        let limits = adapter.limits();
        let driver = [info.driver.as_str(), info.driver_info.as_str()]
            .iter()
            .filter(|s| !s.is_empty())
            .copied()
            .collect::<Vec<_>>()
            .join(" ");
        Self {
            name: info.name,
            api: format!("{:?}", info.backend),
            device_type: format!("{:?}", info.device_type),
            driver,
            max_buffer_size: limits.max_buffer_size,
            max_storage_buffer_binding_size: limits.max_storage_buffer_binding_size,
            max_compute_workgroup_storage_size: limits.max_compute_workgroup_storage_size,
            max_compute_invocations_per_workgroup: limits.max_compute_invocations_per_workgroup,
        }
    }
}

impl fmt::Display for AdapterSummary {
    /// One line: `name (api, device type, driver); limits: ...`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}, {}", self.name, self.api, self.device_type)?;
        if !self.driver.is_empty() {
            write!(f, ", driver {}", self.driver)?;
        }
        write!(
            f,
            "); limits: max_buffer_size {} B, max_storage_buffer_binding_size {} B, \
             workgroup storage {} B, {} invocations/workgroup",
            self.max_buffer_size,
            self.max_storage_buffer_binding_size,
            self.max_compute_workgroup_storage_size,
            self.max_compute_invocations_per_workgroup
        )
    }
}

/// Rank used to pick the adapter: lower is preferred.
fn rank(t: wgpu::DeviceType) -> u8 {
    match t {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Cpu => 3,
        wgpu::DeviceType::Other => 4,
    }
}

/// An opened device on the chosen adapter.
#[derive(Debug)]
pub(crate) struct Gpu {
    pub(crate) summary: AdapterSummary,
    pub(crate) device: wgpu::Device,
    pub(crate) queue: wgpu::Queue,
    pub(crate) max_buffer_size: u64,
}

/// The result of asking wgpu for adapters.
#[derive(Debug)]
pub(crate) struct Discovery {
    /// Every adapter found, best first.
    pub(crate) adapters: Vec<AdapterSummary>,
    /// A device on the best adapter, if one could be opened.
    pub(crate) gpu: Option<Gpu>,
    /// Why no device was opened although adapters exist.
    pub(crate) device_error: Option<String>,
}

/// Which instance to ask.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum InstanceKind {
    /// Every native backend; the Noop backend stays disabled.
    Native,
    /// Only wgpu's Noop backend (host memory, no GPU): tests and CI of the real-device paths.
    /// `max_buffer_size` overrides the Noop adapter's (unlimited) buffer size limit.
    Noop { max_buffer_size: Option<u64> },
}

fn instance(kind: InstanceKind) -> wgpu::Instance {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
    match kind {
        InstanceKind::Native => {
            // Native backends only; `backend_options.noop.enable` stays false.
            desc.backends = wgpu::Backends::PRIMARY | wgpu::Backends::SECONDARY;
        }
        InstanceKind::Noop { max_buffer_size } => {
            desc.backends = wgpu::Backends::NOOP;
            let mut noop = wgpu::NoopBackendOptions::enabled();
            if let Some(max) = max_buffer_size {
                let unlimited = wgpu::Limits::unlimited();
                noop.limits = Some(wgpu::Limits {
                    max_buffer_size: max,
                    max_storage_buffer_binding_size: max
                        .min(unlimited.max_storage_buffer_binding_size),
                    max_uniform_buffer_binding_size: max
                        .min(unlimited.max_uniform_buffer_binding_size),
                    ..unlimited
                });
            }
            desc.backend_options.noop = noop;
        }
    }
    wgpu::Instance::new(desc)
}

/// Enumerates adapters of `kind` and opens a device on the best one.
pub(crate) fn discover(kind: InstanceKind) -> Discovery {
    let _span = tracing::debug_span!("wgpu_discover", ?kind).entered();
    let instance = instance(kind);
    let backends = match kind {
        InstanceKind::Native => wgpu::Backends::all(),
        InstanceKind::Noop { .. } => wgpu::Backends::NOOP,
    };
    let mut adapters = pollster::block_on(instance.enumerate_adapters(backends));
    adapters.sort_by_key(|a| rank(a.get_info().device_type));
    let summaries: Vec<AdapterSummary> =
        adapters.iter().map(AdapterSummary::from_adapter).collect();
    tracing::debug!(count = summaries.len(), "wgpu adapters enumerated");

    let Some(best) = adapters.first() else {
        return Discovery {
            adapters: summaries,
            gpu: None,
            device_error: None,
        };
    };
    let summary = AdapterSummary::from_adapter(best);
    let limits = best.limits();
    let desc = wgpu::DeviceDescriptor {
        label: Some("kvstream-stub"),
        required_limits: limits.clone(),
        ..Default::default()
    };
    match pollster::block_on(best.request_device(&desc)) {
        Ok((device, queue)) => {
            // wgpu's default handler panics on an uncaptured error; the stub reports errors
            // through error scopes instead and only logs anything that escapes them.
            device.on_uncaptured_error(std::sync::Arc::new(|e: wgpu::Error| {
                tracing::error!(error = %e, "uncaptured wgpu error");
            }));
            Discovery {
                adapters: summaries,
                gpu: Some(Gpu {
                    summary,
                    device,
                    queue,
                    max_buffer_size: limits.max_buffer_size,
                }),
                device_error: None,
            }
        }
        Err(e) => Discovery {
            adapters: summaries,
            gpu: None,
            device_error: Some(format!("adapter `{}` refused a device: {e}", summary.name)),
        },
    }
}
