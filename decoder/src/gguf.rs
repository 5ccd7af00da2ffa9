//! GGUF v3 files: a reader (metadata, tensor directory, dequantization to f32) and a writer.
//!
//! The format is the one llama.cpp writes (<https://github.com/ggml-org/ggml/blob/master/docs/gguf.md>):
//! a header, typed key/value metadata, a tensor directory, then the tensor data, each tensor at an
//! offset aligned to `general.alignment` (32 when absent). The reader keeps the whole file in memory
//! and checks every count, length and offset against it, so a truncated or malformed file is an
//! `Err`, never a panic. The crates on crates.io either lack a quantization codec (gguf-rs-lib, 13k
//! lines) or a writer (gguf), and both are needed here, so this is a small reader of our own.
//!
//! ```no_run
//! # fn main() -> Result<(), kvplan_decoder::gguf::ModelError> {
//! use kvplan_decoder::gguf::Gguf;
//! let gguf = Gguf::open("SmolLM2-135M-Instruct.Q4_1.gguf")?;
//! let layers = gguf.u32("llama.block_count")?;
//! let embd = gguf.tensor("token_embd.weight")?; // shape [vocab, hidden], row-major
//! # let _ = (layers, embd); Ok(()) }
//! ```

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};

use half::{bf16, f16};

/// `GGUF` as the first four bytes of the file.
const MAGIC: [u8; 4] = *b"GGUF";
/// The only version read and written (v1 and v2 used 32-bit counts and are long gone).
const VERSION: u32 = 3;
/// Tensor data alignment when the file has no `general.alignment`.
pub const DEFAULT_ALIGNMENT: usize = 32;
/// ggml's GGML_MAX_DIMS: llama.cpp refuses tensors with more.
const MAX_DIMS: usize = 4;
/// Arrays of arrays are legal; a bound keeps a hostile file from exhausting the stack.
const MAX_ARRAY_NESTING: usize = 8;
/// Elements per block of the two block-quantized types this crate codes.
const QK: usize = 32;

/// Everything that can go wrong loading a model: reading and writing GGUF, building the tokenizer,
/// rendering the chat template, finding the model file.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// Any other error, with the file it came from.
    #[error("{path}: {source}")]
    InFile {
        /// The file.
        path: PathBuf,
        /// The error inside it.
        source: Box<ModelError>,
    },
    /// The first four bytes are not `GGUF`.
    #[error("not a GGUF file: magic is {found:02x?}, expected \"GGUF\"")]
    BadMagic {
        /// The first bytes of the file.
        found: Vec<u8>,
    },
    /// A GGUF version other than 3.
    #[error("GGUF version {version} is not supported (only version 3)")]
    UnsupportedVersion {
        /// The version in the header.
        version: u32,
    },
    /// The file ends before a field it announces.
    #[error("truncated file: {what} needs {needed} bytes at offset {offset}, file has {len}")]
    Truncated {
        /// The field being read.
        what: String,
        /// Where it starts.
        offset: usize,
        /// How many bytes it needs.
        needed: usize,
        /// The file's length.
        len: usize,
    },
    /// A string that is not UTF-8.
    #[error("{what} at offset {offset} is not valid UTF-8")]
    BadUtf8 {
        /// The string being read (a key, a key's value, a tensor name).
        what: String,
        /// Where its bytes start.
        offset: usize,
    },
    /// A metadata value type id outside GGUF's 0..=12.
    #[error("metadata key {key:?} has unknown value type {value_type}")]
    UnknownValueType {
        /// The key.
        key: String,
        /// The type id in the file.
        value_type: u32,
    },
    /// Arrays nested deeper than this reader accepts.
    #[error("metadata key {key:?} nests arrays deeper than {max}")]
    NestingTooDeep {
        /// The key.
        key: String,
        /// The deepest nesting accepted.
        max: usize,
    },
    /// The same metadata key twice.
    #[error("metadata key {key:?} appears twice")]
    DuplicateKey {
        /// The key.
        key: String,
    },
    /// `general.alignment` is zero or not a power of two.
    #[error("general.alignment {alignment} is not a power of two")]
    BadAlignment {
        /// The value in the file.
        alignment: u64,
    },
    /// A metadata key the caller needs is absent.
    #[error("metadata key {key:?} is missing")]
    MissingKey {
        /// The key.
        key: String,
    },
    /// A metadata value of another type than the caller needs.
    #[error("metadata key {key:?} is {found}, expected {expected}")]
    WrongType {
        /// The key.
        key: String,
        /// What the caller asked for.
        expected: &'static str,
        /// What the file holds (type, and the value when it is a number out of range).
        found: String,
    },
    /// A tensor type id that ggml does not define.
    #[error("tensor {tensor:?} has unknown ggml type {ggml_type}")]
    UnknownTensorType {
        /// The tensor.
        tensor: String,
        /// The type id in the file.
        ggml_type: u32,
    },
    /// A tensor type that ggml defines but this crate does not dequantize or quantize.
    #[error(
        "tensor {tensor:?} is {ggml_type}, which is not supported (F32, F16, BF16, Q8_0, Q4_1 are)"
    )]
    UnsupportedTensorType {
        /// The tensor.
        tensor: String,
        /// The type.
        ggml_type: GgmlType,
    },
    /// The same tensor name twice.
    #[error("tensor {name:?} appears twice")]
    DuplicateTensor {
        /// The tensor.
        name: String,
    },
    /// A tensor with more dimensions than ggml allows.
    #[error("tensor {name:?} has {n_dims} dimensions, at most {max} are allowed")]
    TooManyDims {
        /// The tensor.
        name: String,
        /// Its dimension count in the file.
        n_dims: usize,
        /// ggml's limit.
        max: usize,
    },
    /// A tensor shape that cannot be stored: no or too many dimensions, a zero or overflowing
    /// size, or a row that is not a whole number of quantization blocks.
    #[error("tensor {name:?} with GGUF dims {dims:?} as {ggml_type}: {reason}")]
    BadShape {
        /// The tensor.
        name: String,
        /// Its dims, innermost first as in the file.
        dims: Vec<u64>,
        /// Its type.
        ggml_type: GgmlType,
        /// What is wrong.
        reason: &'static str,
    },
    /// A tensor whose data lies outside the file or off the alignment.
    #[error(
        "tensor {name:?}: data at offset {offset} (+{size} bytes) is outside the data section \
         of {data_len} bytes or not {alignment}-aligned"
    )]
    BadTensorOffset {
        /// The tensor.
        name: String,
        /// Its offset, relative to the data section.
        offset: u64,
        /// Its size in bytes.
        size: usize,
        /// The data section's length.
        data_len: usize,
        /// The file's alignment.
        alignment: usize,
    },
    /// A tensor the caller needs is absent.
    #[error("tensor {name:?} is missing")]
    MissingTensor {
        /// The tensor.
        name: String,
    },
    /// Data handed to the writer whose length does not match the shape.
    #[error("tensor {name:?} of shape {shape:?} needs {expected} values, got {got}")]
    DataLength {
        /// The tensor.
        name: String,
        /// Its shape, outermost first.
        shape: Vec<usize>,
        /// The product of the shape.
        expected: usize,
        /// The number of values given.
        got: usize,
    },
    /// The Hugging Face tokenizer could not be built or refused an input.
    #[error("tokenizer: {what}: {source}")]
    Tokenizer {
        /// What was being done.
        what: String,
        /// The tokenizers crate's error (or ours, for a vocabulary it would accept silently).
        source: tokenizers::Error,
    },
    /// A tokenizer kind this crate does not build.
    #[error(
        "tokenizer.ggml.model {model:?} with tokenizer.ggml.pre {pre:?} is not supported \
         (gpt2 with smollm, gpt-2 or default is)"
    )]
    UnsupportedTokenizer {
        /// `tokenizer.ggml.model`.
        model: String,
        /// `tokenizer.ggml.pre` ("default" when absent).
        pre: String,
    },
    /// A token id outside the vocabulary.
    #[error("token id {id} is outside the vocabulary of {vocab_size}")]
    TokenOutOfRange {
        /// The id.
        id: u32,
        /// The vocabulary size.
        vocab_size: usize,
    },
    /// The chat template failed to parse or render.
    #[error("chat template: {0:#}")]
    ChatTemplate(#[from] minijinja::Error),
    /// A model configuration that cannot be built.
    #[error("bad model configuration: {reason}")]
    BadConfig {
        /// What is wrong.
        reason: String,
    },
    /// No directory to keep the model in: none of the variables that name one is set.
    #[error("no model directory: set KVPLAN_MODEL, KVPLAN_MODEL_DIR, XDG_CACHE_HOME or HOME")]
    NoModelDir,
    /// The model file is absent and `scripts/fetch-model.sh` is not where it was expected.
    #[error("model file {model} is missing and the fetch script {script} is not there to fetch it")]
    FetchScriptMissing {
        /// The model file looked for.
        model: PathBuf,
        /// The script looked for.
        script: PathBuf,
    },
    /// `scripts/fetch-model.sh` ran but did not leave the model file.
    #[error("model file {model} is missing and {script} failed to fetch it: {reason}")]
    FetchFailed {
        /// The model file looked for.
        model: PathBuf,
        /// The script that ran.
        script: PathBuf,
        /// Its exit status or the spawn error.
        reason: String,
    },
}

