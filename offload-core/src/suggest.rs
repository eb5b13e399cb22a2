//! Near misses for error messages: the names closest to one that was not
//! found (a misspelled component, child or block path), so that an error
//! can say what was probably meant.

/// Edit distance (insertions, deletions, substitutions) between `a` and
/// `b`, by characters.
fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let above = row[j + 1];
            row[j + 1] = (above + 1)
                .min(row[j] + 1)
                .min(diagonal + usize::from(ca != *cb));
            diagonal = above;
        }
    }
    row[b.len()]
}

/// Up to three of `candidates` closest to `name`, all at the least edit
/// distance found: among those within a third of the longer name's length
/// (at least 2 edits), or that contain it or are contained in it.
pub(crate) fn nearest<'a>(
    name: &str,
    candidates: impl IntoIterator<Item = &'a str>,
) -> Vec<&'a str> {
    let mut scored: Vec<(usize, &str)> = candidates
        .into_iter()
        .filter(|c| *c != name)
        .filter_map(|c| {
            let d = distance(name, c);
            let limit = (name.chars().count().max(c.chars().count()) / 3).max(2);
            let related = !name.is_empty() && (c.contains(name) || name.contains(c));
            (d <= limit || related).then_some((d, c))
        })
        .collect();
    scored.sort();
    scored.dedup_by(|a, b| a.1 == b.1);
    let best = scored.first().map(|(d, _)| *d);
    scored
        .into_iter()
        .filter(|(d, _)| Some(*d) == best)
        .take(3)
        .map(|(_, c)| c)
        .collect()
}

/// `names` as "`a`, `b`, `c`", at most `limit` of them, then "… (n in all)".
pub(crate) fn listed<'a>(names: impl IntoIterator<Item = &'a str>, limit: usize) -> String {
    let names: Vec<&str> = names.into_iter().collect();
    let shown: Vec<String> = names.iter().take(limit).map(|n| format!("`{n}`")).collect();
    match names.len() {
        0 => "none".to_owned(),
        n if n > limit => format!("{}, … ({n} in all)", shown.join(", ")),
        _ => shown.join(", "),
    }
}

/// ", did you mean `x`?" (or "`x` or `y`") for the nearest candidates, or
/// nothing.
pub(crate) fn did_you_mean<'a>(
    name: &str,
    candidates: impl IntoIterator<Item = &'a str>,
) -> String {
    let near = nearest(name, candidates);
    if near.is_empty() {
        return String::new();
    }
    let quoted: Vec<String> = near.iter().map(|n| format!("`{n}`")).collect();
    format!("; did you mean {}?", quoted.join(" or "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn near_misses() {
        assert_eq!(distance("weigth", "weight"), 2);
        assert_eq!(distance("", "abc"), 3);
        let c = ["dit", "text_encoder", "vae"];
        assert_eq!(nearest("transformer", c), Vec::<&str>::new());
        assert_eq!(nearest("text_encoer", c), ["text_encoder"]);
        assert_eq!(nearest("di", c), ["dit"]);
        assert_eq!(did_you_mean("vea", c), "; did you mean `vae`?");
        assert_eq!(did_you_mean("zzzzzz", c), "");
        assert_eq!(listed(["a", "b", "c"], 2), "`a`, `b`, … (3 in all)");
        assert_eq!(listed([], 2), "none");
    }
}
