//! A tiny random-weight Llama in a GGUF file laid out like SmolLM2-135M-Instruct's: the same
//! metadata keys, tensor names and storage types, a byte-level BPE vocabulary (SmolLM2's special
//! tokens, the 256 byte tokens, merges learned from a short text) and a ChatML chat template.
//! Tests and CI use it where the real model would be slow or is not needed.
//!
//! ```
//! use kvplan_decoder::{gguf::Gguf, tiny::{TinyConfig, tiny_llama_bytes}, tokenizer::Tokenizer};
//! let gguf = Gguf::from_bytes(tiny_llama_bytes(&TinyConfig::default(), 7).unwrap()).unwrap();
//! assert_eq!(gguf.u32("llama.block_count").unwrap(), 2);
//! let tokenizer = Tokenizer::from_gguf(&gguf).unwrap();
//! let ids = tokenizer.encode("the cat").unwrap();
//! assert_eq!(tokenizer.decode(&ids).unwrap(), "the cat");
//! ```

use std::collections::{BTreeMap, HashSet};
use std::path::Path;

use crate::gguf::{GgmlType, GgufWriter, ModelError, Result, Value};

/// SmolLM2's first three special tokens, at the same ids (bos = 1, eos = 2).
const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
const BOS_ID: u32 = 1;
const EOS_ID: u32 = 2;
/// llama.cpp's token types: normal and control.
const TOKEN_TYPE_NORMAL: i32 = 1;
const TOKEN_TYPE_CONTROL: i32 = 3;

/// SmolLM2-135M-Instruct's chat template (ChatML with a default system prompt), verbatim.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// The text the merges are learned from: plain English plus the chat template's words.
const MERGE_TEXT: &str = "\
The quick brown fox jumps over the lazy dog. The dog sleeps in the sun, and the fox runs into \
the woods. What is the capital of France? The capital of France is Paris. Paris is a city on \
the river Seine, and it is the largest city in the country. The user asks a question and the \
assistant gives an answer. You are a helpful AI assistant named SmolLM, trained by Hugging \
Face. A system message sets the role of the assistant; the user message holds the question. \
There are 12 months in a year and 365 days, 24 hours in a day and 60 minutes in an hour. \
Some of the things that people write about are the weather, the news, their work and their \
friends. fn main() { let x = 42; println!(\"{}\", x); } def hello(name): return f\"Hello, \
{name}!\" The cat sat on the mat, and the rat ran to the hat. It was the best of times, it was \
the worst of times, it was the age of wisdom, it was the age of foolishness. Once upon a time \
there was a little girl who lived in a village near the forest. Whenever she went out, the \
little girl wore a red riding cloak, so everyone in the village called her Little Red Riding \
Hood. One morning she asked her mother if she could go to visit her grandmother.";

/// The shape of the tiny model. The defaults give about 100k parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct TinyConfig {
    /// Transformer blocks (`llama.block_count`).
    pub layers: usize,
    /// Model width (`llama.embedding_length`), a multiple of 32 and of `heads`.
    pub hidden: usize,
    /// Query heads (`llama.attention.head_count`).
    pub heads: usize,
    /// Key/value heads (`llama.attention.head_count_kv`), dividing `heads`.
    pub kv_heads: usize,
    /// MLP width (`llama.feed_forward_length`), a multiple of 32.
    pub ffn: usize,
    /// `llama.context_length`.
    pub context_length: usize,
    /// `llama.rope.freq_base`.
    pub rope_base: f32,
    /// `llama.attention.layer_norm_rms_epsilon`.
    pub rms_eps: f32,
    /// BPE merges to learn (fewer when every word of the text is one token).
    pub merges: usize,
    /// Storage of `token_embd.weight` (SmolLM2: Q8_0).
    pub embedding_type: GgmlType,
    /// Storage of the attention and MLP matrices (SmolLM2: Q4_1).
    pub matrix_type: GgmlType,
}

impl Default for TinyConfig {
    fn default() -> Self {
        TinyConfig {
            layers: 2,
            hidden: 64,
            heads: 4,
            kv_heads: 2,
            ffn: 128,
            context_length: 512,
            rope_base: 100_000.0,
            rms_eps: 1e-5,
            merges: 256,
            embedding_type: GgmlType::Q8_0,
            matrix_type: GgmlType::Q4_1,
        }
    }
}