/// Shorthand for this crate's results.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;

/// A ggml tensor type: every type id ggml defines, so that a file with types this crate does not
/// dequantize still opens (its bytes are sized from the block layout).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(missing_docs, non_camel_case_types)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
}

/// (type, ggml id, elements per block, bytes per block), from ggml.c's type_traits.
const GGML_TYPES: [(GgmlType, u32, usize, usize); 32] = {
    use GgmlType::*;
    [
        (F32, 0, 1, 4),
        (F16, 1, 1, 2),
        (Q4_0, 2, 32, 18),
        (Q4_1, 3, 32, 20),
        (Q5_0, 6, 32, 22),
        (Q5_1, 7, 32, 24),
        (Q8_0, 8, 32, 34),
        (Q8_1, 9, 32, 36),
        (Q2_K, 10, 256, 84),
        (Q3_K, 11, 256, 110),
        (Q4_K, 12, 256, 144),
        (Q5_K, 13, 256, 176),
        (Q6_K, 14, 256, 210),
        (Q8_K, 15, 256, 292),
        (IQ2_XXS, 16, 256, 66),
        (IQ2_XS, 17, 256, 74),
        (IQ3_XXS, 18, 256, 98),
        (IQ1_S, 19, 256, 50),
        (IQ4_NL, 20, 32, 18),
        (IQ3_S, 21, 256, 110),
        (IQ2_S, 22, 256, 82),
        (IQ4_XS, 23, 256, 136),
        (I8, 24, 1, 1),
        (I16, 25, 1, 2),
        (I32, 26, 1, 4),
        (I64, 27, 1, 8),
        (F64, 28, 1, 8),
        (IQ1_M, 29, 256, 56),
        (BF16, 30, 1, 2),
        (TQ1_0, 34, 256, 54),
        (TQ2_0, 35, 256, 66),
        (MXFP4, 39, 32, 17),
    ]
};

impl GgmlType {
    /// The type with ggml id `id`, if ggml defines one.
    pub fn from_id(id: u32) -> Option<Self> {
        GGML_TYPES.iter().find(|t| t.1 == id).map(|t| t.0)
    }

    fn traits(self) -> (GgmlType, u32, usize, usize) {
        *GGML_TYPES
            .iter()
            .find(|t| t.0 == self)
            .expect("every GgmlType is in GGML_TYPES")
    }

    /// ggml's id for the type, as stored in the file.
    pub fn id(self) -> u32 {
        self.traits().1
    }

    /// Elements per block (1 for the plain types).
    pub fn block_size(self) -> usize {
        self.traits().2
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        self.traits().3
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// A metadata value, one variant per GGUF value type.
#[derive(Clone, Debug, PartialEq)]
#[allow(missing_docs)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    /// Elements all of one type (`element_type`, kept so that an empty array writes back as read).
    Array {
        element_type: u32,
        values: Vec<Value>,
    },
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    /// GGUF's value type id.
    pub fn type_id(&self) -> u32 {
        match self {
            Value::U8(_) => 0,
            Value::I8(_) => 1,
            Value::U16(_) => 2,
            Value::I16(_) => 3,
            Value::U32(_) => 4,
            Value::I32(_) => 5,
            Value::F32(_) => 6,
            Value::Bool(_) => 7,
            Value::String(_) => 8,
            Value::Array { .. } => 9,
            Value::U64(_) => 10,
            Value::I64(_) => 11,
            Value::F64(_) => 12,
        }
    }

    /// The type's name, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "u8",
            Value::I8(_) => "i8",
            Value::U16(_) => "u16",
            Value::I16(_) => "i16",
            Value::U32(_) => "u32",
            Value::I32(_) => "i32",
            Value::F32(_) => "f32",
            Value::Bool(_) => "bool",
            Value::String(_) => "string",
            Value::Array { .. } => "array",
            Value::U64(_) => "u64",
            Value::I64(_) => "i64",
            Value::F64(_) => "f64",
        }
    }

    /// An array of strings.
    pub fn strings<S: Into<String>>(values: impl IntoIterator<Item = S>) -> Value {
        Value::Array {
            element_type: 8,
            values: values
                .into_iter()
                .map(|s| Value::String(s.into()))
                .collect(),
        }
    }

    /// An array of i32.
    pub fn i32s(values: impl IntoIterator<Item = i32>) -> Value {
        Value::Array {
            element_type: 5,
            values: values.into_iter().map(Value::I32).collect(),
        }
    }

    /// An array of u32.
    pub fn u32s(values: impl IntoIterator<Item = u32>) -> Value {
        Value::Array {
            element_type: 4,
            values: values.into_iter().map(Value::U32).collect(),
        }
    }

    /// Any integer as i128, so that one range check serves every integer width.
    fn as_integer(&self) -> Option<i128> {
        Some(match *self {
            Value::U8(v) => v.into(),
            Value::I8(v) => v.into(),
            Value::U16(v) => v.into(),
            Value::I16(v) => v.into(),
            Value::U32(v) => v.into(),
            Value::I32(v) => v.into(),
            Value::U64(v) => v.into(),
            Value::I64(v) => v.into(),
            _ => return None,
        })
    }
}

impl From<u32> for Value {
    fn from(v: u32) -> Self {
        Value::U32(v)
    }
}
impl From<i32> for Value {
    fn from(v: i32) -> Self {
        Value::I32(v)
    }
}
impl From<u64> for Value {
    fn from(v: u64) -> Self {
        Value::U64(v)
    }
}
impl From<f32> for Value {
    fn from(v: f32) -> Self {
        Value::F32(v)
    }
}
impl From<bool> for Value {
    fn from(v: bool) -> Self {
        Value::Bool(v)
    }
}
impl From<&str> for Value {
    fn from(v: &str) -> Self {
        Value::String(v.to_owned())
    }
}
impl From<String> for Value {
    fn from(v: String) -> Self {
        Value::String(v)
    }
}

/// One entry of the tensor directory.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    /// The tensor's name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Row-major shape, outermost first (the GGUF dims reversed): `[rows, cols]` for a matrix.
    pub shape: Vec<usize>,
    /// How the elements are stored.
    pub ggml_type: GgmlType,
    /// Byte offset of the data in the file.
    pub file_offset: usize,
    /// Bytes of data.
    pub size: usize,
}

impl TensorInfo {
    /// The number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the tensor has no elements (never true for a tensor read from a file).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A tensor converted to f32.
#[derive(Clone, Debug, PartialEq)]
pub struct Dequantized {
    /// Row-major shape, outermost first (the GGUF dims reversed).
    pub shape: Vec<usize>,
    /// The elements, row-major.
    pub data: Vec<f32>,
}

/// An open GGUF file: metadata and tensor directory parsed, tensor data read on demand.
pub struct Gguf {
    bytes: Vec<u8>,
    metadata: Vec<(String, Value)>,
    metadata_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: usize,
}

impl fmt::Debug for Gguf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gguf")
            .field("bytes", &self.bytes.len())
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .finish()
    }
}

