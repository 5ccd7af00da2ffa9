//! A speculative decoder for SmolLM2-135M (a Llama) on Burn 0.22 whose paged KV cache is one
//! `kvplan::PagedKv` (pools, `req_to_token`, slot and row allocators, the kv-canary on every step).
//!
//! Files: [`gguf`] and [`tokenizer`] read the model file, [`model`] is the Llama forward (its
//! projections one launch each of [`linear`]'s kernel at a step's few tokens),
//! [`clock`] the time in kvplan's calls, [`engine`] the serving loop (batching, drafting,
//! acceptance, fault injection), [`draft`] and [`sample`] the drafting and acceptance rules.

pub mod clock;
pub mod draft;
pub mod engine;
pub mod gguf;
pub mod linear;
pub mod model;
pub mod model_file;
pub mod sample;
pub mod tiny;
pub mod tokenizer;

/// What the decoder can fail with.
#[derive(Debug, thiserror::Error)]
pub enum DecoderError {
    /// The model file: reading, parsing, dequantizing, tokenizing.
    #[error(transparent)]
    File(#[from] gguf::ModelError),
    /// A model the forward cannot run (architecture, shapes).
    #[error("model: {0}")]
    Model(String),
    /// Engine options or requests that cannot be served.
    #[error("options: {0}")]
    Options(String),
    /// A kvplan op refused its inputs or failed on the device.
    #[error(transparent)]
    Kvplan(#[from] kvplan::Error),
}

/// The decoder's result.
pub type Result<T> = std::result::Result<T, DecoderError>;

#[cfg(test)]
mod tests;
