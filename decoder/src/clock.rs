//! Host time inside kvplan's calls, by kind, for the step split of the summary.
//!
//! Burn runs a device's work on its own thread: a call on the caller's thread only enqueues, and a
//! fused custom op runs the model's queued ops when it is registered. A plain timer around a
//! kvplan call so measures neither the op's own cost nor only it. Isolated ([`OpClock::isolated`],
//! `--profile`) the clock flushes the device's queue before a span and again after it, and takes
//! off the round trip of an empty flush: what is left is the span's own work on both threads (its
//! launches included, the device's execution not, unless the span reads back).

use std::time::{Duration, Instant};

use burn_core::tensor::Device;

/// Time in kvplan's calls, by kind.
#[derive(Debug, Clone, Copy, Default)]
pub struct OpTimes {
    /// Bookkeeping: gathers, `segment_assign`, the key runs' check, the canary's plan, write and
    /// verify, the step's one status and violation read.
    pub bookkeeping: Duration,
    /// The forwards' K/V stores (their slots' check included).
    pub stores: Duration,
    /// Paged attention.
    pub attention: Duration,
}

impl OpTimes {
    /// All kinds together.
    pub fn total(&self) -> Duration {
        self.bookkeeping + self.stores + self.attention
    }

    fn add(&mut self, other: OpTimes) {
        self.bookkeeping += other.bookkeeping;
        self.stores += other.stores;
        self.attention += other.attention;
    }
}

/// Which [`OpTimes`] field a span is charged to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    /// [`OpTimes::bookkeeping`].
    Bookkeeping,
    /// [`OpTimes::stores`].
    Stores,
    /// [`OpTimes::attention`].
    Attention,
}

/// A span started by [`OpClock::start`].
#[must_use]
pub struct Span(Instant);

/// Times spans of kvplan calls: plain host timers, or isolated from the queue around them.
pub struct OpClock {
    device: Device,
    isolated: bool,
    times: OpTimes,
}

impl OpClock {
    /// Plain timers: the caller's time inside the calls.
    pub fn new(device: &Device) -> Self {
        Self {
            device: device.clone(),
            isolated: false,
            times: OpTimes::default(),
        }
    }

    /// Spans flushed apart from the work around them (slower: two round trips to the device's
    /// thread a span).
    pub fn isolated(device: &Device) -> Self {
        Self {
            isolated: true,
            ..Self::new(device)
        }
    }

    /// Starts a span; with isolation, after the work queued before it has been handed off.
    pub fn start(&self) -> Span {
        if self.isolated {
            // A failed flush shows up at the step's next read; here it only blurs the timing.
            self.device.flush().ok();
        }
        Span(Instant::now())
    }

    /// Ends `span` and charges it to `kind`.
    pub fn stop(&mut self, span: Span, kind: OpKind) {
        let spent = if self.isolated {
            self.device.flush().ok();
            let spent = span.0.elapsed();
            let empty = Instant::now();
            self.device.flush().ok();
            spent.saturating_sub(empty.elapsed())
        } else {
            span.0.elapsed()
        };
        let slot = match kind {
            OpKind::Bookkeeping => &mut self.times.bookkeeping,
            OpKind::Stores => &mut self.times.stores,
            OpKind::Attention => &mut self.times.attention,
        };
        *slot += spent;
    }

    /// The time charged since the last call, moved into `total`.
    pub fn drain_into(&mut self, total: &mut OpTimes) {
        total.add(std::mem::take(&mut self.times));
    }
}