impl Gguf {
    /// Reads and parses the file at `path`; errors name the path.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| ModelError::Io {
            path: path.to_owned(),
            source,
        })?;
        Self::from_bytes(bytes).map_err(|e| ModelError::InFile {
            path: path.to_owned(),
            source: Box::new(e),
        })
    }

    /// Parses a whole GGUF file held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self> {
        let mut r = Reader {
            bytes: &bytes,
            pos: 0,
        };
        let magic = r.take(4, "magic").map_err(|_| ModelError::BadMagic {
            found: bytes[..bytes.len().min(4)].to_vec(),
        })?;
        if magic != MAGIC {
            return Err(ModelError::BadMagic {
                found: magic.to_vec(),
            });
        }
        let version = r.u32("version")?;
        if version != VERSION {
            return Err(ModelError::UnsupportedVersion { version });
        }
        let tensor_count = r.u64("tensor count")?;
        let kv_count = r.u64("metadata count")?;

        // Counts come from the file: capacity is bounded by what the remaining bytes could hold.
        let mut metadata = Vec::with_capacity(r.bounded(kv_count, 13));
        let mut metadata_index = HashMap::new();
        for i in 0..kv_count {
            let key = r.string(&format!("metadata key #{i}"))?;
            let value_type = r.u32(&format!("type of {key:?}"))?;
            let value = r.value(&key, value_type, 0)?;
            if metadata_index.insert(key.clone(), metadata.len()).is_some() {
                return Err(ModelError::DuplicateKey { key });
            }
            metadata.push((key, value));
        }
        let alignment = match metadata_index
            .get("general.alignment")
            .map(|&i| &metadata[i].1)
        {
            None => DEFAULT_ALIGNMENT,
            Some(v) => {
                let a = v.as_integer().ok_or_else(|| ModelError::WrongType {
                    key: "general.alignment".into(),
                    expected: "u32",
                    found: v.type_name().into(),
                })?;
                if a <= 0 || a > u32::MAX as i128 || !(a as u64).is_power_of_two() {
                    return Err(ModelError::BadAlignment {
                        alignment: a.max(0) as u64,
                    });
                }
                a as usize
            }
        };

        // (info, offset relative to the data section) until the data section's start is known.
        let mut directory = Vec::with_capacity(r.bounded(tensor_count, 24));
        for i in 0..tensor_count {
            let name = r.string(&format!("tensor name #{i}"))?;
            let n_dims = r.u32(&format!("dims count of tensor {name:?}"))? as usize;
            if n_dims > MAX_DIMS {
                return Err(ModelError::TooManyDims {
                    name,
                    n_dims,
                    max: MAX_DIMS,
                });
            }
            let mut dims = Vec::with_capacity(n_dims);
            for _ in 0..n_dims {
                dims.push(r.u64(&format!("dims of tensor {name:?}"))?);
            }
            let type_id = r.u32(&format!("type of tensor {name:?}"))?;
            let ggml_type =
                GgmlType::from_id(type_id).ok_or_else(|| ModelError::UnknownTensorType {
                    tensor: name.clone(),
                    ggml_type: type_id,
                })?;
            let offset = r.u64(&format!("offset of tensor {name:?}"))?;
            let (shape, size) = tensor_layout(&name, &dims, ggml_type)?;
            let info = TensorInfo {
                name,
                shape,
                ggml_type,
                file_offset: 0,
                size,
            };
            directory.push((info, offset));
        }

        let data_start = align_up(r.pos, alignment);
        let data_len = bytes.len().saturating_sub(data_start);
        let mut tensors = Vec::with_capacity(directory.len());
        let mut tensor_index = HashMap::new();
        for (mut info, offset) in directory {
            let in_bounds = usize::try_from(offset)
                .ok()
                .filter(|&o| o % alignment == 0)
                .filter(|&o| o.checked_add(info.size).is_some_and(|end| end <= data_len));
            let Some(offset) = in_bounds else {
                return Err(ModelError::BadTensorOffset {
                    name: info.name,
                    offset,
                    size: info.size,
                    data_len,
                    alignment,
                });
            };
            info.file_offset = data_start + offset;
            if tensor_index
                .insert(info.name.clone(), tensors.len())
                .is_some()
            {
                return Err(ModelError::DuplicateTensor { name: info.name });
            }
            tensors.push(info);
        }
        Ok(Gguf {
            bytes,
            metadata,
            metadata_index,
            tensors,
            tensor_index,
            alignment,
        })
    }

    /// The alignment of tensor data in this file.
    pub fn alignment(&self) -> usize {
        self.alignment
    }

    /// Metadata keys in file order.
    pub fn metadata_keys(&self) -> impl Iterator<Item = &str> {
        self.metadata.iter().map(|(k, _)| k.as_str())
    }

    /// The value of `key`, if present.
    pub fn value(&self, key: &str) -> Option<&Value> {
        self.metadata_index.get(key).map(|&i| &self.metadata[i].1)
    }

    fn require(&self, key: &str) -> Result<&Value> {
        self.value(key)
            .ok_or_else(|| ModelError::MissingKey { key: key.into() })
    }

    /// An integer value that fits in u32 (any integer type in the file).
    pub fn u32(&self, key: &str) -> Result<u32> {
        integer(key, self.require(key)?, "u32")
    }

    /// An integer value that fits in u64 (any integer type in the file).
    pub fn u64(&self, key: &str) -> Result<u64> {
        integer(key, self.require(key)?, "u64")
    }

    /// A float value (f32, or f64 narrowed).
    pub fn f32(&self, key: &str) -> Result<f32> {
        match *self.require(key)? {
            Value::F32(v) => Ok(v),
            Value::F64(v) => Ok(v as f32),
            ref v => Err(wrong_type(key, "f32", v)),
        }
    }

    /// A bool value.
    pub fn bool(&self, key: &str) -> Result<bool> {
        match *self.require(key)? {
            Value::Bool(v) => Ok(v),
            ref v => Err(wrong_type(key, "bool", v)),
        }
    }

    /// A string value.
    pub fn str(&self, key: &str) -> Result<&str> {
        match self.require(key)? {
            Value::String(s) => Ok(s),
            v => Err(wrong_type(key, "string", v)),
        }
    }

    fn array(&self, key: &str, expected: &'static str) -> Result<&[Value]> {
        match self.require(key)? {
            Value::Array { values, .. } => Ok(values),
            v => Err(wrong_type(key, expected, v)),
        }
    }

    /// An array of strings.
    pub fn str_array(&self, key: &str) -> Result<Vec<&str>> {
        let expected = "array of string";
        self.array(key, expected)?
            .iter()
            .map(|v| match v {
                Value::String(s) => Ok(s.as_str()),
                v => Err(wrong_type(key, expected, v)),
            })
            .collect()
    }

    /// An array of integers that all fit in i32.
    pub fn i32_array(&self, key: &str) -> Result<Vec<i32>> {
        let array = self.array(key, "array of i32")?;
        array
            .iter()
            .map(|v| integer(key, v, "array of i32"))
            .collect()
    }

    /// An array of integers that all fit in u32.
    pub fn u32_array(&self, key: &str) -> Result<Vec<u32>> {
        let array = self.array(key, "array of u32")?;
        array
            .iter()
            .map(|v| integer(key, v, "array of u32"))
            .collect()
    }

    /// Tensor names in file order.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.tensors.iter().map(|t| t.name.as_str())
    }

    /// The directory entries in file order.
    pub fn tensor_infos(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The directory entry of tensor `name`.
    pub fn tensor_info(&self, name: &str) -> Result<&TensorInfo> {
        self.tensor_index
            .get(name)
            .map(|&i| &self.tensors[i])
            .ok_or_else(|| ModelError::MissingTensor { name: name.into() })
    }

    /// The stored bytes of tensor `name` (quantized blocks as in the file).
    pub fn tensor_bytes(&self, name: &str) -> Result<&[u8]> {
        let info = self.tensor_info(name)?;
        Ok(&self.bytes[info.file_offset..info.file_offset + info.size])
    }

    /// Tensor `name` converted to f32 (F32, F16, BF16, Q8_0 and Q4_1).
    pub fn tensor(&self, name: &str) -> Result<Dequantized> {
        let info = self.tensor_info(name)?;
        let bytes = self.tensor_bytes(name)?;
        let data =
            dequantize(bytes, info.ggml_type).ok_or_else(|| ModelError::UnsupportedTensorType {
                tensor: name.into(),
                ggml_type: info.ggml_type,
            })?;
        Ok(Dequantized {
            shape: info.shape.clone(),
            data,
        })
    }
}

fn wrong_type(key: &str, expected: &'static str, found: &Value) -> ModelError {
    ModelError::WrongType {
        key: key.into(),
        expected,
        found: found.type_name().into(),
    }
}

