//! The Llama forward (RMSNorm, RoPE, grouped-query attention, SwiGLU) in Burn 0.22, over a paged KV
//! cache: each layer hands its fused projection (queries, keys, values after RoPE) to the
//! caller's attention (`kvplan::PagedKv::attend`), which stores the K/V rows and attends.

use std::ops::Range;

use burn_core::tensor::{DType, Device, Int, Tensor, TensorData};

use crate::gguf::Gguf;
use crate::linear::{Rope, RopeShape, Weight, linear, linear_rope, linear_swiglu};
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
        if (hidden / heads) % 2 != 0 {
            return Err(DecoderError::Model(format!(
                "head dim {} is odd: RoPE turns pairs of columns",
                hidden / heads
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

/// One transformer block's weights, each matrix its `[out, in]` rows (GGUF's layout, the one the
/// projection kernel reads: each output a dot product over contiguous weights), and each
/// RMSNorm's weight folded into the matrices that read its output.
struct Block {
    /// Q, K and V projections stacked (RoPE turns the Q and K columns in the same launch).
    wqkv: Weight,
    wo: Weight,
    /// Gate and up projections stacked.
    w_gate_up: Weight,
    w_down: Weight,
}

/// A Llama's weights on one device, ready to run steps over a paged KV cache.
pub struct Llama {
    config: LlamaConfig,
    dtype: DType,
    device: Device,
    embed: Tensor<2>,
    blocks: Vec<Block>,
    /// The LM head's `[vocab, hidden]` rows (the tied embedding), the final norm's weight folded
    /// in.
    lm_head: Weight,
    /// RoPE's `cos` and `sin` of each position's angle for each pair: `[context_length,
    /// head_dim / 2]`.
    rope_cos: Tensor<2>,
    rope_sin: Tensor<2>,
}

/// Whether `device` computes `exp(1)` in f64 to f64 precision (one read-back).
pub fn exp_is_64_bit(device: &Device) -> bool {
    // Uploaded, not `ones`: Fusion folds a constant's exp on the host.
    let one = Tensor::<1>::from_data(TensorData::new(vec![1.0f64], [1]), (device, DType::F64));
    let e = one.exp().into_data().convert::<f64>().try_to_vec::<f64>();
    matches!(e.as_deref(), Ok([e]) if (e - std::f64::consts::E).abs() < 1e-15)
}

impl Llama {
    /// Loads and dequantizes every weight of `gguf` onto `device`, as `dtype` (F32; F64 for
    /// reduction-order-proof tests; BF16 or F16 for half the bytes, summed in f32 by the
    /// projections and the attention). A device without `dtype` is refused, and so is one whose
    /// f64 `exp` is not 64-bit (SPIR-V's is 32-bit only) for F64.
    pub fn load(gguf: &Gguf, device: &Device, dtype: DType) -> Result<Self> {
        let config = LlamaConfig::from_gguf(gguf)?;
        if !dtype.is_float() || !device.supports_dtype(dtype) {
            return Err(DecoderError::Model(format!(
                "this device has no {dtype:?} float tensors: load as f32"
            )));
        }
        if dtype == DType::F64 && !exp_is_64_bit(device) {
            return Err(DecoderError::Model(
                "this device computes f64 exp in 32 bits (Vulkan's SPIR-V does): load as f32"
                    .into(),
            ));
        }
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
        // GGUF stores torch `[out, in]` matrices, kept so. Matrices that read the same input are
        // stacked (one projection instead of two or three).
        let read = |names: &[(String, usize)], inner: usize| -> Result<Vec<(Vec<f32>, usize)>> {
            names
                .iter()
                .map(|(name, out)| Ok((weight(name, &[*out, inner])?, *out)))
                .collect()
        };
        let side_by_side = |parts: &[(Vec<f32>, usize)], inner: usize| -> Weight {
            let width: usize = parts.iter().map(|(_, out)| out).sum();
            let rows = parts.iter().flat_map(|(rows, _)| rows).copied().collect();
            Weight::new(upload(rows, [width, inner]))
        };
        // Row `i` of each part in turn (gate row `i`, then up row `i`): each SwiGLU pair's
        // columns adjacent (`linear_swiglu`).
        let interleaved = |parts: &[(Vec<f32>, usize)], inner: usize| -> Weight {
            let parts: Vec<Vec<&[f32]>> = parts
                .iter()
                .map(|(rows, _)| rows.chunks(inner).collect())
                .collect();
            let count = parts.iter().map(Vec::len).min().unwrap_or(0);
            let rows = (0..count)
                .flat_map(|i| parts.iter().flat_map(move |part| part[i]))
                .copied()
                .collect();
            Weight::new(upload(rows, [count * parts.len(), inner]))
        };
        let matrices = |names: &[(String, usize)], inner: usize| -> Result<Weight> {
            Ok(side_by_side(&read(names, inner)?, inner))
        };
        let (hidden, ffn, kv_dim) = (config.hidden, config.ffn, config.kv_dim());
        // `(x / rms(x) * w) W = (x / rms(x)) (w W)`: a norm's weight scales the matrices' inputs.
        let read_normed =
            |names: &[(String, usize)], norm: &str| -> Result<Vec<(Vec<f32>, usize)>> {
                let scale = weight(norm, &[hidden])?;
                let mut parts = read(names, hidden)?;
                for (rows, _) in &mut parts {
                    scale_inputs(rows, &scale);
                }
                Ok(parts)
            };
        let mut blocks = Vec::with_capacity(config.layers);
        for layer in 0..config.layers {
            let name = |part: &str| format!("blk.{layer}.{part}.weight");
            blocks.push(Block {
                // Q and K rows as llama.cpp's converter permutes them: each RoPE pair adjacent.
                wqkv: side_by_side(
                    &read_normed(
                        &[
                            (name("attn_q"), hidden),
                            (name("attn_k"), kv_dim),
                            (name("attn_v"), kv_dim),
                        ],
                        &name("attn_norm"),
                    )?,
                    hidden,
                ),
                wo: matrices(&[(name("attn_output"), hidden)], hidden)?,
                w_gate_up: interleaved(
                    &read_normed(
                        &[(name("ffn_gate"), ffn), (name("ffn_up"), ffn)],
                        &name("ffn_norm"),
                    )?,
                    hidden,
                ),
                w_down: matrices(&[(name("ffn_down"), hidden)], ffn)?,
            });
        }
        let embed = weight("token_embd.weight", &[config.vocab, hidden])?;
        let final_norm = "output_norm.weight";
        let lm_head = if gguf.tensor_info("output.weight").is_ok() {
            read_normed(&[("output.weight".to_string(), config.vocab)], final_norm)?
        } else {
            let mut tied = embed.clone();
            scale_inputs(&mut tied, &weight(final_norm, &[hidden])?);
            vec![(tied, config.vocab)]
        };
        let lm_head = side_by_side(&lm_head, hidden);
        let (rope_cos, rope_sin) = rope_tables(&config, device, dtype);
        Ok(Self {
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

    /// Runs blocks `layers` over a step's tokens (`input_ids` at `positions`, `[tokens]` each)
    /// and returns the hidden states `[tokens, hidden]` after the last block run.
    /// `attend(layer, qkv)` takes each block's queries, keys and values side by side
    /// (`[tokens, (heads + 2 * kv_heads) * head_dim]`, after RoPE), stores the keys and values
    /// and returns the attention's output `[tokens, hidden]`. (`0..config.layers` is the target;
    /// a prefix of it is the self-speculative draft.)
    pub fn forward(
        &self,
        input_ids: Tensor<1, Int>,
        positions: Tensor<1, Int>,
        layers: Range<usize>,
        mut attend: impl FnMut(usize, Tensor<2>) -> Result<Tensor<2>>,
    ) -> Result<Tensor<2>> {
        let c = &self.config;
        let mut x = self.embed.clone().select(0, input_ids);
        // The step's angles, gathered once for every layer.
        let angles = |table: &Tensor<2>| table.clone().select(0, positions.clone());
        let rope = Rope {
            cos: angles(&self.rope_cos),
            sin: angles(&self.rope_sin),
            shape: RopeShape {
                rotated: (c.heads + c.kv_heads) * c.head_dim,
                head_dim: c.head_dim,
            },
        };
        for layer in layers {
            let block = &self.blocks[layer];
            let qkv = linear_rope(x.clone(), &block.wqkv, &rope, Some(c.rms_eps));
            // Queries, keys and values go in as the one tensor they are: no slices.
            let attended = attend(layer, qkv)?;
            x = linear(attended, &block.wo, Some(x), None);
            let gated = linear_swiglu(x.clone(), &block.w_gate_up, Some(c.rms_eps));
            x = linear(gated, &block.w_down, Some(x), None);
        }
        Ok(x)
    }

    /// Logits `[n, vocab]` of the hidden states `[n, hidden]`: final norm, then the LM head.
    pub fn logits(&self, hidden: Tensor<2>) -> Tensor<2> {
        linear(hidden, &self.lm_head, None, Some(self.config.rms_eps))
    }
}

/// `[out, inner]` rows with each input column `i` scaled by `scale[i]`.
fn scale_inputs(rows: &mut [f32], scale: &[f32]) {
    for row in rows.chunks_exact_mut(scale.len()) {
        for (value, s) in row.iter_mut().zip(scale) {
            *value *= s;
        }
    }
}

/// RoPE's `cos` and `sin` of `position * base^(-2i / head_dim)` for each position and pair `i`,
/// computed in f64 on the host: `[context_length, head_dim / 2]` each.
fn rope_tables(config: &LlamaConfig, device: &Device, dtype: DType) -> (Tensor<2>, Tensor<2>) {
    let pairs = config.head_dim / 2;
    let positions = config.context_length;
    let mut cos = Vec::with_capacity(positions * pairs);
    let mut sin = Vec::with_capacity(positions * pairs);
    for position in 0..positions {
        for i in 0..pairs {
            let inv_freq = config
                .rope_base
                .powf(-2.0 * i as f64 / config.head_dim as f64);
            let angle = position as f64 * inv_freq;
            cos.push(angle.cos());
            sin.push(angle.sin());
        }
    }
    let table = |values: Vec<f64>| {
        Tensor::from_data(TensorData::new(values, [positions, pairs]), (device, dtype))
    };
    (table(cos), table(sin))
}
