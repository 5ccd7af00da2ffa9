//! A `PagedKv` step's attention on Flex: Burn ops over the K/V rows gathered into a padded
//! `[rows, max_kv]` layout. There the paged attention op is the host reference, which reads
//! both pools back every layer; Burn's own CPU kernels over the gathered rows are faster.

use burn_core::tensor::activation::softmax;
use burn_core::tensor::{Bool, DType, Device, FloatDType, Int, Tensor, TensorData};

/// The padded layout of a step: `[rows, max_q]` queries over the packed tokens, `[rows, max_kv]`
/// keys over the packed contexts, the causal and padding mask.
#[derive(Debug, Clone)]
pub(crate) struct Padded {
    rows: usize,
    max_q: usize,
    max_kv: usize,
    /// `[rows * max_q]`: the packed token each padded query cell reads (any token for padding).
    q_pad: Tensor<1, Int>,
    /// `[tokens]`: the padded query cell each packed token's output comes from.
    q_unpad: Tensor<1, Int>,
    /// `[rows * max_kv]`: the KV slot of each padded key cell.
    kv_slots: Tensor<1, Int>,
    /// `[rows, 1, max_q, max_kv]`: true where a query must not see a key.
    masked: Tensor<4, Bool>,
}

/// The shape of the attention's heads.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Heads {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl Padded {
    /// The layout of windows `(start, len)` (in step order) over their packed context slots
    /// `context` (each row's `0..start + len`, rows in step order).
    pub(crate) fn new(
        windows: &[(usize, usize)],
        context: Tensor<1, Int>,
        device: &Device,
    ) -> Self {
        let rows = windows.len();
        let max_q = windows.iter().map(|w| w.1).max().unwrap_or(1);
        let max_kv = windows.iter().map(|w| w.0 + w.1).max().unwrap_or(1);
        let tokens: usize = windows.iter().map(|w| w.1).sum();
        let mut q_pad = Vec::with_capacity(rows * max_q);
        let mut q_unpad = Vec::with_capacity(tokens);
        let mut kv_pad = Vec::with_capacity(rows * max_kv);
        let mut masked = Vec::with_capacity(rows * max_q * max_kv);
        let (mut token_offset, mut kv_offset) = (0, 0);
        for (i, &(start, len)) in windows.iter().enumerate() {
            let kv_len = start + len;
            for j in 0..max_q {
                let q = j.min(len - 1);
                q_pad.push((token_offset + q) as i64);
                if j < len {
                    q_unpad.push((i * max_q + j) as i64);
                }
                masked.extend((0..max_kv).map(|key| key > start + q));
            }
            kv_pad.extend((0..max_kv).map(|key| (kv_offset + key.min(kv_len - 1)) as i64));
            token_offset += len;
            kv_offset += kv_len;
        }
        let ints = |values: Vec<i64>| {
            let n = values.len();
            Tensor::<1, Int>::from_data(TensorData::new(values, [n]), (device, DType::I64))
        };
        Self {
            rows,
            max_q,
            max_kv,
            q_pad: ints(q_pad),
            q_unpad: ints(q_unpad),
            kv_slots: context.select(0, ints(kv_pad)),
            masked: Tensor::from_data(TensorData::new(masked, [rows, 1, max_q, max_kv]), device),
        }
    }

    /// Grouped-query attention of the packed queries `q` (`[tokens, heads * head_dim]`) over the
    /// joined pool's rows the layout names; `[tokens, heads * head_dim]` out.
    pub(crate) fn attend(&self, q: Tensor<2>, pool: Tensor<2>, shape: Heads) -> Tensor<2> {
        let Heads {
            heads,
            kv_heads,
            head_dim: hd,
        } = shape;
        let (rows, max_q, max_kv) = (self.rows, self.max_q, self.max_kv);
        let groups = heads / kv_heads;
        let dtype = q.dtype();
        // [rows * max_q, heads * hd] -> [rows, kv_heads, groups * max_q, hd]: query heads that
        // share a K/V head go side by side, so K and V are never repeated.
        let q = widened(q)
            .select(0, self.q_pad.clone())
            .reshape([rows, max_q, kv_heads, groups, hd])
            .permute([0, 2, 3, 1, 4])
            .reshape([rows, kv_heads, groups * max_q, hd]);
        let kv = widened(pool.select(0, self.kv_slots.clone()));
        let k = kv.clone().narrow(1, 0, kv_heads * hd);
        let v = kv.narrow(1, kv_heads * hd, kv_heads * hd);
        let k = k
            .reshape([rows, max_kv, kv_heads, hd])
            .permute([0, 2, 3, 1]);
        let v = v.reshape([rows, max_kv, kv_heads, hd]).swap_dims(1, 2);
        let scale = 1.0 / (hd as f64).sqrt();
        let scores = q.matmul(k).mul_scalar(scale); // [rows, kv_heads, groups * max_q, max_kv]
        let scores = scores.reshape([rows, heads, max_q, max_kv]).mask_fill(
            self.masked.clone().expand([rows, heads, max_q, max_kv]),
            f64::NEG_INFINITY,
        );
        let probs = softmax(scores, 3).reshape([rows, kv_heads, groups * max_q, max_kv]);
        probs
            .matmul(v)
            .reshape([rows, kv_heads, groups, max_q, hd])
            .permute([0, 3, 1, 2, 4])
            .reshape([rows * max_q, heads * hd])
            .select(0, self.q_unpad.clone())
            .cast(dtype)
    }
}

/// Half precision as f32: the attention sums in f32 and rounds its output once, as the kernels.
fn widened(x: Tensor<2>) -> Tensor<2> {
    match x.dtype() {
        DType::F16 | DType::BF16 => x.cast(FloatDType::F32),
        _ => x,
    }
}