impl TinyConfig {
    fn check(&self) -> Result<()> {
        let bad = |reason: &str| {
            Err(ModelError::BadConfig {
                reason: reason.into(),
            })
        };
        if self.layers == 0 || self.heads == 0 || self.kv_heads == 0 || self.context_length == 0 {
            return bad("layers, heads, kv_heads and context_length must be positive");
        }
        if self.hidden % self.heads != 0 || self.heads % self.kv_heads != 0 {
            return bad("heads must divide hidden and kv_heads must divide heads");
        }
        if (self.hidden / self.heads) % 2 != 0 {
            return bad("the head dimension must be even for RoPE");
        }
        Ok(())
    }
}

/// GPT-2's byte-to-character map for byte-level BPE: printable Latin-1 bytes stand for
/// themselves, the others for the characters from U+0100 on, in byte order.
fn byte_chars() -> [char; 256] {
    let printable = |b: u32| matches!(b, 0x21..=0x7e | 0xa1..=0xac | 0xae..=0xff);
    let mut chars = ['\0'; 256];
    let mut next = 256;
    for b in 0..256u32 {
        chars[b as usize] = if printable(b) {
            char::from_u32(b).expect("Latin-1 is valid")
        } else {
            next += 1;
            char::from_u32(next - 1).expect("U+0100..U+0143 is valid")
        };
    }
    chars
}

/// Splits text the way GPT-2's regex roughly does (a leading space stays with the word, digits
/// one by one) so that the merges learned are ones the tokenizer can apply.
fn pre_tokens(text: &str) -> Vec<&str> {
    #[derive(PartialEq)]
    enum Class {
        Letter,
        Digit,
        Space,
        Other,
    }
    let class = |c: char| match c {
        c if c.is_alphabetic() => Class::Letter,
        c if c.is_numeric() => Class::Digit,
        c if c.is_whitespace() => Class::Space,
        _ => Class::Other,
    };
    let mut out = Vec::new();
    let mut start = 0;
    let mut chars = text.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        let this = class(c);
        let next = chars.peek().map(|&(_, n)| class(n));
        let continues = match (this, next) {
            (_, None) | (_, Some(Class::Digit)) | (Class::Digit, _) => false,
            // A space joins the word after it, like GPT-2's ` ?\p{L}+`.
            (Class::Space, Some(next)) => next == Class::Space || c == ' ',
            (this, Some(next)) => this == next,
        };
        if !continues {
            let end = i + c.len_utf8();
            out.push(&text[start..end]);
            start = end;
        }
    }
    out
}

/// Learns up to `count` BPE merges from `text` (most frequent pair first, ties by the pair).
fn learn_merges(text: &str, count: usize) -> Vec<(String, String)> {
    let chars = byte_chars();
    let mut words: BTreeMap<Vec<String>, usize> = BTreeMap::new();
    for word in pre_tokens(text) {
        let symbols = word
            .bytes()
            .map(|b| chars[b as usize].to_string())
            .collect();
        *words.entry(symbols).or_default() += 1;
    }
    let mut merges = Vec::new();
    while merges.len() < count {
        let mut pairs: BTreeMap<(&str, &str), usize> = BTreeMap::new();
        for (symbols, n) in &words {
            for pair in symbols.windows(2) {
                *pairs.entry((&pair[0], &pair[1])).or_default() += n;
            }
        }
        let Some(((a, b), _)) = pairs
            .into_iter()
            .max_by(|x, y| x.1.cmp(&y.1).then(y.0.cmp(&x.0)))
        else {
            break;
        };
        let (a, b) = (a.to_owned(), b.to_owned());
        words = words
            .into_iter()
            .map(|(symbols, n)| {
                let mut merged = Vec::with_capacity(symbols.len());
                let mut i = 0;
                while i < symbols.len() {
                    if i + 1 < symbols.len() && symbols[i] == a && symbols[i + 1] == b {
                        merged.push(format!("{a}{b}"));
                        i += 2;
                    } else {
                        merged.push(symbols[i].clone());
                        i += 1;
                    }
                }
                (merged, n)
            })
            .fold(BTreeMap::new(), |mut acc, (symbols, n)| {
                *acc.entry(symbols).or_default() += n;
                acc
            });
        merges.push((a, b));
    }
    merges
}