fn integer<T: TryFrom<i128>>(key: &str, value: &Value, expected: &'static str) -> Result<T> {
    let v = value
        .as_integer()
        .ok_or_else(|| wrong_type(key, expected, value))?;
    T::try_from(v).map_err(|_| ModelError::WrongType {
        key: key.into(),
        expected,
        found: format!("{} {v} (out of range)", value.type_name()),
    })
}

fn align_up(pos: usize, alignment: usize) -> usize {
    pos.div_ceil(alignment) * alignment
}

/// Row-major shape and byte size of a tensor, or why it cannot be stored.
fn tensor_layout(name: &str, dims: &[u64], ggml_type: GgmlType) -> Result<(Vec<usize>, usize)> {
    let bad = |reason| ModelError::BadShape {
        name: name.into(),
        dims: dims.to_vec(),
        ggml_type,
        reason,
    };
    if dims.is_empty() || dims.len() > MAX_DIMS {
        return Err(bad("a tensor has 1 to 4 dimensions"));
    }
    let mut shape = Vec::with_capacity(dims.len());
    for &d in dims.iter().rev() {
        shape.push(usize::try_from(d).map_err(|_| bad("a dimension overflows usize"))?);
    }
    let len = shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| bad("the element count overflows usize"))?;
    if len == 0 {
        return Err(bad("a dimension is zero"));
    }
    let row = *shape.last().expect("shape is not empty");
    if row % ggml_type.block_size() != 0 {
        return Err(bad(
            "the innermost dimension is not a multiple of the block size",
        ));
    }
    let size = (len / ggml_type.block_size())
        .checked_mul(ggml_type.type_size())
        .ok_or_else(|| bad("the byte size overflows usize"))?;
    Ok((shape, size))
}

/// A cursor over the file that turns every short read into [`ModelError::Truncated`].
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&end| end <= self.bytes.len());
        let Some(end) = end else {
            return Err(ModelError::Truncated {
                what: what.into(),
                offset: self.pos,
                needed: n,
                len: self.bytes.len(),
            });
        };
        let out = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        Ok(self
            .take(N, what)?
            .try_into()
            .expect("take returned N bytes"))
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A capacity for `count` items of at least `min_size` bytes each that the rest could hold.
    fn bounded(&self, count: u64, min_size: usize) -> usize {
        let rest = (self.bytes.len() - self.pos) / min_size;
        usize::try_from(count).unwrap_or(usize::MAX).min(rest)
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(&format!("length of {what}"))?;
        let offset = self.pos;
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| ModelError::BadUtf8 {
            what: what.into(),
            offset,
        })
    }

    fn value(&mut self, key: &str, value_type: u32, depth: usize) -> Result<Value> {
        let what = || format!("value of {key:?}");
        Ok(match value_type {
            0 => Value::U8(self.array::<1>(&what())?[0]),
            1 => Value::I8(i8::from_le_bytes(self.array(&what())?)),
            2 => Value::U16(u16::from_le_bytes(self.array(&what())?)),
            3 => Value::I16(i16::from_le_bytes(self.array(&what())?)),
            4 => Value::U32(self.u32(&what())?),
            5 => Value::I32(i32::from_le_bytes(self.array(&what())?)),
            6 => Value::F32(f32::from_le_bytes(self.array(&what())?)),
            7 => Value::Bool(self.array::<1>(&what())?[0] != 0),
            8 => Value::String(self.string(&what())?),
            9 => {
                if depth >= MAX_ARRAY_NESTING {
                    return Err(ModelError::NestingTooDeep {
                        key: key.into(),
                        max: MAX_ARRAY_NESTING,
                    });
                }
                let element_type = self.u32(&format!("element type of {key:?}"))?;
                let count = self.u64(&format!("element count of {key:?}"))?;
                let mut values = Vec::with_capacity(self.bounded(count, 1));
                for _ in 0..count {
                    values.push(self.value(key, element_type, depth + 1)?);
                }
                Value::Array {
                    element_type,
                    values,
                }
            }
            10 => Value::U64(self.u64(&what())?),
            11 => Value::I64(i64::from_le_bytes(self.array(&what())?)),
            12 => Value::F64(f64::from_le_bytes(self.array(&what())?)),
            _ => {
                return Err(ModelError::UnknownValueType {
                    key: key.into(),
                    value_type,
                });
            }
        })
    }
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// f32 values of `bytes` stored as `ggml_type`; `None` for a type this crate does not decode.
/// `bytes` is a whole number of blocks (the reader sized it so).
pub fn dequantize(bytes: &[u8], ggml_type: GgmlType) -> Option<Vec<f32>> {
    Some(match ggml_type {
        GgmlType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        GgmlType::F16 => bytes.chunks_exact(2).map(|c| f16_at(c, 0)).collect(),
        GgmlType::BF16 => bytes
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        // block_q8_0: f16 d, i8 qs[32]; x = d * q.
        GgmlType::Q8_0 => {
            let mut out = Vec::with_capacity(bytes.len() / 34 * QK);
            for block in bytes.chunks_exact(34) {
                let d = f16_at(block, 0);
                out.extend(block[2..].iter().map(|&q| d * f32::from(q as i8)));
            }
            out
        }
        // block_q4_1: f16 d, f16 m, u8 qs[16]; low nibbles are x[0..16], high nibbles x[16..32].
        GgmlType::Q4_1 => {
            let mut out = Vec::with_capacity(bytes.len() / 20 * QK);
            for block in bytes.chunks_exact(20) {
                let (d, m) = (f16_at(block, 0), f16_at(block, 2));
                let qs = &block[4..];
                out.extend(qs.iter().map(|&q| d * f32::from(q & 0x0f) + m));
                out.extend(qs.iter().map(|&q| d * f32::from(q >> 4) + m));
            }
            out
        }
        _ => return None,
    })
}

/// Stores `values` as `ggml_type` the way ggml's reference quantizers do
/// (`quantize_row_q8_0_ref`, `quantize_row_q4_1_ref`); `None` for a type this crate does not
/// encode or a length that is not a whole number of blocks.
pub fn quantize(values: &[f32], ggml_type: GgmlType) -> Option<Vec<u8>> {
    if values.len() % ggml_type.block_size() != 0 {
        return None;
    }
    let mut out = Vec::with_capacity(values.len() / ggml_type.block_size() * ggml_type.type_size());
    match ggml_type {
        GgmlType::F32 => values.iter().for_each(|v| out.extend(v.to_le_bytes())),
        GgmlType::F16 => values
            .iter()
            .for_each(|&v| out.extend(f16::from_f32(v).to_le_bytes())),
        GgmlType::BF16 => values
            .iter()
            .for_each(|&v| out.extend(bf16::from_f32(v).to_le_bytes())),
        GgmlType::Q8_0 => {
            for x in values.chunks_exact(QK) {
                let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
                let d = amax / 127.0;
                // ggml scales by the f32 d, not its f16 rounding.
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16::from_f32(d).to_le_bytes());
                out.extend(x.iter().map(|v| (v * id).round() as i8 as u8));
            }
        }
        GgmlType::Q4_1 => {
            for x in values.chunks_exact(QK) {
                let min = x.iter().fold(f32::MAX, |a, &v| a.min(v));
                let max = x.iter().fold(-f32::MAX, |a, &v| a.max(v));
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16::from_f32(d).to_le_bytes());
                out.extend(f16::from_f32(min).to_le_bytes());
                // ggml's `MIN(15, (int8_t)(x + 0.5f))`: truncation of a non-negative value.
                let q = |v: f32| (((v - min) * id + 0.5) as i8).min(15) as u8;
                out.extend((0..QK / 2).map(|j| q(x[j]) | (q(x[j + QK / 2]) << 4)));
            }
        }
        _ => return None,
    }
    Some(out)
}

/// Builds a GGUF v3 file: metadata in insertion order, then tensors quantized from f32.
///
/// ```
/// use kvplan_decoder::gguf::{Gguf, GgmlType, GgufWriter};
/// let mut w = GgufWriter::new();
/// w.metadata("general.architecture", "llama");
/// w.tensor("w", &[2, 32], &vec![0.5; 64], GgmlType::Q8_0).unwrap();
/// let g = Gguf::from_bytes(w.to_bytes()).unwrap();
/// assert_eq!(g.str("general.architecture").unwrap(), "llama");
/// let w = g.tensor("w").unwrap();
/// assert_eq!(w.shape, [2, 32]);
/// assert!(w.data.iter().all(|v| (v - 0.5).abs() < 1e-3)); // 8-bit: close, not exact
/// ```
#[derive(Clone, Debug, Default)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    tensors: Vec<(String, Vec<usize>, GgmlType, Vec<u8>)>,
}

