//! The host bench's probe ops (`kvplan bench extension`) compute what they say: a timing of other
//! work would mislead.

use burn_core::tensor::DType;
use kvplan::KvPlanBackend;
use kvplan_tools::bench::extension::HostProbe;

use crate::common::{list, values};

pub fn computed<B: KvPlanBackend + HostProbe>(device: &B::Device) {
    let given = [1, -2, 7, i64::MAX - 1, 40];
    let plus_one = [2, -1, 8, i64::MAX, 41];
    let x = list::<B>(&given, DType::I64, device);
    let other = |value: i64| list::<B>(&[value; 4], DType::I64, device);
    assert_eq!(values::<B>(B::probe_pass(x.clone())), given);
    assert_eq!(values::<B>(B::probe_add(x.clone())), plus_one);
    let narrow = B::probe_narrow(x.clone(), other(5), other(6), other(7));
    assert_eq!(values::<B>(narrow), plus_one);
    for upload in [false, true] {
        let wide = B::probe_wide(x.clone(), other(5), other(6), other(7), true, upload);
        assert_eq!(values::<B>(wide.out), plus_one, "upload {upload}");
        assert_eq!(values::<B>(wide.status), [0; 4], "upload {upload}");
    }
    let handed_back = B::probe_wide(x.clone(), other(5), other(6), other(7), false, false);
    assert_eq!(values::<B>(handed_back.out), given);
    assert_eq!(values::<B>(handed_back.status), [5; 4]);
}
