//! The tokenizer of a GGUF model with a GPT-2-style byte-level BPE vocabulary (SmolLM2's), built as
//! a Hugging Face `tokenizers` tokenizer from the file's `tokenizer.ggml.*` metadata, and its chat
//! template rendered with `minijinja`.
//!
//! ```no_run
//! # fn main() -> Result<(), kvplan_decoder::gguf::ModelError> {
//! use kvplan_decoder::{gguf::Gguf, tokenizer::Tokenizer};
//! let gguf = Gguf::open("SmolLM2-135M-Instruct.Q4_1.gguf")?;
//! let tokenizer = Tokenizer::from_gguf(&gguf)?;
//! let prompt = tokenizer.render_chat("What is the capital of France?")?;
//! let ids = tokenizer.encode(&prompt)?;
//! assert_eq!(tokenizer.decode(&ids)?, prompt);
//! # Ok(()) }
//! ```

use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, Tokenizer as HfTokenizer};

use crate::gguf::{Gguf, ModelError, Result};

/// llama.cpp's `llama_token_type` values in `tokenizer.ggml.token_type`.
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// Token texts that end a generation besides the file's eos, as in llama.cpp's end-of-generation set.
const END_OF_GENERATION: [&str; 2] = ["<|im_end|>", "<|endoftext|>"];

/// A byte-level BPE tokenizer with its special tokens and chat template.
pub struct Tokenizer {
    hf: HfTokenizer,
    vocab_size: usize,
    bos_token_id: Option<u32>,
    eos_token_id: u32,
    add_bos: bool,
    end_of_generation: Vec<u32>,
    bos_token: String,
    eos_token: String,
    chat_template: Option<String>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("bos_token_id", &self.bos_token_id)
            .field("eos_token_id", &self.eos_token_id)
            .field("add_bos", &self.add_bos)
            .field("end_of_generation", &self.end_of_generation)
            .finish_non_exhaustive()
    }
}

fn tokenizer_error(what: impl Into<String>, source: impl Into<tokenizers::Error>) -> ModelError {
    ModelError::Tokenizer {
        what: what.into(),
        source: source.into(),
    }
}