impl GgufWriter {
    /// An empty file.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) metadata `key`.
    pub fn metadata(&mut self, key: &str, value: impl Into<Value>) -> &mut Self {
        let value = value.into();
        match self.metadata.iter_mut().find(|(k, _)| k == key) {
            Some(entry) => entry.1 = value,
            None => self.metadata.push((key.into(), value)),
        }
        self
    }

    /// Adds tensor `name` of row-major `shape` (outermost first), stored as `ggml_type`
    /// (F32, F16, BF16, Q8_0 or Q4_1; the innermost dimension a multiple of the block size).
    pub fn tensor(
        &mut self,
        name: &str,
        shape: &[usize],
        data: &[f32],
        ggml_type: GgmlType,
    ) -> Result<&mut Self> {
        let dims: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
        let (_, _) = tensor_layout(name, &dims, ggml_type)?;
        let expected = shape.iter().product();
        if data.len() != expected {
            return Err(ModelError::DataLength {
                name: name.into(),
                shape: shape.to_vec(),
                expected,
                got: data.len(),
            });
        }
        if self.tensors.iter().any(|t| t.0 == name) {
            return Err(ModelError::DuplicateTensor { name: name.into() });
        }
        let bytes = quantize(data, ggml_type).ok_or_else(|| ModelError::UnsupportedTensorType {
            tensor: name.into(),
            ggml_type,
        })?;
        self.tensors
            .push((name.into(), shape.to_vec(), ggml_type, bytes));
        Ok(self)
    }

    /// The file's bytes (alignment 32).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend(MAGIC);
        out.extend(VERSION.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            write_string(&mut out, key);
            out.extend(value.type_id().to_le_bytes());
            write_value(&mut out, value);
        }
        let mut offset = 0;
        for (name, shape, ggml_type, bytes) in &self.tensors {
            write_string(&mut out, name);
            out.extend((shape.len() as u32).to_le_bytes());
            shape
                .iter()
                .rev()
                .for_each(|&d| out.extend((d as u64).to_le_bytes()));
            out.extend(ggml_type.id().to_le_bytes());
            out.extend((offset as u64).to_le_bytes());
            offset = align_up(offset + bytes.len(), DEFAULT_ALIGNMENT);
        }
        for (_, _, _, bytes) in &self.tensors {
            out.resize(align_up(out.len(), DEFAULT_ALIGNMENT), 0);
            out.extend(bytes);
        }
        out
    }

    /// Writes the file to `path`.
    pub fn write(&self, path: &Path) -> Result<()> {
        std::fs::write(path, self.to_bytes()).map_err(|source| ModelError::Io {
            path: path.to_owned(),
            source,
        })
    }
}

fn write_string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

