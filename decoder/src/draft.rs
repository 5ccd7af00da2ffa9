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

#[cfg(test)]
mod tests {
    use super::*;

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
