//! The gradient bucket planner and the in-order launch tracker.

use birdtrain::dist::buckets::{
    specs_from_numel, BucketError, BucketPlan, BucketSettings, BucketTracker, ParamSpec,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn spec(name: &str, bytes: usize) -> ParamSpec {
    ParamSpec {
        name: name.to_string(),
        bytes,
    }
}

fn settings(target: usize, align: usize) -> BucketSettings {
    BucketSettings {
        target_bytes: target,
        element_bytes: 4,
        align_bytes: align,
    }
}

#[test]
fn hand_computed_plan() {
    // Forward order a, b, c, d; backward produces d, c, b, a.
    let params = [spec("a", 100), spec("b", 52), spec("c", 300), spec("d", 20)];
    let plan = BucketPlan::new(&params, settings(128, 8)).unwrap();
    let b = plan.buckets();
    assert_eq!(b.len(), 2);
    // d at 0..20, c at 24..324 (aligned to 8): 324 bytes >= 128 closes bucket 0.
    assert_eq!(b[0].params, vec![3, 2]);
    assert_eq!((b[0].offset_bytes, b[0].len_bytes), (0, 324));
    assert_eq!(plan.param_range(3), 0..20);
    assert_eq!(plan.param_range(2), 24..324);
    // b at 328..380, a at 384..484.
    assert_eq!(b[1].params, vec![1, 0]);
    assert_eq!((b[1].offset_bytes, b[1].len_bytes), (328, 156));
    assert_eq!(plan.param_range(0), 384..484);
    assert_eq!(plan.total_bytes(), 484);
    assert_eq!(plan.total_elements(), 121);
    assert_eq!(plan.bucket_elements(1), 82..121);
    assert_eq!(plan.param_elements(1), 82..95);
    assert_eq!((plan.bucket_of(0), plan.bucket_of(3)), (1, 0));
}

#[test]
fn a_parameter_larger_than_the_target_gets_its_own_bucket() {
    let params = [spec("small0", 8), spec("huge", 4000), spec("small1", 8)];
    let plan = BucketPlan::new(&params, settings(100, 4)).unwrap();
    let groups: Vec<Vec<usize>> = plan.buckets().iter().map(|b| b.params.clone()).collect();
    // small1 (8 B) is still under the target when huge joins it, so they share; small0 alone.
    assert_eq!(groups, vec![vec![2, 1], vec![0]]);
    let plan = BucketPlan::new(&[spec("huge", 4000), spec("x", 400)], settings(100, 4)).unwrap();
    let groups: Vec<Vec<usize>> = plan.buckets().iter().map(|b| b.params.clone()).collect();
    assert_eq!(groups, vec![vec![1], vec![0]]);
}

#[test]
fn random_models_every_parameter_in_exactly_one_contiguous_bucket_in_backward_order() {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    for _ in 0..200 {
        let n = rng.random_range(1..60);
        let params: Vec<ParamSpec> = (0..n)
            .map(|i| spec(&format!("p{i}"), 4 * rng.random_range(1..5000)))
            .collect();
        let target = 4 * rng.random_range(1..8000);
        let align: usize = [4, 16, 256][rng.random_range(0..3)];
        let plan = BucketPlan::new(&params, settings(target, align)).unwrap();

        let order: Vec<usize> = plan
            .buckets()
            .iter()
            .flat_map(|b| b.params.clone())
            .collect();
        assert_eq!(
            order,
            (0..n).rev().collect::<Vec<_>>(),
            "backward order, each once"
        );

        let mut end_of_previous: usize = 0;
        for (k, bucket) in plan.buckets().iter().enumerate() {
            assert_eq!(bucket.offset_bytes, end_of_previous.div_ceil(align) * align);
            let range = bucket.offset_bytes..bucket.offset_bytes + bucket.len_bytes;
            let mut cursor = bucket.offset_bytes;
            for &p in &bucket.params {
                let r = plan.param_range(p);
                assert_eq!(plan.bucket_of(p), k);
                assert_eq!(r.start % align, 0);
                assert!(r.start >= cursor && r.end <= range.end, "inside its bucket");
                assert_eq!(r.len(), params[p].bytes);
                cursor = r.end;
            }
            assert_eq!(cursor, range.end, "a bucket ends with its last parameter");
            // Greedy: every bucket but the last reached the target, and only its last
            // parameter took it there.
            if k + 1 < plan.buckets().len() {
                assert!(bucket.len_bytes >= target);
                if let [.., before_last, _] = bucket.params[..] {
                    assert!(plan.param_range(before_last).end - bucket.offset_bytes < target);
                }
            }
            end_of_previous = range.end;
        }
        assert_eq!(plan.total_bytes(), end_of_previous);
    }
}

#[test]
fn tracker_launches_buckets_in_order_even_when_gradients_arrive_out_of_order() {
    let params: Vec<ParamSpec> = (0..6).map(|i| spec(&format!("p{i}"), 40)).collect();
    // Two parameters per bucket: buckets [5,4], [3,2], [1,0].
    let plan = BucketPlan::new(&params, settings(80, 4)).unwrap();
    assert_eq!(plan.buckets().len(), 3);
    let mut t = BucketTracker::new(&plan);
    assert_eq!(t.mark_ready(3).unwrap(), Vec::<usize>::new());
    assert_eq!(
        t.mark_ready(2).unwrap(),
        Vec::<usize>::new(),
        "bucket 1 waits for bucket 0"
    );
    assert_eq!(t.mark_ready(5).unwrap(), Vec::<usize>::new());
    assert_eq!(t.mark_ready(4).unwrap(), vec![0, 1]);
    assert!(!t.all_launched());
    assert!(matches!(
        t.mark_ready(4),
        Err(BucketError::DuplicateReady { index: 4, .. })
    ));
    assert!(matches!(
        t.mark_ready(6),
        Err(BucketError::UnknownParameter { index: 6, count: 6 })
    ));
    assert_eq!(t.mark_ready(0).unwrap(), Vec::<usize>::new());
    assert_eq!(t.mark_ready(1).unwrap(), vec![2]);
    assert!(t.all_launched());
    t.reset();
    assert!(!t.all_launched() && !t.is_ready(1));
    let launched: Vec<usize> = (0..6)
        .rev()
        .flat_map(|i| t.mark_ready(i).unwrap())
        .collect();
    assert_eq!(launched, vec![0, 1, 2]);
}

#[test]
fn bad_inputs_are_errors() {
    assert!(matches!(
        BucketPlan::new(&[spec("a", 4)], settings(0, 4)),
        Err(BucketError::InvalidSetting { .. })
    ));
    assert!(matches!(
        BucketPlan::new(&[spec("a", 4)], settings(64, 6)),
        Err(BucketError::InvalidSetting { .. })
    ));
    assert!(matches!(
        BucketPlan::new(&[spec("a", 0)], settings(64, 4)),
        Err(BucketError::EmptyParameter { .. })
    ));
    let err = BucketPlan::new(&[spec("fc.bias", 6)], settings(64, 4)).unwrap_err();
    assert!(err.to_string().contains("fc.bias"), "{err}");
    assert!(BucketPlan::new(&[], settings(64, 4))
        .unwrap()
        .buckets()
        .is_empty());
}

#[test]
fn settings_and_specs_helpers() {
    let s = BucketSettings::f32_mb(25.0);
    assert_eq!(s.target_bytes, 25 * 1024 * 1024);
    let specs = specs_from_numel(&[("w".to_string(), 10)], 4);
    assert_eq!(specs, vec![spec("w", 40)]);
}