impl Tokenizer {
    /// Builds the tokenizer from `tokenizer.ggml.{model, pre, tokens, token_type, merges,
    /// eos_token_id, bos_token_id, add_bos_token}` and `tokenizer.chat_template`.
    ///
    /// Only `tokenizer.ggml.model = gpt2` is supported, with the pre-tokenizers `smollm` (digits
    /// split one by one, then GPT-2's regex: SmolLM2's tokenizer.json) and `gpt-2`/`default`/absent
    /// (GPT-2's regex alone). Control and user-defined tokens are matched whole in the text.
    pub fn from_gguf(gguf: &Gguf) -> Result<Self> {
        let model = gguf.str("tokenizer.ggml.model")?;
        let pre = gguf.str("tokenizer.ggml.pre").unwrap_or("default");
        let split_digits = match (model, pre) {
            ("gpt2", "smollm") => true,
            ("gpt2", "gpt-2" | "default") => false,
            _ => {
                return Err(ModelError::UnsupportedTokenizer {
                    model: model.into(),
                    pre: pre.into(),
                });
            }
        };
        let tokens = gguf.str_array("tokenizer.ggml.tokens")?;
        let token_types = match gguf.value("tokenizer.ggml.token_type") {
            Some(_) => gguf.i32_array("tokenizer.ggml.token_type")?,
            None => vec![1; tokens.len()],
        };
        if token_types.len() != tokens.len() {
            return Err(tokenizer_error(
                "reading tokenizer.ggml.token_type",
                format!("{} types for {} tokens", token_types.len(), tokens.len()),
            ));
        }

        let mut vocab = Vocab::with_capacity(tokens.len());
        for (id, &token) in tokens.iter().enumerate() {
            if vocab.insert(token.to_owned(), id as u32).is_some() {
                // A map would keep one id of the two and silently never produce the other.
                return Err(tokenizer_error(
                    "reading tokenizer.ggml.tokens",
                    format!("token {token:?} appears twice (again at id {id})"),
                ));
            }
        }
        let merges = gguf
            .str_array("tokenizer.ggml.merges")?
            .into_iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_owned(), b.to_owned()))
                    .ok_or_else(|| {
                        tokenizer_error(
                            "reading tokenizer.ggml.merges",
                            format!("merge {m:?} is not two tokens separated by a space"),
                        )
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| tokenizer_error("building the BPE model", e))?;

        let mut hf = HfTokenizer::new(bpe);
        // SmolLM2's tokenizer.json: ByteLevel(add_prefix_space=false, trim_offsets=true, use_regex=true).
        let byte_level = ByteLevel::new(false, true, true);
        let pre_tokenizer = if split_digits {
            PreTokenizerWrapper::Sequence(Sequence::new(vec![
                PreTokenizerWrapper::Digits(Digits::new(true)),
                PreTokenizerWrapper::ByteLevel(byte_level.clone()),
            ]))
        } else {
            PreTokenizerWrapper::ByteLevel(byte_level.clone())
        };
        hf.with_pre_tokenizer(Some(pre_tokenizer));
        hf.with_decoder(Some(DecoderWrapper::ByteLevel(byte_level)));
        let added: Vec<AddedToken> = tokens
            .iter()
            .zip(&token_types)
            .filter(|&(_, &t)| t == TOKEN_TYPE_CONTROL || t == TOKEN_TYPE_USER_DEFINED)
            .map(|(&token, &t)| AddedToken::from(token, t == TOKEN_TYPE_CONTROL))
            .collect();
        hf.add_special_tokens(added)
            .map_err(|e| tokenizer_error("adding the control and user-defined tokens", e))?;

        let vocab_size = tokens.len();
        let token_id = |key: &str| -> Result<u32> {
            let id = gguf.u32(key)?;
            if id as usize >= vocab_size {
                return Err(ModelError::TokenOutOfRange { id, vocab_size });
            }
            Ok(id)
        };
        let eos_token_id = token_id("tokenizer.ggml.eos_token_id")?;
        let bos_token_id = match gguf.value("tokenizer.ggml.bos_token_id") {
            Some(_) => Some(token_id("tokenizer.ggml.bos_token_id")?),
            None => None,
        };
        let add_bos = match gguf.value("tokenizer.ggml.add_bos_token") {
            Some(_) => gguf.bool("tokenizer.ggml.add_bos_token")?,
            None => false,
        };
        let mut end_of_generation = vec![eos_token_id];
        for text in END_OF_GENERATION {
            if let Some(id) = tokens.iter().position(|&t| t == text).map(|i| i as u32) {
                if !end_of_generation.contains(&id) {
                    end_of_generation.push(id);
                }
            }
        }
        let chat_template = match gguf.value("tokenizer.chat_template") {
            Some(_) => Some(gguf.str("tokenizer.chat_template")?.to_owned()),
            None => None,
        };
        Ok(Tokenizer {
            hf,
            vocab_size,
            bos_token_id,
            eos_token_id,
            add_bos,
            end_of_generation,
            bos_token: bos_token_id.map_or(String::new(), |id| tokens[id as usize].to_owned()),
            eos_token: tokens[eos_token_id as usize].to_owned(),
            chat_template,
        })
    }

    /// Token ids of `text`, special tokens (`<|im_start|>` ...) matched whole; BOS first only
    /// when the file's `tokenizer.ggml.add_bos_token` says so (SmolLM2's does not).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self
            .hf
            .encode_fast(text, false)
            .map_err(|e| tokenizer_error(format!("encoding {} bytes of text", text.len()), e))?;
        let mut ids = Vec::with_capacity(encoding.len() + 1);
        if let (true, Some(bos)) = (self.add_bos, self.bos_token_id) {
            ids.push(bos);
        }
        ids.extend_from_slice(encoding.get_ids());
        Ok(ids)
    }

    fn check_ids(&self, ids: &[u32]) -> Result<()> {
        match ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            Some(&id) => Err(ModelError::TokenOutOfRange {
                id,
                vocab_size: self.vocab_size,
            }),
            None => Ok(()),
        }
    }

    /// The text of `ids`, special tokens included; bytes that are not UTF-8 become U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.check_ids(ids)?;
        self.hf
            .decode(ids, false)
            .map_err(|e| tokenizer_error(format!("decoding {} ids", ids.len()), e))
    }

    /// The text of one token as the vocabulary spells it (byte-level: `Ġ` for a space).
    pub fn token_text(&self, id: u32) -> Option<String> {
        self.hf.id_to_token(id)
    }

    /// The file's end-of-sequence id (`<|im_end|>` for SmolLM2-Instruct).
    pub fn eos_token_id(&self) -> u32 {
        self.eos_token_id
    }

    /// The file's beginning-of-sequence id, if it has one.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token_id
    }

    /// Whether generation stops at `id`: the eos id, `<|im_end|>` and `<|endoftext|>`
    /// (llama.cpp's end-of-generation tokens).
    pub fn is_eos(&self, id: u32) -> bool {
        self.end_of_generation.contains(&id)
    }

    /// The ids [`Self::is_eos`] accepts, eos first.
    pub fn end_of_generation_ids(&self) -> &[u32] {
        &self.end_of_generation
    }

    /// The number of tokens (ids are `0..vocab_size`).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The file's chat template with one user message and the assistant's turn opened, rendered
    /// as Hugging Face does (Jinja with `trim_blocks` and `lstrip_blocks`, `bos_token`,
    /// `eos_token` and `raise_exception` defined).
    pub fn render_chat(&self, user_message: &str) -> Result<String> {
        let Some(template) = &self.chat_template else {
            return Err(ModelError::MissingKey {
                key: "tokenizer.chat_template".into(),
            });
        };
        let mut env = minijinja::Environment::new();
        let syntax = env
            .syntax()
            .to_builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()?;
        env.set_syntax(syntax);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<(), minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    message,
                ))
            },
        );
        let messages = vec![minijinja::context! { role => "user", content => user_message }];
        let context = minijinja::context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
        };
        Ok(env.render_str(template, context)?)
    }

    /// A [`Detokenizer`] for one stream of generated ids.
    pub fn detokenizer(&self) -> Detokenizer {
        Detokenizer::default()
    }
}

