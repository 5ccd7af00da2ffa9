//! The status record of a deferred op, and one read-back for several of them.

use burn_core::backend::tensor::IntTensor;
use burn_core::backend::{Backend, Dispatch};

use crate::error::Error;
use crate::status;

/// The device-side status record of a deferred op.
#[derive(Debug, Clone)]
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
    /// values, 0 for a plan), or the error the checked form would have returned.
    pub fn check(&self) -> Result<usize, Error> {
        let words = crate::ops::read_status::<B>(self.words.clone())?;
        status::decode(&words, &self.context)
    }

    /// The raw i64 status record, for callers that keep it on the device.
    pub fn words(&self) -> &IntTensor<B> {
        &self.words
    }
}

/// Reads several deferred ops' statuses back in one transfer (a step's gathers and plan), and
/// returns their counts in order, or the first op's error.
pub fn check_all<B: Backend>(statuses: &[&Status<B>]) -> Result<Vec<usize>, Error> {
    let Some(first) = statuses.first() else {
        return Ok(Vec::new());
    };
    if statuses.len() == 1 {
        return first.check().map(|count| vec![count]);
    }
    let words = B::int_cat(statuses.iter().map(|s| s.words.clone()).collect(), 0);
    let words = crate::ops::read_ints::<B>(words)?;
    decode_all(statuses, &words)
}

/// The counts of `statuses` from their records read back side by side (`words` may go on past
/// them), or the first op's error.
pub(crate) fn decode_all<B: Backend>(
    statuses: &[&Status<B>],
    words: &[i64],
) -> Result<Vec<usize>, Error> {
    statuses
        .iter()
        .zip(words.chunks_exact(crate::layout::STATUS_LEN))
        .map(|(status, record)| {
            let record: status::StatusWords = record.try_into().unwrap_or_default();
            status::decode(&record, &status.context)
        })
        .collect()
}
