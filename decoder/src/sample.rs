//! Choosing tokens: greedy, or seeded sampling with speculative rejection sampling (Leviathan et
//! al. / Chen et al.), which keeps the emitted tokens distributed exactly as the target's.

use burn_core::tensor::Tensor;
use burn_core::tensor::activation::softmax;

use crate::linear::widened;

/// Greedy decoding (temperature 0) or sampling at `temperature` from a seeded generator.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// 0 means greedy.
    pub temperature: f64,
    /// Seed of the generator (sampling only).
    pub seed: u64,
}

impl Sampling {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            seed: 0,
        }
    }

    /// True for temperature 0.
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    /// `softmax(logits / temperature)` over the last dim.
    pub fn probs(&self, logits: Tensor<2>) -> Tensor<2> {
        // Half-precision logits in f32: probabilities need more than bf16's 8 bits.
        softmax(widened(logits).div_scalar(self.temperature), 1)
    }
}

/// One splitmix64 step: advances `state` and returns the next 64 random bits (the project's one
/// copy; the tools' generators call it too).
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A splitmix64 generator: small, seedable, and the same stream on every platform.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        splitmix64(&mut self.0)
    }

    /// Uniform in `[0, 1)` with 53 bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// An index drawn from the (not necessarily normalized) weights `weights`.
    pub fn sample(&mut self, weights: &[f32]) -> usize {
        let total: f64 = weights.iter().map(|&w| w.max(0.0) as f64).sum();
        let mut left = self.uniform() * total;
        for (i, &w) in weights.iter().enumerate() {
            left -= w.max(0.0) as f64;
            if left < 0.0 {
                return i;
            }
        }
        // Rounding left a sliver: the last index with weight.
        weights.iter().rposition(|&w| w > 0.0).unwrap_or(0)
    }
}

/// Greedy acceptance: the drafts that equal the target's choices, then the target's next token.
/// `targets[j]` is the target's token after draft position `j` (`draft.len() + 1` of them).
pub fn accept_greedy(draft: &[u32], targets: &[u32]) -> Vec<u32> {
    let accepted = draft
        .iter()
        .zip(targets)
        .take_while(|(d, t)| d == t)
        .count();
    targets[..=accepted].to_vec()
}

/// Rejection sampling: draft token `x` at position `j` is kept with probability
/// `min(1, p_j(x) / q_j(x))`; the first rejection samples from `max(0, p_j - q_j)` normalized, and
/// if every draft is kept one more token comes from `p_k`. `draft_probs = None` is a deterministic
/// draft (`q_j` a point mass, as n-gram drafts are).
pub fn accept_sampled(
    draft: &[u32],
    draft_probs: Option<&[Vec<f32>]>,
    target_probs: &[Vec<f32>],
    rng: &mut Rng,
) -> Vec<u32> {
    let mut emitted = Vec::with_capacity(draft.len() + 1);
    for (j, &x) in draft.iter().enumerate() {
        let p = &target_probs[j];
        let q_x = draft_probs.map_or(1.0, |q| q[j][x as usize]);
        let p_x = p[x as usize];
        if (rng.uniform() as f32) * q_x < p_x {
            emitted.push(x);
            continue;
        }
        let residual: Vec<f32> = match draft_probs {
            Some(q) => p.iter().zip(&q[j]).map(|(p, q)| (p - q).max(0.0)).collect(),
            None => p
                .iter()
                .enumerate()
                .map(|(i, &p)| if i == x as usize { 0.0 } else { p })
                .collect(),
        };
        emitted.push(rng.sample(&residual) as u32);
        return emitted;
    }
    emitted.push(rng.sample(&target_probs[draft.len()]) as u32);
    emitted
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_keeps_the_matching_prefix_and_adds_the_target_token() {
        assert_eq!(accept_greedy(&[5, 6, 7], &[5, 6, 8, 9]), vec![5, 6, 8]);
        assert_eq!(accept_greedy(&[5, 6], &[5, 6, 1]), vec![5, 6, 1]);
        assert_eq!(accept_greedy(&[4], &[5, 1]), vec![5]);
        assert_eq!(accept_greedy(&[], &[3]), vec![3]);
    }

    /// Chi-square statistic of `counts` against probabilities `p` (all cells with p > 0).
    fn chi_square(counts: &[usize], p: &[f32]) -> f64 {
        let n: usize = counts.iter().sum();
        counts
            .iter()
            .zip(p)
            .filter(|(_, p)| **p > 0.0)
            .map(|(&c, &p)| {
                let expected = n as f64 * p as f64;
                (c as f64 - expected).powi(2) / expected
            })
            .sum()
    }

    #[test]
    fn rejection_sampling_emits_the_target_distribution() {
        // 5 tokens; the draft's distribution differs from the target's.
        let p = vec![0.1f32, 0.4, 0.2, 0.25, 0.05];
        let q = vec![0.3f32, 0.1, 0.4, 0.1, 0.1];
        let mut rng = Rng::new(7);
        let trials = 200_000;
        let (mut sampled_draft, mut point_draft) = (vec![0usize; 5], vec![0usize; 5]);
        for _ in 0..trials {
            let x = rng.sample(&q) as u32;
            let first =
                accept_sampled(&[x], Some(&[q.clone()]), &[p.clone(), p.clone()], &mut rng)[0];
            sampled_draft[first as usize] += 1;
            // A deterministic draft of token 2 (an n-gram draft).
            let first = accept_sampled(&[2], None, &[p.clone(), p.clone()], &mut rng)[0];
            point_draft[first as usize] += 1;
        }
        // 4 degrees of freedom: the 99.9% quantile is 18.47.
        assert!(chi_square(&sampled_draft, &p) < 18.47, "{sampled_draft:?}");
        assert!(chi_square(&point_draft, &p) < 18.47, "{point_draft:?}");
    }
}