/// The vocabulary (special tokens, byte tokens, merge results), its token types and its merges.
fn vocabulary(merge_count: usize) -> (Vec<String>, Vec<i32>, Vec<String>) {
    let mut tokens: Vec<String> = SPECIAL_TOKENS.iter().map(|s| s.to_string()).collect();
    let mut types = vec![TOKEN_TYPE_CONTROL; tokens.len()];
    let mut bytes: Vec<char> = byte_chars().to_vec();
    bytes.sort_unstable();
    tokens.extend(bytes.iter().map(char::to_string));
    let merges = learn_merges(MERGE_TEXT, merge_count);
    let mut seen: HashSet<String> = tokens.iter().cloned().collect();
    for (a, b) in &merges {
        let merged = format!("{a}{b}");
        // Two pairs can make the same string; a vocabulary lists it once.
        if seen.insert(merged.clone()) {
            tokens.push(merged);
        }
    }
    types.resize(tokens.len(), TOKEN_TYPE_NORMAL);
    let merges = merges
        .into_iter()
        .map(|(a, b)| format!("{a} {b}"))
        .collect();
    (tokens, types, merges)
}

/// Seeded normal samples: splitmix64 into Box-Muller.
struct Normal {
    state: u64,
}

impl Normal {
    fn next_u64(&mut self) -> u64 {
        crate::sample::splitmix64(&mut self.state)
    }

