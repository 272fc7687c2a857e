//! The flags of the recorded training settings, built from their table
//! ([`crate::train::folder::settings`]): each row gives its flag (help heading, value name,
//! help text with the typed default printed), and [`RecipeArgs::apply`] /
//! [`EngineArgs::apply`] give a flag's value to the settings (a new run's defaults, or a
//! resumed run's checkpoint: a flag given again overrides it).

use super::choice::FlagValue;
use crate::train::folder::settings::recorded_settings;
use crate::train::RunSettings;

/// A row's `--help` text: its doc lines as one paragraph, with the default printed.
fn help_text(doc: &[&str], default: Option<String>) -> String {
    let text = doc.iter().map(|l| l.trim()).collect::<Vec<_>>().join(" ");
    // As clap shows a doc comment: one sentence without its full stop.
    let text = text.strip_suffix('.').unwrap_or(&text);
    match default {
        Some(d) => format!("{text} [default: {d}]"),
        None => text.to_string(),
    }
}

/// The default a row's record holds, for `--help` (none for an optional setting: its doc
/// says what absent means).
trait RecordedDefault {
    fn shown_default(&self) -> Option<String>;
}

impl<T: FlagValue> RecordedDefault for T {
    fn shown_default(&self) -> Option<String> {
        self.shown()
    }
}

impl<T> RecordedDefault for Option<T> {
    fn shown_default(&self) -> Option<String> {
        None
    }
}

/// `--color_jitter` spelled as the flag: `--color-jitter`.
fn flag_name(field: &str) -> String {
    format!("--{}", field.replace('_', "-"))
}

/// The line of a `warn` row given on resume with another value than the checkpoint's.
macro_rules! resume_change {
    (warn, $field:ident, $now:expr, $then:expr, $out:expr) => {
        if $now.$field != $then.$field {
            $out.push(format!(
                "{} {} (the checkpoint's: {})",
                flag_name(stringify!($field)),
                $now.$field,
                $then.$field
            ));
        }
    };
    ($rule:ident, $field:ident, $now:expr, $then:expr, $out:expr) => {};
}

/// One struct of flags from a section of the table.
macro_rules! flag_struct {
    ($name:ident, $about:literal,
        $(
            $(#[doc = $doc:literal])*
            $(#[serde($($serde:tt)*)])*
            $field:ident : $ty:ty = $default:expr
                => $flag_ty:ty [$heading:literal, $value_name:literal, $rule:ident $(, $($extra:tt)+)?] ;
        )*
    ) => {
        #[doc = $about]
        #[derive(Debug, Clone, Default, PartialEq, clap::Args)]
        pub struct $name {
            $(
                $(#[doc = $doc])*
                #[arg(
                    long,
                    value_name = $value_name,
                    help_heading = $heading,
                    value_parser = <$flag_ty as FlagValue>::parser(),
                    ignore_case = <$flag_ty as FlagValue>::IS_CHOICE,
                    help = help_text(&[$($doc),*], RunSettings::default().$field.shown_default())
                    $(, $($extra)+)?
                )]
                pub $field: Option<$flag_ty>,
            )*
        }

        impl $name {
            /// Gives `settings` the values of the flags given.
            pub fn apply(&self, settings: &mut RunSettings) {
                $(
                    if let Some(v) = &self.$field {
                        settings.$field = v.clone().into();
                    }
                )*
            }

            /// "--lr 0.1 (the checkpoint's: 0.8)" for each setting whose rule is `warn` and
            /// whose value `now` differs from the checkpoint's `then`.
            pub fn resume_changes(now: &RunSettings, then: &RunSettings, out: &mut Vec<String>) {
                // A section without `warn` rows reads none of them.
                let _ = (now, then, &out);
                $( resume_change!($rule, $field, now, then, out); )*
            }
        }
    };
}

/// The sections of the table: the engine's flags (shared with `bench pipeline`) and the
/// training's; the unflagged rows have flags of their own.
macro_rules! flag_structs {
    (
        engine { $($engine:tt)* }
        training { $($training:tt)* }
        unflagged { $($unflagged:tt)* }
    ) => {
        flag_struct!(EngineArgs, "The recorded settings the input engine applies (also `bench pipeline`'s).", $($engine)*);
        flag_struct!(RecipeArgs, "The recorded training settings that have a flag of their own.", $($training)*);
    };
}

recorded_settings!(flag_structs);
