//! A tiny deterministic RNG (SplitMix64): the trace must be the same on every run and every
//! backend, and the crate takes no dependency for it.

/// SplitMix64 (Steele, Lea, Flood 2014): one `u64` of state, full period, good enough for a
/// synthetic workload.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        // The project's one splitmix64 step.
        kvplan_decoder::sample::splitmix64(&mut self.state)
    }

    /// Uniform in `lo..=hi` (`lo <= hi`). The modulo bias is irrelevant at these ranges.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        let span = (hi - lo) as u64 + 1;
        lo + (self.next_u64() % span) as usize
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        // 53 random bits as a float in [0, 1).
        ((self.next_u64() >> 11) as f64) * (1.0 / (1u64 << 53) as f64) < p
    }

    /// Fisher-Yates shuffle.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, self.range(0, i));
        }
    }
}
