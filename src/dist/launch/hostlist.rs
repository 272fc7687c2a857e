//! Slurm's compressed host lists (`SLURM_JOB_NODELIST`): `node[01-04,07]`, `a[1-2],b3`,
//! `rack[1-2]-gpu[01-02]`, expanded in Slurm's order.
//!
//! Commas at the top level separate entries; inside brackets they separate ranges `lo-hi` or
//! single numbers. A range keeps the width of its lower bound (`[08-11]` gives `08 09 10 11`),
//! and an entry with several bracket groups expands to every combination, the last group
//! varying fastest.

/// The most hosts a list may expand to: far more than any allocation, and a typo such as
/// `node[0-99999999]` is an error instead of an allocation of gigabytes.
pub const MAX_HOSTS: usize = 1 << 20;

/// Expands a compressed host list; the error says what is wrong with it.
pub fn expand(list: &str) -> Result<Vec<String>, String> {
    let mut hosts = Vec::new();
    for entry in split_top_level(list)? {
        if entry.is_empty() {
            return Err("an empty entry (two commas in a row, or a comma at an end)".into());
        }
        let mut expanded = vec![String::new()];
        let mut rest = entry;
        while !rest.is_empty() {
            let (text, group, after) = match rest.find('[') {
                Some(open) => {
                    let close = rest[open..]
                        .find(']')
                        .map(|c| open + c)
                        .ok_or_else(|| format!("`{entry}` opens a bracket it never closes"))?;
                    (
                        &rest[..open],
                        Some(&rest[open + 1..close]),
                        &rest[close + 1..],
                    )
                }
                None => (rest, None, ""),
            };
            if text.contains(']') {
                return Err(format!("`{entry}` closes a bracket it never opened"));
            }
            for host in &mut expanded {
                host.push_str(text);
            }
            if let Some(group) = group {
                let numbers = expand_group(group, entry)?;
                let count = expanded.len().saturating_mul(numbers.len());
                if hosts.len().saturating_add(count) > MAX_HOSTS {
                    return Err(format!("it expands to more than {MAX_HOSTS} hosts"));
                }
                expanded = expanded
                    .iter()
                    .flat_map(|host| numbers.iter().map(move |n| format!("{host}{n}")))
                    .collect();
            }
            rest = after;
        }
        hosts.extend(expanded);
    }
    Ok(hosts)
}

/// The entries of a list: split at the commas outside brackets.
fn split_top_level(list: &str) -> Result<Vec<&str>, String> {
    let list = list.trim();
    if list.is_empty() {
        return Err("the list is empty".into());
    }
    let (mut entries, mut depth, mut start) = (Vec::new(), 0usize, 0);
    for (i, c) in list.char_indices() {
        match c {
            '[' if depth > 0 => return Err("brackets inside brackets".into()),
            '[' => depth = 1,
            ']' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                entries.push(&list[start..i]);
                start = i + 1;
            }
            c if c.is_whitespace() => return Err("a space inside the list".into()),
            _ => {}
        }
    }
    entries.push(&list[start..]);
    Ok(entries)
}

/// The numbers of one bracket group (`01-04,07`), as text of their width.
fn expand_group(group: &str, entry: &str) -> Result<Vec<String>, String> {
    let mut numbers = Vec::new();
    for part in group.split(',') {
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let parse = |s: &str| {
            s.parse::<u64>()
                .ok()
                .filter(|_| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
                .ok_or_else(|| format!("`{entry}`: `{part}` is not a number or a range lo-hi"))
        };
        let (from, to) = (parse(lo)?, parse(hi)?);
        if to < from {
            return Err(format!("`{entry}`: the range `{part}` runs backwards"));
        }
        if (to - from) as usize >= MAX_HOSTS {
            return Err(format!("it expands to more than {MAX_HOSTS} hosts"));
        }
        let width = lo.len();
        numbers.extend((from..=to).map(|n| format!("{n:0width$}")));
    }
    Ok(numbers)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(list: &str) -> Vec<String> {
        expand(list).unwrap_or_else(|e| panic!("{list}: {e}"))
    }

    #[test]
    fn plain_names_and_single_groups() {
        assert_eq!(hosts("node7"), ["node7"]);
        assert_eq!(
            hosts("node[01-04,07]"),
            ["node01", "node02", "node03", "node04", "node07"]
        );
        assert_eq!(hosts("a[1-2],b3"), ["a1", "a2", "b3"]);
        assert_eq!(hosts("gpu[8-11]"), ["gpu8", "gpu9", "gpu10", "gpu11"]);
        assert_eq!(hosts("gpu[008-010]"), ["gpu008", "gpu009", "gpu010"]);
        assert_eq!(hosts("n[3]x"), ["n3x"]);
    }

    #[test]
    fn several_groups_expand_every_combination_last_fastest() {
        assert_eq!(
            hosts("rack[1-2]-gpu[01-02]"),
            ["rack1-gpu01", "rack1-gpu02", "rack2-gpu01", "rack2-gpu02"]
        );
        assert_eq!(
            hosts("a[1,3]b[0-1],c"),
            ["a1b0", "a1b1", "a3b0", "a3b1", "c"]
        );
    }

    #[test]
    fn malformed_lists_are_errors_naming_the_part() {
        for (bad, says) in [
            ("", "empty"),
            ("a,,b", "empty entry"),
            ("node[1-2", "never closes"),
            ("node1-2]", "never opened"),
            ("node[2-1]", "backwards"),
            ("node[a-b]", "`a-b` is not a number"),
            ("node[1-]", "`1-` is not a number"),
            ("node[[1]]", "inside brackets"),
            ("node[0-99999999]", "more than"),
            ("a b", "space"),
        ] {
            let e = expand(bad).unwrap_err();
            assert!(e.contains(says), "{bad:?}: {e}");
        }
    }
}