/// Turns generated ids into text as they arrive: a token that ends inside a UTF-8 character
/// (byte-level BPE splits characters) yields nothing until the character is complete.
///
/// It holds no borrow of the [`Tokenizer`] so that a scheduler can keep one per request.
///
/// ```no_run
/// # fn f(tokenizer: &kvplan_decoder::tokenizer::Tokenizer, ids: &[u32]) -> kvplan_decoder::gguf::Result<()> {
/// let mut detok = tokenizer.detokenizer();
/// let mut text = String::new();
/// for &id in ids {
///     if let Some(piece) = detok.step(tokenizer, id)? {
///         text.push_str(&piece);
///     }
/// }
/// text.push_str(&detok.finish(tokenizer)?);
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, Default)]
pub struct Detokenizer {
    /// The ids not yet fully emitted, with the few before them that the decoder needs.
    ids: Vec<u32>,
    /// The text of `ids[..prefix_index]`, already emitted.
    prefix: String,
    prefix_index: usize,
}

impl Detokenizer {
    /// Feeds one id; returns the new text once it is whole UTF-8.
    pub fn step(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<Option<String>> {
        tokenizer.check_ids(&[id])?;
        // The tokenizers crate's DecodeStream, without its borrow of the tokenizer.
        tokenizers::step_decode_stream(
            &*tokenizer.hf,
            vec![id],
            false,
            &mut self.ids,
            &mut self.prefix,
            &mut self.prefix_index,
        )
        .map_err(|e| tokenizer_error(format!("streaming id {id}"), e))
    }

    /// Ends the stream: the text still held back (an unfinished character, as U+FFFD).
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> Result<String> {
        let text = tokenizer.decode(&self.ids)?;
        let rest = text
            .strip_prefix(self.prefix.as_str())
            .unwrap_or(&text)
            .to_owned();
        *self = Detokenizer::default();
        Ok(rest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model_file::smollm2_for_tests;
    use std::sync::OnceLock;

    fn smollm2() -> &'static Tokenizer {
        static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
        TOKENIZER.get_or_init(|| Tokenizer::from_gguf(smollm2_for_tests()).unwrap())
    }

    /// The chat template of SmolLM2-135M-Instruct rendered by Python's jinja2 (as transformers
    /// and llama-cpp-python do: trim_blocks, lstrip_blocks) for one user message.
    const CHAT_PROMPT: &str = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n";

    /// Ids from llama.cpp's tokenizer (llama-cpp-python 0.3.36, `tokenize(text, add_bos=False,
    /// special=True)`) on the same GGUF, whose `tokenizer.ggml.pre = smollm` selects the digit
    /// split and GPT-2's regex.
    const PARITY: &[(&str, &[u32])] = &[
        ("Hello, world!", &[19556, 28, 905, 17]),
        (
            "The quick brown fox jumps over the lazy dog.",
            &[504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30],
        ),
        ("12345", &[33, 34, 35, 36, 37]),
        (
            "I have 3 apples and 1,234.56 dollars in 2024.",
            &[
                57, 457, 216, 35, 13855, 284, 216, 33, 28, 34, 35, 36, 30, 37, 38, 8358, 281, 216,
                34, 32, 34, 36, 30,
            ],
        ),
        (
            "def fib(n):\n    return n if n < 2 else fib(n-1) + fib(n-2)\n",
            &[
                1604, 3987, 24, 94, 727, 472, 1003, 304, 585, 304, 2067, 216, 34, 1745, 3987, 24,
                94, 29, 33, 25, 1232, 3987, 24, 94, 29, 34, 25, 198,
            ],
        ),
        ("café 東京", &[83, 1939, 2756, 17097, 247, 126, 16736, 122]),
        (
            "  leading spaces and\ttabs\n\nnewlines  ",
            &[
                216, 2899, 5600, 284, 197, 100, 7366, 198, 198, 2241, 5110, 256,
            ],
        ),
        (
            "emoji 🤗 and accents: naïve façade, Ünïcödé",
            &[
                391, 33777, 15107, 114, 241, 284, 31620, 42, 15486, 46494, 40852, 28, 5549, 246,
                94, 25972, 83, 7466, 84, 2756,
            ],
        ),
        (
            "don't you're we'll I'M",
            &[12420, 982, 346, 2316, 392, 3060, 339, 23, 61],
        ),
        (
            "½ ² ³ ٣ numbers",
            &[16738, 216, 19133, 216, 39050, 216, 164, 113, 2966],
        ),
        (
            "x<|endoftext|>y <|im_start|>user\nHi<|im_end|>\n",
            &[104, 0, 105, 216, 1, 4093, 198, 26843, 2, 198],
        ),
        (
            "Привет, мир! https://example.com/path?q=1&b=2",
            &[
                155, 249, 46879, 16464, 32547, 28, 41337, 7872, 9175, 17, 5141, 1742, 7434, 30,
                824, 31, 1537, 47, 97, 45, 33, 22, 82, 45, 34,
            ],
        ),
        ("", &[]),
        (
            CHAT_PROMPT,
            &[
                1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018,
                411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47,
                2, 198, 1, 520, 9531, 198,
            ],
        ),
    ];

    #[test]
    fn smollm2_encodes_as_llama_cpp() {
        let t = smollm2();
        for &(text, ids) in PARITY {
            assert_eq!(t.encode(text).unwrap(), ids, "{text:?}");
            assert_eq!(t.decode(ids).unwrap(), text, "{text:?}");
        }
    }

    #[test]
    fn smollm2_chat_prompt() {
        let t = smollm2();
        assert_eq!(
            t.render_chat("What is the capital of France?").unwrap(),
            CHAT_PROMPT
        );
    }

    #[test]
    fn smollm2_special_ids() {
        let t = smollm2();
        assert_eq!(t.vocab_size(), 49152);
        assert_eq!(t.eos_token_id(), 2);
        assert_eq!(t.bos_token_id(), Some(1));
        assert_eq!(t.token_text(2).as_deref(), Some("<|im_end|>"));
        assert_eq!(t.token_text(216).as_deref(), Some("Ġ"));
        assert!(t.is_eos(2) && t.is_eos(0) && !t.is_eos(1) && !t.is_eos(504));
        assert_eq!(t.end_of_generation_ids(), [2, 0]);
        // No BOS is added (tokenizer.ggml.add_bos_token = false).
        assert_eq!(t.encode("Hi").unwrap(), [26843]);
        let e = t.decode(&[49152]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "token id 49152 is outside the vocabulary of 49152"
        );
    }

    #[test]
    fn smollm2_streams_whole_characters() {
        let t = smollm2();
        // " 東" is three tokens (Ġæ Ŀ ±) and 京 two (äº ¬); Python's DecodeStream gives the same.
        let (text, ids) = PARITY[5];
        let mut detok = t.detokenizer();
        let pieces: Vec<Option<String>> =
            ids.iter().map(|&id| detok.step(t, id).unwrap()).collect();
        assert_eq!(
            pieces,
            [
                Some("c"),
                Some("af"),
                Some("é"),
                None,
                None,
                Some(" 東"),
                None,
                Some("京")
            ]
            .map(|p| p.map(String::from))
        );
        assert_eq!(detok.finish(t).unwrap(), "");
        assert_eq!(pieces.into_iter().flatten().collect::<String>(), text);

        // Every parity string comes back whole when streamed, and an unfinished character at
        // the end comes out of `finish` as U+FFFD.
        for &(text, ids) in PARITY {
            let mut detok = t.detokenizer();
            let mut streamed: String = ids
                .iter()
                .filter_map(|&id| detok.step(t, id).unwrap())
                .collect();
            streamed.push_str(&detok.finish(t).unwrap());
            assert_eq!(streamed, text);
        }
        let mut detok = t.detokenizer();
        assert_eq!(detok.step(t, 17097).unwrap(), None);
        assert_eq!(detok.finish(t).unwrap(), " \u{fffd}");
        assert!(detok.step(t, 1 << 20).is_err());
    }

    #[test]
    fn refuses_unsupported_tokenizers() {
        let mut w = crate::gguf::GgufWriter::new();
        w.metadata("tokenizer.ggml.model", "llama")
            .metadata("tokenizer.ggml.pre", "default");
        let g = Gguf::from_bytes(w.to_bytes()).unwrap();
        let e = Tokenizer::from_gguf(&g).unwrap_err();
        assert!(matches!(e, ModelError::UnsupportedTokenizer { model, .. } if model == "llama"));
    }
}
