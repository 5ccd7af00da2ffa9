//! Host time inside kvplan's calls, by kind, for the step split of the summary.
//!
//! Burn runs a device's work on a thread of its own: a call on the caller's thread mostly
//! enqueues, and a fused custom op runs the model's queued ops when it is registered. So these
//! timers give the caller's share only; what the calls cost a pipelined step is measured by
//! running them twice ([`crate::engine::EngineOptions::repeat`]).

use std::time::{Duration, Instant};

/// Time in kvplan's calls, by kind.
#[derive(Debug, Clone, Copy, Default)]
pub struct OpTimes {
    /// Bookkeeping: a step's `PagedKv::begin` (slots, `segment_assign`, the gathers, the key
    /// runs' and slots' checks) and `end` (the canary's plan, write and verify, the step's one
    /// status and violation read).
    pub bookkeeping: Duration,
    /// `PagedKv::attend`: each layer's K/V store and paged attention.
    pub attention: Duration,
}

impl OpTimes {
    /// All kinds together.
    pub fn total(&self) -> Duration {
        self.bookkeeping + self.attention
    }

    fn add(&mut self, other: OpTimes) {
        self.bookkeeping += other.bookkeeping;
        self.attention += other.attention;
    }
}

/// Which [`OpTimes`] field a span is charged to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    /// [`OpTimes::bookkeeping`].
    Bookkeeping,
    /// [`OpTimes::attention`].
    Attention,
}

/// A span started by [`OpClock::start`].
#[must_use]
pub struct Span(Instant);

/// Times spans of kvplan calls by kind.
#[derive(Debug, Default)]
pub struct OpClock {
    times: OpTimes,
}

impl OpClock {
    /// Starts a span.
    pub fn start(&self) -> Span {
        Span(Instant::now())
    }

    /// Ends `span` and charges it to `kind`.
    pub fn stop(&mut self, span: Span, kind: OpKind) {
        let spent = span.0.elapsed();
        let slot = match kind {
            OpKind::Bookkeeping => &mut self.times.bookkeeping,
            OpKind::Attention => &mut self.times.attention,
        };
        *slot += spent;
    }

    /// The time charged since the last call, moved into `total`.
    pub fn drain_into(&mut self, total: &mut OpTimes) {
        total.add(std::mem::take(&mut self.times));
    }
}
