//! Choice flags (`--schedule cosine`, `--sampler balanced`, …): clap checks the word against
//! the type's own names, lists them in `--help` and names the flag and the word in its
//! usage error (exit code 2); the type's `FromStr` then reads the word. The types belong to
//! the engine and the trainer, which do not use clap, so their names come from their own
//! lists rather than a `ValueEnum` derive.

use std::str::FromStr;

use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser, ValueParser};

/// A type a choice flag names by one of [`Choice::NAMES`] (or an alias).
pub(crate) trait Choice: FromStr + Clone + Send + Sync + 'static {
    /// The command-line words, as `--help` lists them.
    const NAMES: &'static [&'static str];
    /// Other spellings the type's `FromStr` accepts, as (alias, name).
    const ALIASES: &'static [(&'static str, &'static str)] = &[];
}

/// The clap parser of a choice flag: one of the names or aliases, any case.
pub(crate) fn choice<T: Choice>() -> impl TypedValueParser<Value = T> {
    let values = T::NAMES.iter().map(|&name| {
        let aliases = T::ALIASES
            .iter()
            .filter(|(_, n)| *n == name)
            .map(|(a, _)| *a);
        PossibleValue::new(name).aliases(aliases)
    });
    PossibleValuesParser::new(values).map(|word: String| {
        word.to_ascii_lowercase()
            .parse()
            .unwrap_or_else(|_| unreachable!("`{word}` is one of the names clap checked"))
    })
}

/// A value a recorded setting's flag takes: how clap parses it and how `--help` prints the
/// default.
pub(crate) trait FlagValue: Clone + Send + Sync + 'static {
    /// Whether the value is one of a list of words (then matched in any case).
    const IS_CHOICE: bool = false;
    /// The clap parser.
    fn parser() -> ValueParser;
    /// The default as `--help` prints it (`None`: not printed).
    fn shown(&self) -> Option<String>;
}

macro_rules! number_flags {
    ($($t:ty),*) => {$(
        impl FlagValue for $t {
            fn parser() -> ValueParser {
                clap::value_parser!($t).into()
            }
            fn shown(&self) -> Option<String> {
                Some(self.to_string())
            }
        }
    )*};
}
number_flags!(f32, f64, u32, u64);

impl FlagValue for bool {
    fn parser() -> ValueParser {
        clap::value_parser!(bool)
    }
    // On and off are in the flag's own words.
    fn shown(&self) -> Option<String> {
        None
    }
}

macro_rules! choice_flags {
    ($($t:ty => $names:expr, $aliases:expr, $show:expr;)*) => {$(
        impl Choice for $t {
            const NAMES: &'static [&'static str] = $names;
            const ALIASES: &'static [(&'static str, &'static str)] = $aliases;
        }
        impl FlagValue for $t {
            const IS_CHOICE: bool = true;
            fn parser() -> ValueParser {
                ValueParser::new(choice::<$t>())
            }
            fn shown(&self) -> Option<String> {
                #[allow(clippy::redundant_closure_call)]
                Some(($show)(self))
            }
        }
    )*};
}

choice_flags! {
    pipeline::ResizeMode => pipeline::ResizeMode::NAMES, &[], |v: &pipeline::ResizeMode| v.to_string();
    pipeline::LastBatch => pipeline::LastBatch::NAMES, &[], |v: &pipeline::LastBatch| v.to_string();
    pipeline::Sampling => pipeline::Sampling::NAMES, &[], |v: &pipeline::Sampling| v.to_string();
    pipeline::OnBadImage => pipeline::OnBadImage::NAMES, &[], |v: &pipeline::OnBadImage| v.to_string();
    pipeline::Split => pipeline::Split::NAMES, &[], |v: &pipeline::Split| v.to_string();
    crate::optim::ScheduleChoice => &["cosine", "step", "constant", "plateau"], &[],
        |v: &crate::optim::ScheduleChoice| v.to_string();
    crate::optim::OptimizerChoice => &["sgd", "adam", "adamw"], &[],
        |v: &crate::optim::OptimizerChoice| v.to_string();
    crate::train::Monitor => &["val_accuracy", "val_loss", "val_ema_accuracy", "val_ema_loss"],
        &[("val_acc", "val_accuracy"), ("val_ema_acc", "val_ema_accuracy")],
        |v: &crate::train::Monitor| v.name().to_string();
}

/// `--augment`: what training does to each image, by its kind (a resized crop's range is
/// `--crop-scale`'s).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AugmentWord(pub crate::train::Augmentation);

impl FromStr for AugmentWord {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        crate::train::Augmentation::parse(s)
            .map(AugmentWord)
            .ok_or(())
    }
}

impl Choice for AugmentWord {
    const NAMES: &'static [&'static str] = &["pad-crop", "resized-crop", "none"];
    const ALIASES: &'static [(&'static str, &'static str)] =
        &[("random-resized-crop", "resized-crop")];
}

/// `--auto-augment`: the policy named (`None`: `none`), at its default strength.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PolicyWord(pub Option<pipeline::AutoAugment>);

impl FromStr for PolicyWord {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        pipeline::AutoAugment::parse(s).map(PolicyWord).ok_or(())
    }
}

impl Choice for PolicyWord {
    const NAMES: &'static [&'static str] = &[
        "ta_wide", "ra", "augmix", "imagenet", "cifar10", "svhn", "none",
    ];
    const ALIASES: &'static [(&'static str, &'static str)] = &[
        ("ta-wide", "ta_wide"),
        ("trivialaugmentwide", "ta_wide"),
        ("trivial_augment_wide", "ta_wide"),
        ("trivial-augment-wide", "ta_wide"),
        ("randaugment", "ra"),
        ("rand_augment", "ra"),
        ("rand-augment", "ra"),
    ];
}
