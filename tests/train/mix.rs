//! `--mixup`, `--cutmix`, `--random-erase`, `--color-jitter-hue`, `--auto-augment` and
//! `--clip-grad-norm`
//! through the CLI: each reaches training (a run mixing none of its batches is the plain run,
//! bit for bit, as is one clipped above every norm; mixup, CutMix, erasing, hue, the
//! augmentation policies and clipping each change it, and differently), each is said at the start, and bad values are one line
//! naming the flag.
//! The ops themselves are checked in backend_input (pixels), backend_gradcheck (targets and
//! gradient), the conformance suite and the kernel emulator.

use crate::cli_support;
use cli_support::assert_one_line_error;
use cli_support::small_run::{dataset, ok, run_with, text, train_args};

#[test]
fn mixing_reaches_training_and_a_zero_share_is_the_plain_run() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 3, 8);
    let cache = tmp.path().join("c");
    let weights = |name: &str, extra: &[&str]| {
        let run = tmp.path().join(name);
        let mut args = train_args(&data, &cache, &run, 1);
        args.extend(extra.iter().map(|a| a.to_string()));
        let out = ok(run_with(&args, &[]));
        (
            std::fs::read(run.join("model.safetensors")).unwrap(),
            text(&out),
        )
    };
    let (plain, _) = weights("plain", &[]);
    let (unmixed, _) = weights("unmixed", &["--mixup", "0.4", "--mixup-prob", "0"]);
    assert!(plain == unmixed, "--mixup-prob 0 changed the run");
    let (mixup, said) = weights("mixup", &["--mixup", "0.4"]);
    assert!(said.contains("mixup (α 0.4)"), "{said}");
    let (cutmix, said) = weights("cutmix", &["--cutmix", "1"]);
    assert!(said.contains("CutMix (α 1)"), "{said}");
    let (erased, said) = weights("erased", &["--random-erase", "0.5"]);
    assert!(
        said.contains("random erasing: 50 % of training images"),
        "{said}"
    );
    let (unerased, _) = weights("unerased", &["--random-erase", "0"]);
    assert!(plain == unerased, "--random-erase 0 changed the run");
    let (hue, said) = weights("hue", &["--color-jitter-hue", "0.2"]);
    assert!(
        said.contains("colour jitter: hue turned by up to ±0.2"),
        "{said}"
    );
    let (trivial, said) = weights("trivial", &["--auto-augment", "ta_wide"]);
    assert!(
        said.contains("automatic augmentation: TrivialAugmentWide"),
        "{said}"
    );
    let (rand, said) = weights("rand", &["--auto-augment", "ra", "--ra-magnitude", "20"]);
    assert!(
        said.contains("RandAugment, two of 14 operations per training image at strength 20"),
        "{said}"
    );
    let (learned, said) = weights("learned", &["--auto-augment", "cifar10"]);
    assert!(said.contains("AutoAugment's cifar10 policy"), "{said}");
    let (augmix, said) = weights(
        "augmix",
        &["--auto-augment", "augmix", "--augmix-severity", "5"],
    );
    assert!(
        said.contains("AugMix, each training image blended"),
        "{said}"
    );
    let (no_policy, _) = weights("no-policy", &["--auto-augment", "none"]);
    assert!(plain == no_policy, "--auto-augment none changed the run");
    let (unclipped, _) = weights("unclipped", &["--clip-grad-norm", "1e30"]);
    assert!(
        plain == unclipped,
        "a --clip-grad-norm above every norm changed the run"
    );
    let (clipped, said) = weights("clipped", &["--clip-grad-norm", "0.05"]);
    assert!(
        said.contains("gradients clipped to a global L2 norm of 0.05"),
        "{said}"
    );
    let runs = [
        &plain, &mixup, &cutmix, &erased, &hue, &trivial, &rand, &learned, &augmix, &clipped,
    ];
    for (i, a) in runs.iter().enumerate() {
        for b in &runs[i + 1..] {
            assert!(
                a != b,
                "two of plain, mixup, CutMix, erasing, hue, the policies and clipping trained alike"
            );
        }
    }
}

#[test]
fn bad_mixing_values_are_one_line_naming_the_flag() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 4);
    let cache = tmp.path().join("c");
    for (extra, flag) in [
        (vec!["--mixup=-0.2"], "--mixup"),
        (vec!["--cutmix", "NaN"], "--cutmix"),
        (vec!["--cutmix", "1", "--mixup-prob", "1.5"], "--mixup-prob"),
        (
            vec!["--mixup", "1", "--mixup-switch-prob=-1"],
            "--mixup-switch-prob",
        ),
        (vec!["--mixup-prob", "0.5"], "--mixup-prob"),
        (vec!["--random-erase", "1.1"], "--random-erase"),
        (vec!["--random-erase", "NaN"], "--random-erase"),
        (vec!["--clip-grad-norm", "0"], "--clip-grad-norm"),
        (vec!["--clip-grad-norm=-1"], "--clip-grad-norm"),
        (vec!["--clip-grad-norm", "inf"], "--clip-grad-norm"),
        (vec!["--auto-augment", "cutout"], "--auto-augment"),
        (
            vec!["--auto-augment", "ra", "--ra-magnitude", "31"],
            "--ra-magnitude",
        ),
        (vec!["--ra-magnitude", "5"], "--ra-magnitude"),
        (
            vec!["--auto-augment", "imagenet", "--ra-magnitude", "5"],
            "--ra-magnitude",
        ),
        (
            vec!["--auto-augment", "augmix", "--augmix-severity", "0"],
            "--augmix-severity",
        ),
        (
            vec!["--auto-augment", "augmix", "--augmix-severity", "11"],
            "--augmix-severity",
        ),
        (vec!["--augmix-severity", "2"], "--augmix-severity"),
        (
            vec!["--auto-augment", "ta_wide", "--ra-magnitude", "5"],
            "--ra-magnitude",
        ),
    ] {
        let run = tmp.path().join("run");
        let mut args = train_args(&data, &cache, &run, 1);
        args.extend(extra.iter().map(|a| a.to_string()));
        let out = run_with(&args, &[]);
        assert_one_line_error(&out, &[flag]);
        assert!(
            !run.join("checkpoint.json").exists(),
            "{extra:?} wrote a run"
        );
    }
}
