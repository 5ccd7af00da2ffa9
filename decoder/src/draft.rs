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

/// When a request drafts by lookup: after a draft wholly rejected it waits 1, 2, 4 .. [`MAX_WAIT`]
/// decode steps before it looks again, and an accepted draft token ends the wait. A verify step
/// costs more than a decode step, so a request whose lookups keep missing decodes at the plain
/// step's cost, and one whose lookups pay keeps drafting every step.
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

    /// After a decode step: `drafted` whether it verified a looked-up draft, `accepted` how many
    /// of its tokens were kept.
    pub fn after_step(&mut self, drafted: bool, accepted: usize) {
        if !drafted {
            self.wait = self.wait.saturating_sub(1);
        } else if accepted > 0 {
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
        // Misses wait 1, 2, 4, 8, 16, 16 steps.
        for wait in [1, 2, 4, 8, 16, 16] {
            backoff.after_step(true, 0);
            for _ in 0..wait {
                assert!(!backoff.ready(), "waiting {wait}");
                backoff.after_step(false, 0);
            }
            assert!(backoff.ready(), "after {wait}");
        }
        // A hit: ready at once, and the next miss waits one step again.
        backoff.after_step(true, 2);
        assert!(backoff.ready());
        backoff.after_step(true, 0);
        backoff.after_step(false, 0);
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
