//! The Llama forward (RMSNorm, RoPE, grouped-query attention, SwiGLU) in Burn 0.22, over a paged KV
//! cache: each layer stores its new K/V rows at the step's slots and attends to the K/V rows that
//! the step's slot list names.

use std::ops::Range;

use burn_core::tensor::activation::{silu, softmax};
use burn_core::tensor::{Bool, DType, Device, Int, Tensor, TensorData};

use crate::gguf::Gguf;
use crate::kv::KvCache;
use crate::{DecoderError, Result};

/// The shape of a Llama, read from a GGUF's `llama.*` metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// Transformer blocks.
    pub layers: usize,
    /// Model width.
    pub hidden: usize,
    /// SwiGLU inner width.
    pub ffn: usize,
    /// Query heads.
    pub heads: usize,
    /// K/V heads (grouped-query attention: `heads / kv_heads` query heads share one).
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// RoPE frequency base.
    pub rope_base: f64,
    /// RMSNorm epsilon.
    pub rms_eps: f64,
    /// Vocabulary size (rows of the embedding).
    pub vocab: usize,
    /// Longest context the model was trained for.
    pub context_length: usize,
}

impl LlamaConfig {
    /// The config of a GGUF whose `general.architecture` is `llama`.
    pub fn from_gguf(gguf: &Gguf) -> Result<Self> {
        let arch = gguf.str("general.architecture")?;
        if arch != "llama" {
            return Err(DecoderError::Model(format!(
                "general.architecture is {arch:?}, only \"llama\" is supported"
            )));
        }
        let get = |key: &str| -> Result<usize> { Ok(gguf.u32(&format!("llama.{key}"))? as usize) };
        let hidden = get("embedding_length")?;
        let heads = get("attention.head_count")?;
        let kv_heads = get("attention.head_count_kv")?;
        if heads == 0 || kv_heads == 0 || hidden % heads != 0 || heads % kv_heads != 0 {
            return Err(DecoderError::Model(format!(
                "heads {heads} / kv heads {kv_heads} do not divide hidden {hidden}"
            )));
        }
        let vocab = gguf.tensor_info("token_embd.weight")?.shape[0];
        Ok(Self {
            layers: get("block_count")?,
            hidden,
            ffn: get("feed_forward_length")?,
            heads,
            kv_heads,
            head_dim: hidden / heads,
            rope_base: gguf.f32("llama.rope.freq_base")? as f64,
            rms_eps: gguf.f32("llama.attention.layer_norm_rms_epsilon")? as f64,
            vocab,
            context_length: get("context_length")?,
        })
    }

