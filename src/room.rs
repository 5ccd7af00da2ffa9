//! Room for a buffer before it is allocated: a size the device (or the host) cannot allocate is an
//! `allocation_too_large` error, never a panic or an abort.
//!
//! CubeCL 0.11 allocates lazily: a buffer past the device's `max_page_size` (or past the memory it
//! has) only fails on the device's thread, and the failure surfaces at the next read as an
//! execution error; its client also multiplies shapes by element sizes in `usize` unchecked. A
//! failed host `Vec` allocation aborts the process. So every op that sizes a buffer from its
//! caller's numbers asks here first.

#[cfg(any(feature = "vulkan", feature = "cuda"))]
use core::any::Any;

#[cfg(any(feature = "vulkan", feature = "cuda"))]
use burn_core::backend::DispatchDevice;

use crate::error::Error;

/// One buffer an op is about to allocate.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Buffer {
    what: &'static str,
    elements: usize,
    elem_bytes: usize,
}

impl Buffer {
    /// A buffer of `elements` values of `elem_bytes` each.
    pub fn new(what: &'static str, elements: usize, elem_bytes: usize) -> Self {
        Self {
            what,
            elements,
            elem_bytes,
        }
    }

    /// A buffer of `elements` i64 values.
    pub fn i64s(what: &'static str, elements: usize) -> Self {
        Self::new(what, elements, 8)
    }

    fn bytes(&self) -> u128 {
        self.elements as u128 * self.elem_bytes as u128
    }

    fn refused(&self, on: &'static str, limit: Option<u64>) -> Error {
        Error::AllocationTooLarge {
            what: self.what,
            elements: self.elements as u64,
            bytes: self.bytes(),
            on,
            limit,
        }
    }
}

/// The most bytes one `Vec` may hold.
const HOST_LIMIT: u64 = isize::MAX as u64;

/// Host copies up to this many bytes in all are not probed with a reservation.
const PROBE_FROM: u128 = 64 << 20;

/// Refuses `buffers` where `device` cannot allocate one of them: past its `max_page_size` on a
/// CubeCL device, past what the host can reserve on any other (Flex keeps tensors in `Vec`s).
pub(crate) fn on_device<D: 'static>(device: &D, buffers: &[Buffer]) -> Result<(), Error> {
    match page_limit(device) {
        Some(limit) => within(buffers, limit, "the device"),
        None => on_host(buffers),
    }
}

/// Refuses the first of `buffers` past `limit` bytes, as one `on` cannot allocate.
pub(crate) fn within(buffers: &[Buffer], limit: u64, on: &'static str) -> Result<(), Error> {
    match buffers
        .iter()
        .find(|buffer| buffer.bytes() > u128::from(limit))
    {
        Some(buffer) => Err(buffer.refused(on, Some(limit))),
        None => Ok(()),
    }
}

/// Refuses host copies the host cannot hold together: each within `isize::MAX` bytes, and all of
/// them reserved at once (then given back) so that a refusal is an error here, not an abort later.
pub(crate) fn on_host(buffers: &[Buffer]) -> Result<(), Error> {
    within(buffers, HOST_LIMIT, "the host")?;
    let total: u128 = buffers.iter().map(Buffer::bytes).sum();
    let Some(largest) = buffers.iter().max_by_key(|buffer| buffer.bytes()) else {
        return Ok(());
    };
    // Small totals skip the probe: it costs an mmap pair per gather on the hot path, and a host
    // that cannot give this much is out of memory for everything else too.
    if total <= PROBE_FROM {
        return Ok(());
    }
    // Untouched pages cost nothing: the reservation only asks the allocator whether it would.
    let total = usize::try_from(total).map_err(|_| largest.refused("the host", None))?;
    Vec::<u8>::new()
        .try_reserve_exact(total)
        .map_err(|_| largest.refused("the host", None))
}

/// `max_page_size` of a CubeCL device (fused or not, under autodiff or not); `None` elsewhere.
fn page_limit<D: 'static>(device: &D) -> Option<u64> {
    #[cfg(any(feature = "vulkan", feature = "cuda"))]
    return cube_device(device).map(|cube| cube.client().properties().memory.max_page_size);
    #[cfg(not(any(feature = "vulkan", feature = "cuda")))]
    {
        let _ = device;
        None
    }
}

/// The CubeCL device `device` names (fused or not, under autodiff or not); `None` elsewhere.
#[cfg(any(feature = "vulkan", feature = "cuda"))]
pub(crate) fn cube_device<D: 'static>(device: &D) -> Option<burn_cubecl::CubeDevice> {
    let device = device as &dyn Any;
    if let Some(dispatch) = device.downcast_ref::<DispatchDevice>() {
        return match dispatch.clone().inner() {
            DispatchDevice::Cube(cube) => Some(cube),
            _ => None,
        };
    }
    device.downcast_ref::<burn_cubecl::CubeDevice>().cloned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_refuses_what_it_cannot_reserve() {
        let huge = Buffer::i64s("verify plan", 1 << 40);
        let error = on_host(&[huge]).unwrap_err();
        assert_eq!(error.kind(), "allocation_too_large");
        assert_eq!(
            error.to_string(),
            "kvplan: verify plan needs 1099511627776 elements (8796093022208 bytes), more than the host can allocate"
        );
        let error = on_host(&[Buffer::i64s("gather output", usize::MAX)]).unwrap_err();
        assert_eq!(
            error.to_string(),
            format!(
                "kvplan: gather output needs {} elements ({} bytes), more than the host can allocate (at most {} bytes at once)",
                usize::MAX,
                usize::MAX as u128 * 8,
                isize::MAX
            )
        );
        assert_eq!(on_host(&[Buffer::i64s("small", 1 << 10)]), Ok(()));
        assert_eq!(on_host(&[]), Ok(()));
    }

    #[test]
    fn host_copies_are_reserved_together() {
        // Each fits in isize::MAX bytes; together they overflow what the host can reserve.
        let half = Buffer::i64s("half", 1 << 59);
        assert_eq!(
            on_host(&[half, half]).map_err(|error| error.kind()),
            Err("allocation_too_large")
        );
    }

    #[test]
    fn a_host_device_is_checked_as_the_host() {
        let flex = burn_core::tensor::Device::flex().as_dispatch().clone();
        let error = on_device(&flex, &[Buffer::i64s("kv store", 1 << 40)]).unwrap_err();
        assert!(error.to_string().contains("the host"), "{error}");
    }
}