fn write_value(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::U8(v) => out.push(*v),
        Value::I8(v) => out.extend(v.to_le_bytes()),
        Value::U16(v) => out.extend(v.to_le_bytes()),
        Value::I16(v) => out.extend(v.to_le_bytes()),
        Value::U32(v) => out.extend(v.to_le_bytes()),
        Value::I32(v) => out.extend(v.to_le_bytes()),
        Value::F32(v) => out.extend(v.to_le_bytes()),
        Value::Bool(v) => out.push(u8::from(*v)),
        Value::String(s) => write_string(out, s),
        Value::Array {
            element_type,
            values,
        } => {
            out.extend(element_type.to_le_bytes());
            out.extend((values.len() as u64).to_le_bytes());
            values.iter().for_each(|v| write_value(out, v));
        }
        Value::U64(v) => out.extend(v.to_le_bytes()),
        Value::I64(v) => out.extend(v.to_le_bytes()),
        Value::F64(v) => out.extend(v.to_le_bytes()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Exactly representable inputs (so numpy and Rust see the same f32s): 2 rows of 64.
    fn probe_values() -> Vec<f32> {
        let mut x: Vec<f32> = (0..128)
            .map(|i| ((i * 37) % 101 - 50) as f32 / 16.0)
            .collect();
        x[64..].iter_mut().for_each(|v| *v *= 0.3);
        x
    }

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    /// Deterministic values with a spread of magnitudes and signs.
    fn wavy(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let t = (i as f32 + seed as f32 * 0.37) * 0.731;
                t.sin() * (1.0 + (i % 7) as f32) + if i % 13 == 0 { 3.0 } else { 0.0 }
            })
            .collect()
    }

    fn round_trip(values: &[f32], shape: &[usize], ggml_type: GgmlType) -> (Gguf, Dequantized) {
        let mut w = GgufWriter::new();
        w.tensor("t", shape, values, ggml_type).unwrap();
        let g = Gguf::from_bytes(w.to_bytes()).unwrap();
        let d = g.tensor("t").unwrap();
        assert_eq!(d.shape, shape);
        assert_eq!(g.tensor_info("t").unwrap().ggml_type, ggml_type);
        (g, d)
    }

    #[test]
    fn quantizers_match_python_gguf_bytes() {
        // gguf-py 0.19 `gguf.quants.quantize(x, Q8_0 / Q4_1)` of probe_values(), shape (2, 64).
        let q8_0 = "4d2681df3d9af856b41270cd2b89e745a2005ebb1977d53390ee4caa0866c3217fdc2c263c96f656\
                    b0106fca2984e3439efd5db71777d1318beb4ba50565bf1f7fd93993681ff353ad0d6dc72781e141\
                    9bfb5bb51575cf2f89e949a30362bd1d7cd73691f0508f1fac0a68c62481df3d9af856b41270cd2b\
                    89e745a2005ebb1977d53390ee4caa08";
        let q4_1 = "ab3640c2d0369bf257bd1369ce258ae0469cf258773600c29bf157ad0368ce248ad0469bf257bd13\
                    c32f5abb57ad0368ce248ad0469bf257bd1379cfc32f80bb0368ce248ad0469bf257bd1379cf258a";
        let x = probe_values();
        assert_eq!(quantize(&x, GgmlType::Q8_0).unwrap(), hex(q8_0));
        assert_eq!(quantize(&x, GgmlType::Q4_1).unwrap(), hex(q4_1));
        // And gguf-py's dequantization of those bytes.
        let d8 = dequantize(&hex(q8_0), GgmlType::Q8_0).unwrap();
        assert_eq!(
            &d8[..4],
            &[
                -3.1257781982421875,
                -0.8122100830078125,
                1.5013580322265625,
                -2.510467529296875
            ]
        );
        assert_eq!(d8[127], 0.059051513671875);
        let d4 = dequantize(&hex(q4_1), GgmlType::Q4_1).unwrap();
        assert_eq!(
            &d4[..4],
            &[-3.125, -0.62451171875, 1.459228515625, -2.29150390625]
        );
        assert_eq!(d4[127], 0.03271484375);
    }

    #[test]
    fn plain_types_round_trip() {
        let x = wavy(96, 1);
        assert_eq!(round_trip(&x, &[3, 32], GgmlType::F32).1.data, x);
        let f16s: Vec<f32> = x.iter().map(|&v| f16::from_f32(v).to_f32()).collect();
        assert_eq!(round_trip(&x, &[2, 3, 16], GgmlType::F16).1.data, f16s);
        let bf16s: Vec<f32> = x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
        assert_eq!(round_trip(&x, &[96], GgmlType::BF16).1.data, bf16s);
        // Values the narrow types hold exactly come back unchanged.
        assert_eq!(round_trip(&f16s, &[96], GgmlType::F16).1.data, f16s);
        assert_eq!(round_trip(&bf16s, &[96], GgmlType::BF16).1.data, bf16s);
    }

    #[test]
    fn q8_0_round_trip() {
        // On the grid d = 1/16 with ±127 in every block, Q8_0 is lossless.
        let grid: Vec<f32> = (0..128)
            .map(|i| match i % 32 {
                0 => 127.0,
                1 => -127.0,
                j => ((j * 11 + i / 32) % 255) as f32 - 127.0,
            } / 16.0)
            .collect();
        assert_eq!(round_trip(&grid, &[4, 32], GgmlType::Q8_0).1.data, grid);

        let x = wavy(256, 2);
        let (g, d) = round_trip(&x, &[4, 64], GgmlType::Q8_0);
        let bytes = g.tensor_bytes("t").unwrap();
        assert_eq!(bytes.len(), 8 * 34);
        let blocks = bytes.chunks(34).zip(d.data.chunks(32).zip(x.chunks(32)));
        for (b, (block, (got, want))) in blocks.enumerate() {
            let scale = f16::from_le_bytes([block[0], block[1]]).to_f32();
            let amax = want.iter().fold(0f32, |a, v| a.max(v.abs()));
            assert_eq!(scale, f16::from_f32(amax / 127.0).to_f32(), "block {b}");
            // The ggml formula on the stored bytes, and the error bound of rounding.
            for (j, (&got, &want)) in got.iter().zip(want).enumerate() {
                let q = block[2 + j] as i8;
                assert_eq!(got, scale * f32::from(q), "block {b} elem {j}");
                assert!((want - got).abs() <= scale * 0.57, "block {b} elem {j}");
            }
        }
    }

    #[test]
    fn q4_1_round_trip() {
        // On the grid m = -1, d = 1/8 with 0 and 15 in every block, Q4_1 is lossless.
        let grid: Vec<f32> = (0..128)
            .map(|i| match i % 32 {
                0 => 0,
                1 => 15,
                j => (j * 7 + i / 32) % 16,
            } as f32 / 8.0 - 1.0)
            .collect();
        assert_eq!(round_trip(&grid, &[2, 64], GgmlType::Q4_1).1.data, grid);

        let x = wavy(256, 3);
        let (g, d) = round_trip(&x, &[8, 32], GgmlType::Q4_1);
        let bytes = g.tensor_bytes("t").unwrap();
        assert_eq!(bytes.len(), 8 * 20);
        for (b, block) in bytes.chunks(20).enumerate() {
            let xs = &x[b * 32..][..32];
            let scale = f16::from_le_bytes([block[0], block[1]]).to_f32();
            let min = f16::from_le_bytes([block[2], block[3]]).to_f32();
            let (lo, hi) = xs
                .iter()
                .fold((f32::MAX, -f32::MAX), |(l, h), &v| (l.min(v), h.max(v)));
            assert_eq!(min, f16::from_f32(lo).to_f32(), "block {b}");
            assert_eq!(scale, f16::from_f32((hi - lo) / 15.0).to_f32(), "block {b}");
            for j in 0..16 {
                let q = block[4 + j];
                let (x0, x1) = (d.data[b * 32 + j], d.data[b * 32 + j + 16]);
                assert_eq!(x0, scale * f32::from(q & 15) + min, "block {b} elem {j}");
                assert_eq!(
                    x1,
                    scale * f32::from(q >> 4) + min,
                    "block {b} elem {}",
                    j + 16
                );
                let bound = scale * 0.52 + lo.abs() * 1e-3;
                assert!((xs[j] - x0).abs() <= bound && (xs[j + 16] - x1).abs() <= bound);
            }
        }
    }

    #[test]
    fn constant_blocks_quantize_to_their_value() {
        // d = 0: ggml stores q = 0 (Q8_0, so the block is 0) or the minimum itself (Q4_1).
        let zeros = vec![0.0; 32];
        assert_eq!(round_trip(&zeros, &[32], GgmlType::Q8_0).1.data, zeros);
        let twos = vec![2.0; 32];
        assert_eq!(round_trip(&twos, &[32], GgmlType::Q4_1).1.data, twos);
    }

    #[test]
    fn metadata_round_trip() {
        let nested = Value::Array {
            element_type: 9,
            values: vec![Value::u32s([1, 2]), Value::u32s([])],
        };
        let mut w = GgufWriter::new();
        w.metadata("u8", Value::U8(200))
            .metadata("i8", Value::I8(-5))
            .metadata("u16", Value::U16(60_000))
            .metadata("i16", Value::I16(-30_000))
            .metadata("u32", 4_000_000_000u32)
            .metadata("i32", -7i32)
            .metadata("f32", 1e-5f32)
            .metadata("bool", true)
            .metadata("str", "café 東京")
            .metadata("u64", u64::MAX)
            .metadata("i64", Value::I64(-1))
            .metadata("f64", Value::F64(0.1))
            .metadata("strs", Value::strings(["a", "", "Ġthe"]))
            .metadata("i32s", Value::i32s([1, -3, 3]))
            .metadata("empty", Value::strings(Vec::<String>::new()))
            .metadata("nested", nested.clone());
        w.metadata("i32", 7i32); // replaces, keeps the position
        let g = Gguf::from_bytes(w.to_bytes()).unwrap();
        let keys: Vec<_> = g.metadata_keys().collect();
        assert_eq!(keys[..6], ["u8", "i8", "u16", "i16", "u32", "i32"]);
        assert_eq!(keys.len(), 16);
        assert_eq!(g.u32("u8").unwrap(), 200);
        assert_eq!(g.u32("u16").unwrap(), 60_000);
        assert_eq!(g.u32("u32").unwrap(), 4_000_000_000);
        assert_eq!(g.u32("i32").unwrap(), 7);
        assert_eq!(g.u64("u64").unwrap(), u64::MAX);
        assert_eq!(g.value("i8"), Some(&Value::I8(-5)));
        assert_eq!(g.value("i16"), Some(&Value::I16(-30_000)));
        assert_eq!(g.value("i64"), Some(&Value::I64(-1)));
        assert_eq!(g.f32("f32").unwrap(), 1e-5);
        assert_eq!(g.f32("f64").unwrap(), 0.1f64 as f32);
        assert!(g.bool("bool").unwrap());
        assert_eq!(g.str("str").unwrap(), "café 東京");
        assert_eq!(g.str_array("strs").unwrap(), ["a", "", "Ġthe"]);
        assert_eq!(g.i32_array("i32s").unwrap(), [1, -3, 3]);
        assert_eq!(
            g.u32_array("i32s").unwrap_err().to_string(),
            "metadata key \"i32s\" is i32 -3 (out of range), expected array of u32"
        );
        assert!(g.str_array("empty").unwrap().is_empty());
        assert_eq!(g.value("nested"), Some(&nested));
        assert_eq!(g.tensor_names().count(), 0);

        // Errors name the key and what was found.
        let msg = |e: ModelError| e.to_string();
        assert_eq!(
            msg(g.u32("missing").unwrap_err()),
            "metadata key \"missing\" is missing"
        );
        assert_eq!(
            msg(g.u32("i8").unwrap_err()),
            "metadata key \"i8\" is i8 -5 (out of range), expected u32"
        );
        assert_eq!(
            msg(g.u32("u64").unwrap_err()),
            format!(
                "metadata key \"u64\" is u64 {} (out of range), expected u32",
                u64::MAX
            )
        );
        assert_eq!(
            msg(g.str("u32").unwrap_err()),
            "metadata key \"u32\" is u32, expected string"
        );
        assert_eq!(
            msg(g.f32("str").unwrap_err()),
            "metadata key \"str\" is string, expected f32"
        );
        assert_eq!(
            msg(g.bool("u8").unwrap_err()),
            "metadata key \"u8\" is u8, expected bool"
        );
        assert_eq!(
            msg(g.str_array("i32s").unwrap_err()),
            "metadata key \"i32s\" is i32, expected array of string"
        );
        assert_eq!(
            msg(g.i32_array("str").unwrap_err()),
            "metadata key \"str\" is string, expected array of i32"
        );
        assert!(matches!(g.tensor("w"), Err(ModelError::MissingTensor { name }) if name == "w"));
    }

    #[test]
    fn tensors_are_aligned_and_in_order() {
        let mut w = GgufWriter::new();
        w.metadata("general.architecture", "llama");
        w.tensor("a", &[3], &[1.0, 2.0, 3.0], GgmlType::F32)
            .unwrap();
        w.tensor("b", &[2, 32], &wavy(64, 4), GgmlType::Q4_1)
            .unwrap();
        w.tensor("c", &[1], &[0.5], GgmlType::F16).unwrap();
        let g = Gguf::from_bytes(w.to_bytes()).unwrap();
        assert_eq!(g.alignment(), 32);
        assert_eq!(g.tensor_names().collect::<Vec<_>>(), ["a", "b", "c"]);
        let infos = g.tensor_infos();
        assert!(infos.iter().all(|t| t.file_offset % 32 == 0));
        assert_eq!(
            infos.iter().map(|t| t.size).collect::<Vec<_>>(),
            [12, 40, 2]
        );
        assert_eq!(infos[1].file_offset - infos[0].file_offset, 32);
        assert_eq!(g.tensor("a").unwrap().data, [1.0, 2.0, 3.0]);
        assert_eq!(g.tensor("c").unwrap().data, [0.5]);
    }

    #[test]
    fn writer_refuses_bad_tensors() {
        let mut w = GgufWriter::new();
        let e = w
            .tensor("t", &[2, 3], &[0.0; 5], GgmlType::F32)
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "tensor \"t\" of shape [2, 3] needs 6 values, got 5"
        );
        let e = w
            .tensor("t", &[2, 16], &[0.0; 32], GgmlType::Q8_0)
            .unwrap_err();
        assert!(matches!(e, ModelError::BadShape { reason, .. } if reason.contains("block size")));
        let e = w
            .tensor("t", &[32], &[0.0; 32], GgmlType::Q6_K)
            .unwrap_err();
        assert!(matches!(e, ModelError::BadShape { .. })); // 32 is not a Q6_K block (256)
        let e = w
            .tensor("t", &[256], &[0.0; 256], GgmlType::Q6_K)
            .unwrap_err();
        assert!(matches!(
            e,
            ModelError::UnsupportedTensorType {
                ggml_type: GgmlType::Q6_K,
                ..
            }
        ));
        w.tensor("t", &[1], &[0.0], GgmlType::F32).unwrap();
        let e = w.tensor("t", &[1], &[0.0], GgmlType::F32).unwrap_err();
        assert!(matches!(e, ModelError::DuplicateTensor { name } if name == "t"));
    }

    /// A hand-built file: header, the given metadata entries and tensor entries, then `data`.
    fn raw_file(version: u32, kv: &[Vec<u8>], tensors: &[Vec<u8>], data: &[u8]) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(version.to_le_bytes());
        out.extend((tensors.len() as u64).to_le_bytes());
        out.extend((kv.len() as u64).to_le_bytes());
        kv.iter().chain(tensors).for_each(|e| out.extend(e));
        out.resize(align_up(out.len(), 32), 0);
        out.extend(data);
        out
    }

    fn kv(key: &str, value_type: u32, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        write_string(&mut out, key);
        out.extend(value_type.to_le_bytes());
        out.extend(payload);
        out
    }

    fn tensor_entry(name: &str, dims: &[u64], type_id: u32, offset: u64) -> Vec<u8> {
        let mut out = Vec::new();
        write_string(&mut out, name);
        out.extend((dims.len() as u32).to_le_bytes());
        dims.iter().for_each(|d| out.extend(d.to_le_bytes()));
        out.extend(type_id.to_le_bytes());
        out.extend(offset.to_le_bytes());
        out
    }

    fn open_err(bytes: Vec<u8>) -> ModelError {
        Gguf::from_bytes(bytes).expect_err("a malformed file must not open")
    }

    #[test]
    fn every_truncation_is_an_error() {
        let mut w = GgufWriter::new();
        w.metadata("general.architecture", "llama")
            .metadata("tokens", Value::strings(["a", "b"]));
        w.tensor("x", &[2, 32], &wavy(64, 5), GgmlType::Q8_0)
            .unwrap();
        w.tensor("y", &[4], &[1.0; 4], GgmlType::F32).unwrap();
        let bytes = w.to_bytes();
        Gguf::from_bytes(bytes.clone()).unwrap();
        for len in 0..bytes.len() {
            let e = open_err(bytes[..len].to_vec());
            assert!(
                matches!(
                    e,
                    ModelError::BadMagic { .. }
                        | ModelError::Truncated { .. }
                        | ModelError::BadTensorOffset { .. }
                ),
                "length {len}: {e}"
            );
        }
    }

    #[test]
    fn malformed_headers_are_errors() {
        assert!(
            matches!(open_err(b"GGML\x03\0\0\0".to_vec()), ModelError::BadMagic { found } if found == b"GGML")
        );
        assert!(matches!(
            open_err(raw_file(2, &[], &[], &[])),
            ModelError::UnsupportedVersion { version: 2 }
        ));

        // Counts far beyond the file: an error, not an allocation of 2^64 entries.
        let mut huge = b"GGUF\x03\0\0\0".to_vec();
        huge.extend(0u64.to_le_bytes());
        huge.extend(u64::MAX.to_le_bytes());
        assert!(matches!(open_err(huge), ModelError::Truncated { .. }));
        let mut long_string = Vec::new();
        long_string.extend(u64::MAX.to_le_bytes());
        let e = open_err(raw_file(3, &[kv("s", 8, &long_string)], &[], &[]));
        assert!(matches!(e, ModelError::Truncated { what, .. } if what == "value of \"s\""));
        let mut long_array = 4u32.to_le_bytes().to_vec();
        long_array.extend((u64::MAX / 2).to_le_bytes());
        assert!(matches!(
            open_err(raw_file(3, &[kv("a", 9, &long_array)], &[], &[])),
            ModelError::Truncated { .. }
        ));

        let e = open_err(raw_file(3, &[kv("k", 13, &[0; 8])], &[], &[]));
        assert!(matches!(e, ModelError::UnknownValueType { key, value_type: 13 } if key == "k"));
        let e = open_err(raw_file(
            3,
            &[kv("k", 8, b"\x02\0\0\0\0\0\0\0\xff\xfe")],
            &[],
            &[],
        ));
        assert!(matches!(e, ModelError::BadUtf8 { what, .. } if what == "value of \"k\""));
        let e = open_err(raw_file(
            3,
            &[kv("k", 4, &[1; 4]), kv("k", 4, &[2; 4])],
            &[],
            &[],
        ));
        assert!(matches!(e, ModelError::DuplicateKey { key } if key == "k"));
        let mut deep = Vec::new();
        for _ in 0..20 {
            deep.extend(9u32.to_le_bytes());
            deep.extend(1u64.to_le_bytes());
        }
        let e = open_err(raw_file(3, &[kv("deep", 9, &deep)], &[], &[]));
        assert!(matches!(e, ModelError::NestingTooDeep { key, .. } if key == "deep"));
        for alignment in [0u32, 3, 48] {
            let e = open_err(raw_file(
                3,
                &[kv("general.alignment", 4, &alignment.to_le_bytes())],
                &[],
                &[],
            ));
            assert!(
                matches!(e, ModelError::BadAlignment { alignment: a } if a == u64::from(alignment))
            );
        }
        let e = open_err(raw_file(
            3,
            &[kv("general.alignment", 8, b"\x01\0\0\0\0\0\0\0x")],
            &[],
            &[],
        ));
        assert!(matches!(e, ModelError::WrongType { key, .. } if key == "general.alignment"));
    }

    #[test]
    fn malformed_tensors_are_errors() {
        let data = vec![0u8; 256];
        let file = |entries: &[Vec<u8>]| raw_file(3, &[], entries, &data);
        let e = open_err(file(&[tensor_entry("t", &[4], 99, 0)]));
        assert!(
            matches!(e, ModelError::UnknownTensorType { tensor, ggml_type: 99 } if tensor == "t")
        );
        let e = open_err(file(&[tensor_entry("t", &[1, 1, 1, 1, 1], 0, 0)]));
        assert!(matches!(e, ModelError::TooManyDims { n_dims: 5, .. }));
        let e = open_err(file(&[tensor_entry("t", &[], 0, 0)]));
        assert!(matches!(e, ModelError::BadShape { .. }));
        let e = open_err(file(&[tensor_entry("t", &[4, 0], 0, 0)]));
        assert!(matches!(e, ModelError::BadShape { reason, .. } if reason.contains("zero")));
        let e = open_err(file(&[tensor_entry("t", &[u64::MAX, 4], 0, 0)]));
        assert!(matches!(e, ModelError::BadShape { .. }));
        let e = open_err(file(&[tensor_entry("t", &[16], 8, 0)]));
        assert!(matches!(e, ModelError::BadShape { reason, .. } if reason.contains("block size")));
        // 64 f32 = 256 bytes fit exactly at 0; one more element, or any other offset, does not.
        Gguf::from_bytes(file(&[tensor_entry("t", &[64], 0, 0)])).unwrap();
        for (dims, offset) in [([65u64], 0u64), ([64], 32), ([1], 16), ([1], u64::MAX - 31)] {
            let e = open_err(file(&[tensor_entry("t", &dims, 0, offset)]));
            assert!(
                matches!(e, ModelError::BadTensorOffset { ref name, .. } if name == "t"),
                "{dims:?} at {offset}: {e}"
            );
        }
        let e = open_err(file(&[
            tensor_entry("t", &[4], 0, 0),
            tensor_entry("t", &[4], 0, 32),
        ]));
        assert!(matches!(e, ModelError::DuplicateTensor { name } if name == "t"));

        // A type ggml defines but this crate does not decode: the file opens, the tensor errs.
        let g = Gguf::from_bytes(raw_file(
            3,
            &[],
            &[tensor_entry("k", &[256], 14, 0)],
            &[0; 210],
        ))
        .unwrap();
        assert_eq!(g.tensor_bytes("k").unwrap().len(), 210);
        let e = g.tensor("k").unwrap_err();
        assert_eq!(
            e.to_string(),
            "tensor \"k\" is Q6_K, which is not supported (F32, F16, BF16, Q8_0, Q4_1 are)"
        );
    }

    #[test]
    fn open_names_the_path() {
        let dir = std::env::temp_dir().join(format!("kvplan-gguf-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("bad.gguf");
        std::fs::write(&path, b"GGUF\x01\0\0\0").unwrap();
        let e = Gguf::open(&path).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "{}: GGUF version 1 is not supported (only version 3)",
                path.display()
            )
        );
        let missing = dir.join("missing.gguf");
        let e = Gguf::open(&missing).unwrap_err();
        assert!(
            matches!(&e, ModelError::Io { path, .. } if *path == missing),
            "{e}"
        );
        let mut w = GgufWriter::new();
        w.metadata("general.architecture", "llama");
        let good = dir.join("good.gguf");
        w.write(&good).unwrap();
        assert_eq!(
            Gguf::open(&good)
                .unwrap()
                .str("general.architecture")
                .unwrap(),
            "llama"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn smollm2_metadata() {
        let g = crate::model_file::smollm2_for_tests();
        assert_eq!(g.str("general.architecture").unwrap(), "llama");
        assert_eq!(g.u32("llama.block_count").unwrap(), 30);
        assert_eq!(g.u32("llama.embedding_length").unwrap(), 576);
        assert_eq!(g.u32("llama.feed_forward_length").unwrap(), 1536);
        assert_eq!(g.u32("llama.attention.head_count").unwrap(), 9);
        assert_eq!(g.u32("llama.attention.head_count_kv").unwrap(), 3);
        assert_eq!(g.u32("llama.rope.dimension_count").unwrap(), 64);
        assert_eq!(g.u32("llama.context_length").unwrap(), 8192);
        assert_eq!(g.u32("llama.vocab_size").unwrap(), 49152);
        assert_eq!(g.f32("llama.rope.freq_base").unwrap(), 100_000.0);
        assert_eq!(
            g.f32("llama.attention.layer_norm_rms_epsilon").unwrap(),
            1e-5
        );
        assert_eq!(g.str("tokenizer.ggml.model").unwrap(), "gpt2");
        assert_eq!(g.str("tokenizer.ggml.pre").unwrap(), "smollm");
        assert_eq!(g.str_array("tokenizer.ggml.tokens").unwrap().len(), 49152);
        assert_eq!(g.str_array("tokenizer.ggml.merges").unwrap().len(), 48900);
        assert_eq!(g.str_array("tokenizer.ggml.merges").unwrap()[0], "Ġ t");
        let types = g.i32_array("tokenizer.ggml.token_type").unwrap();
        assert_eq!(types.iter().filter(|&&t| t == 3).count(), 17);
        assert_eq!(g.u32("tokenizer.ggml.bos_token_id").unwrap(), 1);
        assert_eq!(g.u32("tokenizer.ggml.eos_token_id").unwrap(), 2);
        assert!(!g.bool("tokenizer.ggml.add_bos_token").unwrap());
        assert_eq!(g.str_array("general.languages").unwrap(), ["en"]);
        assert_eq!(g.metadata_keys().count(), 33);
    }

    #[test]
    fn smollm2_tensors() {
        let g = crate::model_file::smollm2_for_tests();
        assert_eq!(g.tensor_names().count(), 272);
        assert!(
            g.tensor_info("output.weight").is_err(),
            "embeddings are tied"
        );
        let info = |name: &str| {
            let t = g.tensor_info(name).unwrap();
            (t.shape.clone(), t.ggml_type)
        };
        assert_eq!(
            info("token_embd.weight"),
            (vec![49152, 576], GgmlType::Q8_0)
        );
        assert_eq!(info("output_norm.weight"), (vec![576], GgmlType::F32));
        for layer in 0..30 {
            let p = format!("blk.{layer}.");
            assert_eq!(
                info(&(p.clone() + "attn_norm.weight")),
                (vec![576], GgmlType::F32)
            );
            assert_eq!(
                info(&(p.clone() + "ffn_norm.weight")),
                (vec![576], GgmlType::F32)
            );
            assert_eq!(
                info(&(p.clone() + "attn_q.weight")),
                (vec![576, 576], GgmlType::Q4_1)
            );
            assert_eq!(
                info(&(p.clone() + "attn_k.weight")),
                (vec![192, 576], GgmlType::Q4_1)
            );
            assert_eq!(
                info(&(p.clone() + "attn_v.weight")),
                (vec![192, 576], GgmlType::Q4_1)
            );
            assert_eq!(
                info(&(p.clone() + "attn_output.weight")),
                (vec![576, 576], GgmlType::Q4_1)
            );
            assert_eq!(
                info(&(p.clone() + "ffn_gate.weight")),
                (vec![1536, 576], GgmlType::Q4_1)
            );
            assert_eq!(
                info(&(p.clone() + "ffn_up.weight")),
                (vec![1536, 576], GgmlType::Q4_1)
            );
            assert_eq!(
                info(&(p + "ffn_down.weight")),
                (vec![576, 1536], GgmlType::Q4_1)
            );
        }
    }

    #[test]
    fn smollm2_values_match_python_gguf() {
        // gguf-py 0.19: gguf.quants.dequantize(tensor.data, tensor.tensor_type), float32, indexed
        // [row, col]; sums in float64.
        let g = crate::model_file::smollm2_for_tests();
        let cases: [(&str, &[(&[usize], f32)], f64, f64); 6] = [
            (
                "token_embd.weight",
                &[
                    (&[0, 0], -0.10654449462890625),
                    (&[0, 1], 0.032978057861328125),
                    (&[1, 0], -0.0238037109375),
                    (&[1000, 575], 0.11810302734375),
                    (&[49151, 100], -0.026912689208984375),
                ],
                -15353.04449415207,
                520415.71544763993,
            ),
            (
                "blk.0.attn_q.weight",
                &[
                    (&[0, 0], -0.0963134765625),
                    (&[0, 1], 0.1573486328125),
                    (&[0, 16], -0.22314453125),
                    (&[0, 17], 0.2841796875),
                    (&[575, 575], -0.255859375),
                ],
                59.22322082519531,
                26749.573275085306,
            ),
            (
                "blk.0.attn_k.weight",
                &[(&[0, 0], -0.1552734375), (&[191, 575], 0.3636474609375)],
                26.937057495117188,
                17499.561343912734,
            ),
            (
                "blk.29.ffn_down.weight",
                &[(&[0, 0], -0.2733154296875), (&[575, 1535], 0.056640625)],
                49.83570861816406,
                29667.074891592143,
            ),
            (
                "blk.0.attn_norm.weight",
                &[(&[0], 0.01397705078125), (&[575], -0.038330078125)],
                0.6129436492919922,
                0.9180835409024439,
            ),
            (
                "output_norm.weight",
                &[(&[0], 1.7578125), (&[1], 1.8203125), (&[575], 1.984375)],
                1038.33203125,
                1921.7355499267578,
            ),
        ];
        for (name, points, sum, sum_sq) in cases {
            let t = g.tensor(name).unwrap();
            for &(index, expected) in points {
                let flat = index
                    .iter()
                    .zip(&t.shape)
                    .fold(0, |acc, (&i, &d)| acc * d + i);
                assert_eq!(t.data[flat], expected, "{name}{index:?}");
            }
            let s: f64 = t.data.iter().map(|&v| f64::from(v)).sum();
            let s2: f64 = t.data.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
            assert!(
                (s - sum).abs() <= 1e-9 * sum_sq.max(1.0),
                "{name}: sum {s} vs {sum}"
            );
            assert!(
                (s2 - sum_sq).abs() <= 1e-9 * sum_sq,
                "{name}: sum of squares {s2} vs {sum_sq}"
            );
        }
    }
}