    /// Width of one token's K (or V) row in the pools: `kv_heads * head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

/// One transformer block's weights; matrices are stored `[in, out]` so that `x.matmul(w)` applies them.
struct Block {
    attn_norm: Tensor<1>,
    /// Q, K and V projections side by side: one matmul per layer instead of three.
    wqkv: Tensor<2>,
    wo: Tensor<2>,
    ffn_norm: Tensor<1>,
    /// Gate and up projections side by side.
    w_gate_up: Tensor<2>,
    w_down: Tensor<2>,
}

/// A Llama's weights on one device, ready to run steps over a [`KvCache`].
pub struct Llama {
    config: LlamaConfig,
    dtype: DType,
    device: Device,
    embed: Tensor<2>,
    blocks: Vec<Block>,
    final_norm: Tensor<1>,
    /// The LM head, `[hidden, vocab]` (the tied embedding, transposed once).
    lm_head: Tensor<2>,
    /// RoPE angles per position and pair: `[context_length, head_dim / 2]`.
    rope_cos: Tensor<2>,
    rope_sin: Tensor<2>,
}

/// Where one step's tokens attend: the padded `[rows, max_q]` query layout over the packed tokens,
/// the padded `[rows, max_kv]` slot list each row reads its K/V from, and the mask.
pub struct Attention {
    /// Rows of the (padded) batch.
    pub rows: usize,
    /// Longest query run of a row.
    pub max_q: usize,
    /// Longest K/V run of a row.
    pub max_kv: usize,
    /// `[rows * max_q]`: the packed token each padded query cell reads (any valid token for padding).
    pub q_pad: Tensor<1, Int>,
    /// `[tokens]`: the padded query cell each packed token's output comes from.
    pub q_unpad: Tensor<1, Int>,
    /// `[rows * max_kv]`: the KV slot of each padded key cell.
    pub kv_slots: Tensor<1, Int>,
    /// `[rows, 1, max_q, max_kv]`: true where a query must not see a key (causal and padding).
    pub masked: Tensor<4, Bool>,
}

/// One forward's inputs: packed tokens (`[tokens]` each) and their attention layout.
pub struct StepInput {
    /// Token ids.
    pub input_ids: Tensor<1, Int>,
    /// Positions in their sequences (RoPE).
    pub positions: Tensor<1, Int>,
    /// The KV slot each token's K/V row is stored at.
    pub out_cache_loc: Tensor<1, Int>,
    /// Where the tokens attend.
    pub attention: Attention,
}

impl Llama {
    /// Loads and dequantizes every weight of `gguf` onto `device`, as `dtype` (F32, or F64 for
    /// reduction-order-proof tests).
    pub fn load(gguf: &Gguf, device: &Device, dtype: DType) -> Result<Self> {
        let config = LlamaConfig::from_gguf(gguf)?;
        let weight = |name: &str, shape: &[usize]| -> Result<Vec<f32>> {
            let tensor = gguf.tensor(name)?;
            if tensor.shape != shape {
                return Err(DecoderError::Model(format!(
                    "tensor {name} has shape {:?}, expected {shape:?}",
                    tensor.shape
                )));
            }
            Ok(tensor.data)
        };
        let upload = |data: Vec<f32>, shape: [usize; 2]| -> Tensor<2> {
            Tensor::from_data(TensorData::new(data, shape), (device, dtype))
        };
        let vector = |name: &str, len: usize| -> Result<Tensor<1>> {
            Ok(upload(weight(name, &[len])?, [1, len]).reshape([len]))
        };
        // GGUF stores torch `[out, in]` matrices; `x.matmul(w)` wants `[in, out]`, and matrices
        // that read the same input go side by side (one matmul instead of two or three).
        let matrices = |names: &[(String, usize)], inner: usize| -> Result<Tensor<2>> {
            let mut parts = Vec::with_capacity(names.len());
            for (name, out) in names {
                parts.push((weight(name, &[*out, inner])?, *out));
            }
            let width: usize = parts.iter().map(|(_, out)| out).sum();
            Ok(upload(
                side_by_side_transposed(&parts, inner),
                [inner, width],
            ))
        };
        let (hidden, ffn, kv_dim) = (config.hidden, config.ffn, config.kv_dim());
        let mut blocks = Vec::with_capacity(config.layers);
        for layer in 0..config.layers {
            let name = |part: &str| format!("blk.{layer}.{part}.weight");
            blocks.push(Block {
                attn_norm: vector(&name("attn_norm"), hidden)?,
                wqkv: matrices(
                    &[
                        (name("attn_q"), hidden),
                        (name("attn_k"), kv_dim),
                        (name("attn_v"), kv_dim),
                    ],
                    hidden,
                )?,
                wo: matrices(&[(name("attn_output"), hidden)], hidden)?,
                ffn_norm: vector(&name("ffn_norm"), hidden)?,
                w_gate_up: matrices(&[(name("ffn_gate"), ffn), (name("ffn_up"), ffn)], hidden)?,
                w_down: matrices(&[(name("ffn_down"), hidden)], ffn)?,
            });
        }
        let embed = weight("token_embd.weight", &[config.vocab, hidden])?;
        let lm_head = if gguf.tensor_info("output.weight").is_ok() {
            matrices(&[("output.weight".to_string(), config.vocab)], hidden)?
        } else {
            upload(
                side_by_side_transposed(&[(embed.clone(), config.vocab)], hidden),
                [hidden, config.vocab],
            )
        };
        let (rope_cos, rope_sin) = rope_tables(&config, device, dtype);
        Ok(Self {
            final_norm: vector("output_norm.weight", hidden)?,
            embed: upload(embed, [config.vocab, hidden]),
            blocks,
            lm_head,
            rope_cos,
            rope_sin,
            dtype,
            device: device.clone(),
            config,
        })
    }

