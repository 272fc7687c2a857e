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

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use crate::cli::Cli;
    use crate::train::RunSettings;

    #[test]
    fn a_flag_given_overrides_the_checkpoint_and_one_left_out_keeps_it() {
        let cli =
            Cli::try_parse_from(["birdtrain", "--lr", "0.1", "--color-jitter", "0.4"]).unwrap();
        let mut resumed = RunSettings {
            lr: 0.5,
            momentum: 0.8,
            ..RunSettings::default()
        };
        cli.train.recipe.apply(&mut resumed);
        cli.train.augment.engine.apply(&mut resumed);
        assert_eq!(
            (resumed.lr, resumed.momentum, resumed.color_jitter),
            (0.1, 0.8, 0.4)
        );
    }

    #[test]
    fn every_training_flag_has_a_heading_and_a_row_prints_its_typed_default() {
        let cli = Cli::command();
        for arg in cli.get_arguments() {
            let id = arg.get_id().as_str();
            if !arg.is_hide_set() && !["help", "version"].contains(&id) {
                assert!(arg.get_help_heading().is_some(), "--{id} has no heading");
            }
        }
        let arg = |id: &str| cli.get_arguments().find(|a| a.get_id() == id).unwrap();
        let help = |id: &str| arg(id).get_help().unwrap().to_string();
        assert_eq!(arg("lr").get_help_heading(), Some("Optimizer"));
        assert!(help("lr").ends_with("[default: 0.8]"), "{}", help("lr"));
        assert!(help("weight_decay").ends_with("[default: 0.0005]"));
        assert!(help("schedule").ends_with("[default: cosine]"));
        assert!(
            !help("store_size").contains("[default"),
            "an optional setting"
        );
    }
}