    /// A uniform sample in (0, 1].
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    fn sample(&mut self, mean: f32, std: f32, len: usize) -> Vec<f32> {
        (0..len)
            .map(|_| {
                let (u, v) = (self.uniform(), self.uniform());
                let z = (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos();
                mean + std * z as f32
            })
            .collect()
    }
}

/// Standard deviations of the random weights: small enough that activations stay near unit
/// scale through the blocks, large enough that logits differ between tokens.
const EMBEDDING_STD: f32 = 0.1;
const MATRIX_STD: f32 = 0.08;
const NORM_STD: f32 = 0.1;

/// The tiny model's GGUF bytes; the same `config` and `seed` give the same bytes.
pub fn tiny_llama_bytes(config: &TinyConfig, seed: u64) -> Result<Vec<u8>> {
    config.check()?;
    let (tokens, token_types, merges) = vocabulary(config.merges);
    let vocab = tokens.len();
    let (hidden, ffn) = (config.hidden, config.ffn);
    let head_dim = hidden / config.heads;
    let kv_dim = head_dim * config.kv_heads;
    let as_u32 = |v: usize| u32::try_from(v).expect("tiny config fits in u32");

    let mut w = GgufWriter::new();
    w.metadata("general.architecture", "llama")
        .metadata("general.type", "model")
        .metadata("general.name", "kvplan tiny llama (random weights)")
        .metadata("llama.block_count", as_u32(config.layers))
        .metadata("llama.context_length", as_u32(config.context_length))
        .metadata("llama.embedding_length", as_u32(hidden))
        .metadata("llama.feed_forward_length", as_u32(ffn))
        .metadata("llama.attention.head_count", as_u32(config.heads))
        .metadata("llama.attention.head_count_kv", as_u32(config.kv_heads))
        .metadata("llama.rope.freq_base", config.rope_base)
        .metadata("llama.attention.layer_norm_rms_epsilon", config.rms_eps)
        .metadata("llama.vocab_size", as_u32(vocab))
        .metadata("llama.rope.dimension_count", as_u32(head_dim))
        .metadata("tokenizer.ggml.add_space_prefix", false)
        .metadata("tokenizer.ggml.add_bos_token", false)
        .metadata("tokenizer.ggml.model", "gpt2")
        .metadata("tokenizer.ggml.pre", "smollm")
        .metadata("tokenizer.ggml.tokens", Value::strings(tokens))
        .metadata("tokenizer.ggml.token_type", Value::i32s(token_types))
        .metadata("tokenizer.ggml.merges", Value::strings(merges))
        .metadata("tokenizer.ggml.bos_token_id", BOS_ID)
        .metadata("tokenizer.ggml.eos_token_id", EOS_ID)
        .metadata("tokenizer.ggml.unknown_token_id", 0u32)
        .metadata("tokenizer.ggml.padding_token_id", EOS_ID)
        .metadata("tokenizer.chat_template", CHATML_TEMPLATE)
        .metadata("general.quantization_version", 2u32);

    let mut rng = Normal { state: seed };
    let embd = rng.sample(0.0, EMBEDDING_STD, vocab * hidden);
    w.tensor(
        "token_embd.weight",
        &[vocab, hidden],
        &embd,
        config.embedding_type,
    )?;
    // (name, rows, cols) in the real file's order; None marks a norm.
    let block: [(&str, Option<[usize; 2]>); 9] = [
        ("attn_norm", None),
        ("ffn_down", Some([hidden, ffn])),
        ("ffn_gate", Some([ffn, hidden])),
        ("ffn_up", Some([ffn, hidden])),
        ("ffn_norm", None),
        ("attn_k", Some([kv_dim, hidden])),
        ("attn_output", Some([hidden, hidden])),
        ("attn_q", Some([hidden, hidden])),
        ("attn_v", Some([kv_dim, hidden])),
    ];
    for layer in 0..config.layers {
        for (part, shape) in block {
            let name = format!("blk.{layer}.{part}.weight");
            match shape {
                Some([rows, cols]) => {
                    let data = rng.sample(0.0, MATRIX_STD, rows * cols);
                    w.tensor(&name, &[rows, cols], &data, config.matrix_type)?;
                }
                None => {
                    let data = rng.sample(1.0, NORM_STD, hidden);
                    w.tensor(&name, &[hidden], &data, GgmlType::F32)?;
                }
            }
        }
    }
    let norm = rng.sample(1.0, NORM_STD, hidden);
    w.tensor("output_norm.weight", &[hidden], &norm, GgmlType::F32)?;
    Ok(w.to_bytes())
}

/// Writes the tiny model to `path` (see [`tiny_llama_bytes`]).
pub fn write_tiny_llama(path: &Path, config: &TinyConfig, seed: u64) -> Result<()> {
    std::fs::write(path, tiny_llama_bytes(config, seed)?).map_err(|source| ModelError::Io {
        path: path.to_owned(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::Gguf;
    use crate::tokenizer::Tokenizer;

    fn tiny(config: &TinyConfig, seed: u64) -> Gguf {
        Gguf::from_bytes(tiny_llama_bytes(config, seed).unwrap()).unwrap()
    }

    fn std_dev(x: &[f32]) -> (f64, f64) {
        let n = x.len() as f64;
        let mean = x.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
        let var = x
            .iter()
            .map(|&v| (f64::from(v) - mean).powi(2))
            .sum::<f64>()
            / n;
        (mean, var.sqrt())
    }

    #[test]
    fn seeded_and_shaped_like_the_config() {
        let config = TinyConfig::default();
        let bytes = tiny_llama_bytes(&config, 7).unwrap();
        assert_eq!(bytes, tiny_llama_bytes(&config, 7).unwrap());
        assert_ne!(bytes, tiny_llama_bytes(&config, 8).unwrap());
        let g = Gguf::from_bytes(bytes).unwrap();
        assert_eq!(g.str("general.architecture").unwrap(), "llama");
        assert_eq!(g.u32("llama.block_count").unwrap(), 2);
        assert_eq!(g.u32("llama.embedding_length").unwrap(), 64);
        assert_eq!(g.u32("llama.feed_forward_length").unwrap(), 128);
        assert_eq!(g.u32("llama.attention.head_count").unwrap(), 4);
        assert_eq!(g.u32("llama.attention.head_count_kv").unwrap(), 2);
        assert_eq!(g.u32("llama.rope.dimension_count").unwrap(), 16);
        assert_eq!(g.u32("llama.context_length").unwrap(), 512);
        assert_eq!(g.f32("llama.rope.freq_base").unwrap(), 100_000.0);
        assert_eq!(
            g.f32("llama.attention.layer_norm_rms_epsilon").unwrap(),
            1e-5
        );
        let vocab = g.str_array("tokenizer.ggml.tokens").unwrap().len();
        assert_eq!(g.u32("llama.vocab_size").unwrap() as usize, vocab);
        // 3 special + 256 byte tokens + one per distinct merge result.
        let merges = g.str_array("tokenizer.ggml.merges").unwrap().len();
        assert_eq!(merges, 256);
        assert!(
            vocab > 259 + merges - 8 && vocab <= 259 + merges,
            "{vocab} tokens"
        );

        let mut names = vec!["token_embd.weight".to_string()];
        for layer in 0..2 {
            for part in [
                "attn_norm",
                "ffn_down",
                "ffn_gate",
                "ffn_up",
                "ffn_norm",
                "attn_k",
                "attn_output",
                "attn_q",
                "attn_v",
            ] {
                names.push(format!("blk.{layer}.{part}.weight"));
            }
        }
        names.push("output_norm.weight".into());
        assert_eq!(g.tensor_names().collect::<Vec<_>>(), names);
        let info = |name: &str| {
            let t = g.tensor_info(name).unwrap();
            (t.shape.clone(), t.ggml_type)
        };
        assert_eq!(info("token_embd.weight"), (vec![vocab, 64], GgmlType::Q8_0));
        assert_eq!(info("blk.1.attn_q.weight"), (vec![64, 64], GgmlType::Q4_1));
        assert_eq!(info("blk.1.attn_k.weight"), (vec![32, 64], GgmlType::Q4_1));
        assert_eq!(info("blk.1.attn_v.weight"), (vec![32, 64], GgmlType::Q4_1));
        assert_eq!(
            info("blk.1.attn_output.weight"),
            (vec![64, 64], GgmlType::Q4_1)
        );
        assert_eq!(
            info("blk.1.ffn_gate.weight"),
            (vec![128, 64], GgmlType::Q4_1)
        );
        assert_eq!(info("blk.1.ffn_up.weight"), (vec![128, 64], GgmlType::Q4_1));
        assert_eq!(
            info("blk.1.ffn_down.weight"),
            (vec![64, 128], GgmlType::Q4_1)
        );
        assert_eq!(info("blk.1.ffn_norm.weight"), (vec![64], GgmlType::F32));
        assert_eq!(info("output_norm.weight"), (vec![64], GgmlType::F32));
    }

    #[test]
    fn weights_have_model_like_scales() {
        let g = tiny(&TinyConfig::default(), 1);
        let embd = g.tensor("token_embd.weight").unwrap();
        let (mean, std) = std_dev(&embd.data);
        assert!(
            mean.abs() < 0.01 && (0.09..0.11).contains(&std),
            "embeddings {mean} {std}"
        );
        for name in ["blk.0.attn_q.weight", "blk.1.ffn_down.weight"] {
            let (mean, std) = std_dev(&g.tensor(name).unwrap().data);
            assert!(
                mean.abs() < 0.01 && (0.07..0.09).contains(&std),
                "{name} {mean} {std}"
            );
        }
        let norm = g.tensor("output_norm.weight").unwrap();
        let (mean, std) = std_dev(&norm.data);
        assert!(
            (mean - 1.0).abs() < 0.05 && (0.05..0.15).contains(&std),
            "norm {mean} {std}"
        );

        // Tied-embedding logits of a normed embedding spread out rather than collapse.
        let hidden = 64;
        for token in [3usize, 100, 300] {
            let e = &embd.data[token * hidden..][..hidden];
            let rms = (e.iter().map(|v| v * v).sum::<f32>() / hidden as f32 + 1e-5).sqrt();
            let h: Vec<f32> = e.iter().zip(&norm.data).map(|(v, w)| v / rms * w).collect();
            let logits: Vec<f32> = embd
                .data
                .chunks(hidden)
                .map(|row| row.iter().zip(&h).map(|(a, b)| a * b).sum())
                .collect();
            let (_, std) = std_dev(&logits);
            assert!((0.4..2.0).contains(&std), "token {token}: logit std {std}");
        }
    }

    #[test]
    fn its_tokenizer_works() {
        let g = tiny(&TinyConfig::default(), 2);
        let t = Tokenizer::from_gguf(&g).unwrap();
        assert_eq!(
            t.vocab_size(),
            g.str_array("tokenizer.ggml.tokens").unwrap().len()
        );
        assert_eq!((t.bos_token_id(), t.eos_token_id()), (Some(1), 2));
        assert!(t.is_eos(2) && t.is_eos(0));
        // Learned merges: common words are one token.
        for word in [" the", " of", " and", " capital"] {
            assert_eq!(t.encode(word).unwrap().len(), 1, "{word:?}");
        }
        assert_eq!(t.encode("<|im_start|>user\n").unwrap()[0], 1);
        for text in [
            "What is the capital of France?",
            "café 東京 🤗 12345\n\tx",
            "",
        ] {
            let ids = t.encode(text).unwrap();
            assert!(ids.iter().all(|&id| (id as usize) < t.vocab_size()));
            assert_eq!(t.decode(&ids).unwrap(), text);
        }
        let prompt = t.render_chat("What is the capital of France?").unwrap();
        assert_eq!(
            prompt,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
             <|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
        );
        let ids = t.encode(&prompt).unwrap();
        assert_eq!(ids.iter().filter(|&&id| id == 1).count(), 3);
        assert_eq!(t.decode(&ids).unwrap(), prompt);
    }

    #[test]
    fn writes_files_and_other_configs() {
        let config = TinyConfig {
            layers: 1,
            hidden: 32,
            heads: 2,
            kv_heads: 1,
            ffn: 64,
            merges: 50,
            embedding_type: GgmlType::F32,
            matrix_type: GgmlType::F16,
            ..TinyConfig::default()
        };
        let path = std::env::temp_dir().join(format!("kvplan-tiny-{}.gguf", std::process::id()));
        write_tiny_llama(&path, &config, 3).unwrap();
        let g = Gguf::open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(g.tensor_names().count(), 1 + 9 + 1);
        assert_eq!(
            g.tensor_info("token_embd.weight").unwrap().ggml_type,
            GgmlType::F32
        );
        assert_eq!(
            g.tensor_info("blk.0.attn_k.weight").unwrap().shape,
            [16, 32]
        );
        assert_eq!(
            g.tensor_info("blk.0.ffn_up.weight").unwrap().ggml_type,
            GgmlType::F16
        );
        assert_eq!(g.str_array("tokenizer.ggml.merges").unwrap().len(), 50);

        let bad = TinyConfig {
            heads: 3,
            ..TinyConfig::default()
        };
        assert!(matches!(
            tiny_llama_bytes(&bad, 0),
            Err(ModelError::BadConfig { .. })
        ));
        let bad = TinyConfig {
            hidden: 48,
            heads: 3,
            kv_heads: 1,
            ..TinyConfig::default()
        };
        assert!(matches!(
            tiny_llama_bytes(&bad, 0),
            Err(ModelError::BadShape { .. })
        ));
    }

    #[test]
    fn same_keys_and_names_as_smollm2() {
        let real = crate::model_file::smollm2_for_tests();
        let g = tiny(&TinyConfig::default(), 4);
        for key in g.metadata_keys() {
            let (ours, theirs) = (g.value(key).unwrap(), real.value(key));
            let theirs = theirs.unwrap_or_else(|| panic!("SmolLM2 has no {key}"));
            assert_eq!(ours.type_id(), theirs.type_id(), "{key}");
        }
        for key in real
            .metadata_keys()
            .filter(|k| k.starts_with("llama.") || k.starts_with("tokenizer."))
        {
            assert!(g.value(key).is_some(), "tiny lacks {key}");
        }
        assert_eq!(
            g.str("tokenizer.chat_template").unwrap(),
            real.str("tokenizer.chat_template").unwrap()
        );
        let layer_names = |gguf: &Gguf, layer: usize| -> Vec<String> {
            let prefix = format!("blk.{layer}.");
            gguf.tensor_names()
                .filter(|n| n.starts_with(&prefix))
                .map(String::from)
                .collect()
        };
        assert_eq!(layer_names(&g, 1), layer_names(real, 1));
        for name in ["token_embd.weight", "output_norm.weight"] {
            assert_eq!(
                g.tensor_info(name).unwrap().ggml_type,
                real.tensor_info(name).unwrap().ggml_type
            );
        }
        for part in ["attn_q", "ffn_norm"] {
            let name = format!("blk.0.{part}.weight");
            assert_eq!(
                g.tensor_info(&name).unwrap().ggml_type,
                real.tensor_info(&name).unwrap().ggml_type
            );
        }
    }
}