    /// The model's shape.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The float dtype of weights and activations.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Runs blocks `layers` over the step's tokens, storing every block's new K/V rows in `cache`
    /// at `out_cache_loc` first, and returns the hidden states `[tokens, hidden]` after the last
    /// block run. (`0..config.layers` is the target; a prefix of it is the self-speculative draft.)
    pub fn forward(
        &self,
        cache: &mut KvCache,
        input: &StepInput,
        layers: Range<usize>,
    ) -> Result<Tensor<2>> {
        let c = &self.config;
        let tokens = input.input_ids.dims()[0];
        let mut x = self.embed.clone().select(0, input.input_ids.clone());
        let half = c.head_dim / 2;
        let cos = self.rope_cos.clone().select(0, input.positions.clone());
        let sin = self.rope_sin.clone().select(0, input.positions.clone());
        let cos = cos.reshape([tokens, 1, half, 1]);
        let sin = sin.reshape([tokens, 1, half, 1]);
        for layer in layers {
            let block = &self.blocks[layer];
            let h = rms_norm(x.clone(), &block.attn_norm, c.rms_eps);
            let qkv = h.matmul(block.wqkv.clone());
            let q = qkv.clone().narrow(1, 0, c.hidden);
            let k = qkv.clone().narrow(1, c.hidden, c.kv_dim());
            let v = qkv.narrow(1, c.hidden + c.kv_dim(), c.kv_dim());
            let q = rope(q.reshape([tokens, c.heads, half, 2]), &cos, &sin);
            let k = rope(k.reshape([tokens, c.kv_heads, half, 2]), &cos, &sin);
            let k = k.reshape([tokens, c.kv_dim()]);
            cache.store(layer, input.out_cache_loc.clone(), k, v)?;
            let attended = self.attend(cache, layer, q, &input.attention);
            x = x + attended.matmul(block.wo.clone());
            let h = rms_norm(x.clone(), &block.ffn_norm, c.rms_eps);
            let gate_up = h.matmul(block.w_gate_up.clone());
            let gate = gate_up.clone().narrow(1, 0, c.ffn);
            let up = gate_up.narrow(1, c.ffn, c.ffn);
            x = x + (silu(gate) * up).matmul(block.w_down.clone());
        }
        Ok(x)
    }

    /// Logits `[n, vocab]` of the hidden states `[n, hidden]`: final norm, then the LM head.
    pub fn logits(&self, hidden: Tensor<2>) -> Tensor<2> {
        rms_norm(hidden, &self.final_norm, self.config.rms_eps).matmul(self.lm_head.clone())
    }

