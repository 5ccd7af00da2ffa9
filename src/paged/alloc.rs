//! The host allocators of a `PagedKv`: KV slots (reference-counted, so that requests sharing a
//! prefix name the same slots) and `req_to_token` rows. Index 0 of each is the padding one and is
//! never handed out.

use crate::error::Error;

/// KV slots `1..count`, each with the number of requests that name it.
#[derive(Debug, Clone)]
pub(crate) struct Slots {
    free: Vec<i64>,
    owners: Vec<u32>,
}

impl Slots {
    /// Every slot of `1..count` free; lower slots are handed out first.
    pub(crate) fn new(count: usize) -> Self {
        Self {
            free: (1..count as i64).rev().collect(),
            owners: vec![0; count],
        }
    }

    /// Slots free now.
    pub(crate) fn free(&self) -> usize {
        self.free.len()
    }

    /// `n` slots with one owner each, or `OutOfSlots` (nothing taken then).
    pub(crate) fn take(&mut self, n: usize) -> Result<Vec<i64>, Error> {
        if n > self.free.len() {
            return Err(Error::OutOfSlots {
                needed: n,
                free: self.free.len(),
            });
        }
        let taken: Vec<i64> = self
            .free
            .split_off(self.free.len() - n)
            .into_iter()
            .rev()
            .collect();
        for &slot in &taken {
            self.owners[slot as usize] = 1;
        }
        Ok(taken)
    }

    /// One more owner for each of `slots` (a shared prefix).
    pub(crate) fn share(&mut self, slots: &[i64]) {
        for &slot in slots {
            self.owners[slot as usize] += 1;
        }
    }

    /// One owner fewer for each of `slots`; a slot with none left is free again.
    pub(crate) fn release(&mut self, slots: &[i64]) {
        for &slot in slots.iter().rev() {
            let owners = &mut self.owners[slot as usize];
            debug_assert!(*owners > 0, "slot {slot} released without an owner");
            *owners = owners.saturating_sub(1);
            if *owners == 0 {
                self.free.push(slot);
            }
        }
    }

    /// Requests naming `slot` (tests, debugging).
    pub(crate) fn owners(&self, slot: i64) -> u32 {
        self.owners.get(slot as usize).copied().unwrap_or(0)
    }
}

/// `req_to_token` rows `1..count`.
#[derive(Debug, Clone)]
pub(crate) struct Rows {
    free: Vec<i64>,
    max_requests: usize,
}

impl Rows {
    pub(crate) fn new(max_requests: usize) -> Self {
        Self {
            free: (1..=max_requests as i64).rev().collect(),
            max_requests,
        }
    }

    pub(crate) fn free(&self) -> usize {
        self.free.len()
    }

    pub(crate) fn take(&mut self) -> Result<i64, Error> {
        self.free.pop().ok_or(Error::OutOfRows {
            max_requests: self.max_requests,
        })
    }

    pub(crate) fn give_back(&mut self, row: i64) {
        self.free.push(row);
    }
}
