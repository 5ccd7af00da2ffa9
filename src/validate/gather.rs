//! Immediate rules of the gathers (spec `gather.md` §3 rules 1-5 and 7, §4 rules 1-3).

use core::fmt::Debug;

use super::{Arg, require_bool, require_device, require_int, require_rank};
use crate::error::Error;

/// Rules 1-5 and, for a table with columns, rule 7 of `masked_gather`.
///
/// Rule 7 depends only on shapes, so it is immediate; it follows the deferred empty-table rule 6,
/// which cannot fail when the table has columns.
pub fn masked_gather<D: PartialEq + Debug>(
    req_to_token: &Arg<D>,
    req_pool_indices: &Arg<D>,
    pos2d: &Arg<D>,
    mask: &Arg<D>,
    context: &str,
) -> Result<(), Error> {
    if pos2d.shape.len() != 2 {
        return Err(Error::PosNot2d {
            context: context.into(),
            shape: pos2d.dims(),
        });
    }
    if mask.shape != pos2d.shape {
        return Err(Error::MaskShapeMismatch {
            context: context.into(),
            mask: mask.dims(),
            pos2d: pos2d.dims(),
        });
    }
    require_rank(req_to_token, 2, context)?;
    require_rank(req_pool_indices, 1, context)?;
    for arg in [req_to_token, req_pool_indices, pos2d] {
        require_int(arg, context)?;
    }
    require_bool(mask, context)?;
    for arg in [req_pool_indices, pos2d, mask] {
        require_device(arg, &req_to_token.device, context)?;
    }
    if req_to_token.dim(1) > 0 {
        let (n, rows, cols) = (req_pool_indices.dim(0), pos2d.dim(0), pos2d.dim(1));
        if n != rows && n != 1 {
            let context = context.to_string();
            return Err(if rows == 1 {
                Error::MaskIndexShapeMismatch {
                    context,
                    n,
                    rows,
                    cols,
                }
            } else {
                Error::IndexShapeMismatch {
                    context,
                    n,
                    rows,
                    cols,
                }
            });
        }
    }
    Ok(())
}

/// Rules 1-3 of `segment_gather`; the rest depend on `lengths` and are deferred.
pub fn segment_gather<D: PartialEq + Debug>(
    req_to_token: &Arg<D>,
    req_pool_indices: &Arg<D>,
    start: Option<&Arg<D>>,
    lengths: &Arg<D>,
    context: &str,
) -> Result<(), Error> {
    let vectors = [Some(req_pool_indices), start, Some(lengths)];
    require_rank(req_to_token, 2, context)?;
    for arg in vectors.iter().flatten() {
        require_rank(arg, 1, context)?;
    }
    require_int(req_to_token, context)?;
    for arg in vectors.iter().flatten() {
        require_int(arg, context)?;
    }
    for arg in vectors.iter().flatten() {
        require_device(arg, &req_to_token.device, context)?;
    }
    Ok(())
}