    /// Grouped-query attention of the packed queries `q` (`[tokens, heads, head_dim / 2, 2]`)
    /// over the K/V rows `attention.kv_slots` names; `[tokens, hidden]` out.
    fn attend(
        &self,
        cache: &KvCache,
        layer: usize,
        q: Tensor<4>,
        attention: &Attention,
    ) -> Tensor<2> {
        let c = &self.config;
        let (rows, max_q, max_kv) = (attention.rows, attention.max_q, attention.max_kv);
        let groups = c.heads / c.kv_heads;
        let hd = c.head_dim;
        let tokens = q.dims()[0];
        // [rows * max_q, hidden] -> [rows, kv_heads, groups * max_q, hd]: query heads that share a
        // K/V head go side by side, so K and V are never repeated.
        let q = q
            .reshape([tokens, c.hidden])
            .select(0, attention.q_pad.clone());
        let q = q
            .reshape([rows, max_q, c.kv_heads, groups, hd])
            .permute([0, 2, 3, 1, 4])
            .reshape([rows, c.kv_heads, groups * max_q, hd]);
        let (k, v) = cache.read(layer, attention.kv_slots.clone());
        let k = k
            .reshape([rows, max_kv, c.kv_heads, hd])
            .permute([0, 2, 3, 1]); // [rows, kv_heads, hd, max_kv]
        let v = v.reshape([rows, max_kv, c.kv_heads, hd]).swap_dims(1, 2);
        let scale = 1.0 / (hd as f64).sqrt();
        let scores = q.matmul(k).mul_scalar(scale); // [rows, kv_heads, groups * max_q, max_kv]
        let scores = scores.reshape([rows, c.kv_heads * groups, max_q, max_kv]);
        let scores = scores.mask_fill(
            attention
                .masked
                .clone()
                .expand([rows, c.heads, max_q, max_kv]),
            f64::NEG_INFINITY,
        );
        let probs = softmax(scores, 3).reshape([rows, c.kv_heads, groups * max_q, max_kv]);
        let out = probs.matmul(v); // [rows, kv_heads, groups * max_q, hd]
        let out = out
            .reshape([rows, c.kv_heads, groups, max_q, hd])
            .permute([0, 3, 1, 2, 4])
            .reshape([rows * max_q, c.hidden]);
        out.select(0, attention.q_unpad.clone())
    }
}

/// `x * w / rms(x)` over the last dim.
fn rms_norm(x: Tensor<2>, weight: &Tensor<1>, eps: f64) -> Tensor<2> {
    let rms = x.clone().powi_scalar(2).mean_dim(1).add_scalar(eps).sqrt();
    (x / rms) * weight.clone().unsqueeze_dim::<2>(0)
}

/// RoPE on adjacent pairs (llama.cpp's converter permutes Q/K rows for this layout):
/// `x` is `[tokens, heads, head_dim / 2, 2]`, `cos`/`sin` `[tokens, 1, head_dim / 2, 1]`.
fn rope(x: Tensor<4>, cos: &Tensor<4>, sin: &Tensor<4>) -> Tensor<4> {
    let [tokens, heads, half, _] = x.dims();
    let even = x.clone().narrow(3, 0, 1);
    let odd = x.narrow(3, 1, 1);
    let rotated_even = even.clone() * cos.clone() - odd.clone() * sin.clone();
    let rotated_odd = even * sin.clone() + odd * cos.clone();
    Tensor::cat(vec![rotated_even, rotated_odd], 3).reshape([tokens, heads, half, 2])
}

/// `cos` and `sin` of `position * base^(-2i / head_dim)`, computed in f64 on the host.
fn rope_tables(config: &LlamaConfig, device: &Device, dtype: DType) -> (Tensor<2>, Tensor<2>) {
    let half = config.head_dim / 2;
    let positions = config.context_length;
    let mut cos = Vec::with_capacity(positions * half);
    let mut sin = Vec::with_capacity(positions * half);
    for position in 0..positions {
        for i in 0..half {
            let inv_freq = config
                .rope_base
                .powf(-2.0 * i as f64 / config.head_dim as f64);
            let angle = position as f64 * inv_freq;
            cos.push(angle.cos());
            sin.push(angle.sin());
        }
    }
    let table = |values: Vec<f64>| {
        Tensor::from_data(TensorData::new(values, [positions, half]), (device, dtype))
    };
    (table(cos), table(sin))
}

/// Row-major `[inner, sum of outs]`: each `[out, inner]` part transposed, the parts side by side.
fn side_by_side_transposed(parts: &[(Vec<f32>, usize)], inner: usize) -> Vec<f32> {
    let width: usize = parts.iter().map(|(_, out)| out).sum();
    let mut data = vec![0.0; inner * width];
    let mut column = 0;
    for (part, out) in parts {
        for o in 0..*out {
            for i in 0..inner {
                data[i * width + column + o] = part[o * inner + i];
            }
        }
        column += out;
    }
    data
}
