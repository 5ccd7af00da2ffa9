//! Paged attention over slot lists, in f64: the oracle of the attention kernel.

use crate::error::Error;

/// Where one attention reads: `heads` query heads of `head_dim` per token, over K/V pools of
/// `pool_rows` rows of `kv_heads * head_dim` values; token `t` attends over the pools' rows at
/// `slots[starts[t] .. starts[t] + counts[t]]`.
#[derive(Debug, Clone, Copy)]
pub struct Heads {
    /// Query heads per token.
    pub heads: usize,
    /// K/V heads per pool row (`heads` is a multiple of it).
    pub kv_heads: usize,
    /// Values per head.
    pub head_dim: usize,
}

/// `out[t, h] = softmax_j(q[t, h] . K[s_j, h / groups] / sqrt(head_dim)) V[s_j, h / groups]` over
/// token `t`'s keys `s_j` (zeros for a token without keys). `q` is `[tokens, heads * head_dim]`,
/// the pools `[pool_rows, kv_heads * head_dim]`, all row-major. The first faulty token (in token
/// order) fails the call: a run outside `slots`, then a slot outside the pools.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    q: &[f64],
    k_pool: &[f64],
    v_pool: &[f64],
    heads: Heads,
    slots: &[i64],
    starts: &[i64],
    counts: &[i64],
    context: &str,
) -> Result<Vec<f64>, Error> {
    let Heads {
        heads,
        kv_heads,
        head_dim,
    } = heads;
    let (q_cols, kv_cols) = (heads * head_dim, kv_heads * head_dim);
    let pool_rows = k_pool.len().checked_div(kv_cols).unwrap_or(0);
    let runs = key_runs(slots, starts, counts, pool_rows, context)?;
    let groups = heads / kv_heads.max(1);
    let scale = 1.0 / (head_dim as f64).sqrt();
    let mut out = vec![0.0; q.len()];
    for (t, run) in runs.iter().enumerate() {
        for h in 0..heads {
            let query = &q[t * q_cols + h * head_dim..][..head_dim];
            let column = (h / groups) * head_dim;
            let scores: Vec<f64> = run
                .iter()
                .map(|&slot| {
                    let key = &k_pool[slot * kv_cols + column..][..head_dim];
                    query.iter().zip(key).map(|(a, b)| a * b).sum::<f64>() * scale
                })
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f64 = weights.iter().sum();
            let row = &mut out[t * q_cols + h * head_dim..][..head_dim];
            for (&slot, weight) in run.iter().zip(&weights) {
                let value = &v_pool[slot * kv_cols + column..][..head_dim];
                for (o, v) in row.iter_mut().zip(value) {
                    *o += weight / sum * v;
                }
            }
        }
    }
    Ok(out)
}

/// Each token's pool rows, or the first faulty token's error (in token order: a run outside
/// `slots`, then its first slot outside the pools' `pool_rows` rows).
pub fn key_runs(
    slots: &[i64],
    starts: &[i64],
    counts: &[i64],
    pool_rows: usize,
    context: &str,
) -> Result<Vec<Vec<usize>>, Error> {
    let mut runs = Vec::with_capacity(starts.len());
    for (token, (&start, &count)) in starts.iter().zip(counts).enumerate() {
        let run = usize::try_from(start)
            .ok()
            .zip(usize::try_from(count).ok())
            .and_then(|(start, count)| slots.get(start..start.checked_add(count)?));
        let Some(run) = run else {
            return Err(Error::KeyRunOutOfRange {
                context: context.into(),
                token,
                start,
                count,
                slots: slots.len(),
            });
        };
        let mut rows = Vec::with_capacity(run.len());
        for (key, &slot) in run.iter().enumerate() {
            match usize::try_from(slot) {
                Ok(row) if row < pool_rows => rows.push(row),
                _ => {
                    return Err(Error::KeySlotOutOfRange {
                        context: context.into(),
                        token,
                        key,
                        slot,
                        pool_rows,
                    });
                }
            }
        }
        runs.push(rows);
    }
    Ok(runs)
}
