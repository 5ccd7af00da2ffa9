//! N-gram prompt lookup: drafts copied from the request's own context (vLLM's `ngram`,
//! transformers' `prompt_lookup_num_tokens`).

/// Up to `k` tokens that followed the latest earlier occurrence of the context's last `n` tokens,
/// trying `n = max_ngram` down to 1; empty when nothing matches.
pub fn ngram_draft(context: &[u32], max_ngram: usize, k: usize) -> Vec<u32> {
    if k == 0 {
        return Vec::new();
    }
    for n in (1..=max_ngram.min(context.len().saturating_sub(1))).rev() {
        let suffix = &context[context.len() - n..];
        // Latest match first: recent context predicts best.
        for start in (0..context.len() - n).rev() {
            if &context[start..start + n] == suffix {
                let from = start + n;
                let to = (from + k).min(context.len());
                return context[from..to].to_vec();
            }
        }
    }
    Vec::new()
}

/// The most decode steps a request waits before it looks up a draft again.
pub const MAX_WAIT: usize = 16;

/// When a request drafts by lookup: after a draft that missed it waits 1, 2, 4 .. [`MAX_WAIT`]
/// decode steps before it looks again, and a draft that paid ends the wait. A draft pays when it
/// keeps at least a quarter of its tokens: a verify step of 11 tokens costs about 2.6 decode
/// steps on an H100 (`benches/RESULTS.md`, session 39), so a request whose lookups keep missing
/// decodes at about the plain step's cost, and one whose lookups pay keeps drafting every step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Backoff {
    /// Decode steps left before the next lookup.
    wait: usize,
    /// The wait after the next wholly rejected draft, halved back to nothing by none.
    next: usize,
}

impl Backoff {
    /// Whether the request looks up a draft this step.
    pub fn ready(&self) -> bool {
        self.wait == 0
    }

    /// After a decode step: `draft` the length of the looked-up draft it verified (0: none),
    /// `accepted` how many of its tokens were kept.
    pub fn after_step(&mut self, draft: usize, accepted: usize) {
        if draft == 0 {
            self.wait = self.wait.saturating_sub(1);
        } else if accepted > 0 && 4 * accepted >= draft {
            *self = Self::default();
        } else {
            self.next = (self.next * 2).clamp(1, MAX_WAIT);
            self.wait = self.next;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_on_misses_and_ends_on_a_hit() {
        let mut backoff = Backoff::default();
        assert!(backoff.ready());
        // Misses (nothing kept, or under a quarter of the draft) wait 1, 2, 4, 8, 16, 16 steps.
        for (wait, accepted) in [(1, 0), (2, 2), (4, 0), (8, 1), (16, 0), (16, 2)] {
            backoff.after_step(10, accepted);
            for _ in 0..wait {
                assert!(!backoff.ready(), "waiting {wait}");
                backoff.after_step(0, 0);
            }
            assert!(backoff.ready(), "after {wait}");
        }
        // A hit (a quarter of the draft kept): ready at once, and the next miss waits one step.
        backoff.after_step(10, 3);
        assert!(backoff.ready());
        backoff.after_step(3, 0);
        backoff.after_step(0, 0);
        assert!(backoff.ready());
        backoff.after_step(3, 1);
        assert!(backoff.ready());
    }

    #[test]
    fn copies_what_followed_the_latest_match_of_the_longest_suffix() {
        // Suffix [2, 3] last occurred at 5..7, followed by 9 9 2 3.
        let context = [1, 2, 3, 4, 0, 2, 3, 9, 9, 2, 3];
        assert_eq!(ngram_draft(&context, 3, 3), vec![9, 9, 2]);
        assert_eq!(ngram_draft(&context, 3, 10), vec![9, 9, 2, 3]);
        // Only a 1-gram matches: [7] never occurred, [3, 7] neither.
        assert_eq!(ngram_draft(&[3, 5, 3, 7], 2, 2), Vec::<u32>::new());
        assert_eq!(ngram_draft(&[3, 5, 6, 3], 2, 2), vec![5, 6]);
        assert_eq!(ngram_draft(&[3, 5, 6, 3], 2, 0), Vec::<u32>::new());
        assert_eq!(ngram_draft(&[4], 3, 2), Vec::<u32>::new());
        assert_eq!(ngram_draft(&[], 3, 2), Vec::<u32>::new());
    }
}
