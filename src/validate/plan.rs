//! Host rules 1-11 of the kv-canary plan and the allocation rules (spec `canary-plan.md` §2, §5).

use core::fmt::Debug;

use super::{Arg, require_device, require_int, require_rank};
use crate::error::{Error, PLAN_CONTEXT};

/// Largest capacity a plan can hold: counts are stored as i32.
pub const MAX_CAPACITY: usize = i32::MAX as usize;

/// What the host rules see of one plan call.
#[derive(Debug, Clone)]
pub struct PlanArgs<D> {
    /// `req_pool_indices`.
    pub req_pool_indices: Arg<D>,
    /// `prefix_lens`.
    pub prefix_lens: Arg<D>,
    /// `extend_seq_lens`.
    pub extend_seq_lens: Arg<D>,
    /// `req_to_token`.
    pub req_to_token: Arg<D>,
    /// Row stride of `req_to_token` in elements, as passed in.
    pub req_to_token_row_stride: i64,
    /// `swa_window_size`.
    pub swa_window_size: i32,
    /// `full_to_swa_index_mapping`.
    pub full_to_swa: Option<Arg<D>>,
    /// `req_to_verify_expected_tokens`.
    pub expected_tokens: Option<Arg<D>>,
    /// `req_to_verify_expected_tokens_valid_lens`.
    pub valid_lens: Option<Arg<D>>,
    /// The `verify_capacity` argument.
    pub verify_capacity: usize,
    /// Capacity of the `VerifyPlan`.
    pub plan_verify_capacity: usize,
    /// Capacity of the `WritePlan`.
    pub write_req_capacity: usize,
    /// Device of the plans.
    pub plan_device: D,
}

/// `VerifyPlan::allocate` / `WritePlan::allocate` rules.
pub fn allocation(field: &'static str, capacity: usize) -> Result<(), Error> {
    match capacity {
        0 if field == "verify_capacity" => Err(Error::NonPositiveVerifyCapacity { value: 0 }),
        0 => Err(Error::NonPositiveWriteCapacity { value: 0 }),
        value if value > MAX_CAPACITY => Err(Error::CapacityTooLarge { field, value }),
        _ => Ok(()),
    }
}

/// Rules 1-11, in order; within a rule, tensors in argument order.
pub fn plan<D: PartialEq + Debug>(args: &PlanArgs<D>) -> Result<(), Error> {
    let context = PLAN_CONTEXT;
    if args.swa_window_size > 0 && args.full_to_swa.is_none() {
        return Err(Error::MissingLutForSwa {
            window: args.swa_window_size,
        });
    }
    if args.verify_capacity != args.plan_verify_capacity {
        return Err(Error::CapacityMismatch {
            argument: args.verify_capacity,
            plan: args.plan_verify_capacity,
        });
    }
    match (&args.expected_tokens, &args.valid_lens) {
        (Some(_), None) => return Err(Error::MissingValidLens),
        (None, Some(_)) => return Err(Error::ValidLensWithoutPool),
        _ => {}
    }
    let in_order = [
        Some(&args.req_pool_indices),
        Some(&args.prefix_lens),
        Some(&args.extend_seq_lens),
        Some(&args.req_to_token),
        args.full_to_swa.as_ref(),
        args.expected_tokens.as_ref(),
        args.valid_lens.as_ref(),
    ];
    for arg in in_order.iter().flatten() {
        require_device(arg, &args.plan_device, context)?;
    }
    for arg in in_order.iter().flatten() {
        require_int(arg, context)?;
    }
    let ranks = [1, 1, 1, 2, 1, 2, 1];
    for (arg, rank) in in_order.iter().zip(ranks) {
        if let Some(arg) = arg {
            require_rank(arg, rank, context)?;
        }
    }
    let bs = args.req_pool_indices.dim(0);
    let per_request = [
        Some(&args.prefix_lens),
        Some(&args.extend_seq_lens),
        args.valid_lens.as_ref(),
    ];
    for arg in per_request.iter().flatten() {
        if arg.dim(0) != bs {
            return Err(Error::LengthMismatch {
                name: arg.name,
                len: arg.dim(0),
                bs,
            });
        }
    }
    if args.full_to_swa.as_ref().is_some_and(|lut| lut.dim(0) == 0) {
        return Err(Error::EmptyLut);
    }
    if bs > args.write_req_capacity {
        return Err(Error::BsExceedsWriteCapacity {
            bs,
            capacity: args.write_req_capacity,
        });
    }
    let (rows, cols) = (args.req_to_token.dim(0), args.req_to_token.dim(1));
    if rows >= 1 && cols >= 1 && args.req_to_token_row_stride <= 0 {
        return Err(Error::ReqToTokenStride {
            stride: args.req_to_token_row_stride,
        });
    }
    Ok(())
}
