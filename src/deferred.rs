//! The status record of a deferred op, and one read-back for several of them.

use burn_core::backend::tensor::IntTensor;
use burn_core::backend::{Backend, Dispatch};

use crate::error::Error;
use crate::status;

/// The device-side status record of an op: its count, or the value rule it broke.
#[derive(Debug, Clone)]
#[must_use = "an op's value errors are in its status: check it (with the step's others)"]
pub struct Status<B: Backend = Dispatch> {
    words: IntTensor<B>,
    context: String,
}

impl<B: Backend> Status<B> {
    pub(crate) fn new(words: IntTensor<B>, context: &str) -> Self {
        Self {
            words,
            context: context.into(),
        }
    }

    /// Reads the status back (one transfer) and returns the op's count (a gather's number of
    /// values, 0 for a plan), or the error it holds.
    ///
    /// # Errors
    /// The op's deferred error: a value rule found on the device, `index_range`, or `execution` for
    /// an op that failed there. `execution` when the read-back fails; `corrupt_status` for a record
    /// kvplan never wrote.
    pub fn check(&self) -> Result<usize, Error> {
        let words = crate::backend::read_status::<B>(self.words.clone())?;
        status::decode(&words, &self.context)
    }

    /// The raw i64 status record, for callers that keep it on the device.
    pub fn words(&self) -> &IntTensor<B> {
        &self.words
    }

    /// The record, moved into an op that hands back the next one.
    pub(crate) fn into_words(self) -> IntTensor<B> {
        self.words
    }
}

/// Reads several deferred ops' statuses back in one transfer (a step's gathers and plan), and
/// returns their counts in order, or the first op's error. The statuses move into the read: a
/// record whose last reference an op takes costs Fusion no drop afterwards (clone one to keep it).
///
/// # Errors
/// As [`Status::check`], for the first status in order that holds an error; `execution` when the
/// one read-back fails.
pub fn check_all<B: Backend>(
    statuses: impl IntoIterator<Item = Status<B>>,
) -> Result<Vec<usize>, Error> {
    let (mut parts, contexts) = split(statuses);
    let words = match parts.len() {
        0 => return Ok(Vec::new()),
        1 => crate::backend::read_ints::<B>(parts.remove(0))?,
        _ => crate::backend::read_ints::<B>(B::int_cat(parts, 0))?,
    };
    decode_all(&contexts, &words)
}

/// The statuses' records and their contexts.
pub(crate) fn split<B: Backend>(
    statuses: impl IntoIterator<Item = Status<B>>,
) -> (Vec<IntTensor<B>>, Vec<String>) {
    statuses
        .into_iter()
        .map(|status| (status.words, status.context))
        .unzip()
}

/// The counts of the statuses of `contexts` from their records read back side by side (`words`
/// may go on past them), or the first op's error.
pub(crate) fn decode_all(contexts: &[String], words: &[i64]) -> Result<Vec<usize>, Error> {
    contexts
        .iter()
        .zip(words.chunks_exact(crate::layout::STATUS_LEN))
        .map(|(context, record)| {
            let record: status::StatusWords = record.try_into().unwrap_or_default();
            status::decode(&record, context)
        })
        .collect()
}
