//! The architecture check: the dependency closure (every edge kind, as
//! `cargo tree` counts them) of each hardware-neutral crate, taken from
//! `cargo metadata`, is fed to core's INV-6 predicate; `offload-sim` reads
//! no wall clock; `offload-sim`'s library pulls in none of its command
//! line's dependencies; and `offload-core`'s files import in layers (no
//! import circle, and its description files import only description files).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, anyhow, bail};
use offload_core::invariants::platform_abstraction;
use serde_json::Value;

/// Crates that must stay hardware-neutral.
pub(crate) const NEUTRAL_CRATES: [&str; 2] = ["offload-core", "offload-hooks"];

/// Names that read the wall clock; the simulator's time is its own.
const WALL_CLOCK: [&str; 2] = ["Instant::now", "SystemTime"];

/// The one sanctioned read (file under `offload-sim/src`, name, most
/// occurrences): the collective group's last-resort hang limit, read only
/// while a rank waits for peers, never feeding simulated time.
const SANCTIONED: [(&str, &str, usize); 1] = [("collective.rs", "Instant::now", 1)];

/// `offload-sim` never reads the wall clock (its source, not its tests and
/// benches, which may time themselves), but for [`SANCTIONED`].
pub(crate) fn check_sim_clock(root: &std::path::Path) -> Result<()> {
    let mut offenders = Vec::new();
    let src = root.join("offload-sim/src");
    let mut dirs = vec![src.clone()];
    while let Some(dir) = dirs.pop() {
        for entry in
            std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))?
        {
            let path = entry?.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path)?;
                let relative = path.strip_prefix(&src).unwrap_or(&path);
                for w in WALL_CLOCK {
                    let allowed = SANCTIONED
                        .iter()
                        .find(|(file, name, _)| {
                            relative == std::path::Path::new(file) && *name == w
                        })
                        .map_or(0, |(_, _, most)| *most);
                    if text.matches(w).count() > allowed {
                        offenders.push(format!("{} names {w}", path.display()));
                    }
                }
            }
        }
    }
    if !offenders.is_empty() {
        bail!("offload-sim must not read the wall clock: {offenders:?}");
    }
    println!("xtask arch: offload-sim reads no wall clock but the collective's hang limit");
    Ok(())
}

/// The main job's command line dependencies, behind `offload-sim`'s default
/// `cli` feature: its library (built with `default-features = false`) must
/// not pull any of them in.
pub(crate) const CLI_ONLY: [&str; 4] = ["clap", "indicatif", "anyhow", "tracing-subscriber"];

/// `offload-sim` without default features names none of [`CLI_ONLY`] among
/// its normal dependencies, direct or transitive (as `cargo tree -e normal`
/// lists them).
pub(crate) fn check_sim_library_deps(root: &Path) -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let args = [
        "tree",
        "-p",
        "offload-sim",
        "--no-default-features",
        "-e",
        "normal",
        "--prefix",
        "none",
        "--locked",
    ];
    let out = Command::new(cargo)
        .args(args)
        .current_dir(root)
        .output()
        .context("cannot run `cargo tree`")?;
    if !out.status.success() {
        bail!(
            "`cargo {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let found = cli_only_in(&String::from_utf8_lossy(&out.stdout));
    if !found.is_empty() {
        bail!(
            "offload-sim's library (--no-default-features) depends on {}: \
             make it optional, behind the `cli` feature",
            found.join(", ")
        );
    }
    println!(
        "xtask arch: offload-sim's library (no default features) pulls in none of {}",
        CLI_ONLY.join(", ")
    );
    Ok(())
}

/// The crates of [`CLI_ONLY`] named in `cargo tree --prefix none` output
/// (one `name vX.Y.Z …` a line), each once, in [`CLI_ONLY`]'s order.
fn cli_only_in(tree: &str) -> Vec<&'static str> {
    let names: BTreeSet<&str> = tree
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .collect();
    CLI_ONLY
        .into_iter()
        .filter(|krate| names.contains(krate))
        .collect()
}

/// `offload-core`'s description files (relative to `offload-core/src`):
/// the vocabulary every other file builds on (sizes, declarations, the
/// schema, the configuration, requests, measurements, diagnostics, the
/// model, the concurrency shim, the device traits). A description may
/// import only other descriptions, so that it never depends on the
/// machinery that acts on it. Every listed file must exist.
pub(crate) const DESCRIPTIONS: [&str; 10] = [
    "bytes.rs",
    "declaration.rs",
    "schema.rs",
    "config.rs",
    "request.rs",
    "measurements.rs",
    "diagnostics.rs",
    "model.rs",
    "sync.rs",
    "device.rs",
];

/// The import graph of a crate's files: for each file (relative to `src`,
/// `/`-separated), the files it imports, each with the first path text
/// that made the edge (`crate::budget::ByteSize`).
pub(crate) type FileGraph = BTreeMap<String, BTreeMap<String, String>>;

/// The files under `src` import in layers: no import circle, and each of
/// `descriptions` imports only files in `descriptions` (all of which must
/// exist). Returns how many files the graph has; the error lists every
/// circle (its files, one concrete path with the text behind each edge, and
/// the other edges inside it) and every description's offending edge.
pub(crate) fn check_layers(src: &Path, descriptions: &[&str]) -> Result<usize> {
    let graph = file_graph(src)?;
    let mut problems = import_circles(&graph);
    problems.extend(description_violations(&graph, descriptions));
    if !problems.is_empty() {
        bail!(
            "{}'s files do not import in layers:\n{}",
            src.display(),
            problems.join("\n")
        );
    }
    Ok(graph.len())
}

/// The import graph of every `.rs` file under `src` (recursively).
///
/// A file's module path: `lib.rs` is the crate root, `a.rs` and `a/mod.rs`
/// are `crate::a`, `a/b.rs` is `crate::a::b`. Its edges come from its text
/// with comments and string and char literals blanked and test-only items
/// (those under `#[cfg(test)]` or `#[cfg(loom)]`) removed: test modules
/// stand outside the layering, since a test may use any module of its
/// crate and is no part of the library's build graph. The paths that make
/// an edge:
///
/// * `crate::…`, `super::…`, `self::…`, in `use` trees (grouped ones
///   expanded) and inline in code and types; each resolves to the longest
///   prefix that names a module file (`crate::a::b::X` is `a/b.rs` if that
///   exists, else `a.rs`), `crate::X` naming no module being the root;
/// * a path whose first segment is a child module the file declares
///   (`mod x;`, existing as a file), in a `use` (`pub use x::Thing`, so
///   that a `mod.rs` re-exporting its children imports them) or inline
///   (`x::f()`), as the 2018 edition resolves it.
///
/// A `mod x;` declaration alone is no edge, and neither is a file naming
/// its own module.
pub(crate) fn file_graph(src: &Path) -> Result<FileGraph> {
    let mut files = Vec::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in
            std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))?
        {
            let path = entry?.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let relative = path
                    .strip_prefix(src)?
                    .iter()
                    .map(|c| {
                        c.to_str()
                            .map(str::to_owned)
                            .ok_or_else(|| anyhow!("{} is not UTF-8", path.display()))
                    })
                    .collect::<Result<Vec<_>>>()?
                    .join("/");
                files.push((relative, path));
            }
        }
    }
    files.sort();
    let modules: BTreeMap<Vec<String>, String> = files
        .iter()
        .map(|(relative, _)| (module_path(relative), relative.clone()))
        .collect();
    let mut graph = FileGraph::new();
    for (relative, path) in &files {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let tokens = without_test_items(&lex(&code_only(&text)));
        let module = module_path(relative);
        let children: BTreeSet<&str> = tokens
            .windows(3)
            .filter(|w| w[0] == "mod" && is_ident(&w[1]) && w[2] == ";")
            .map(|w| w[1].as_str())
            .filter(|x| {
                let mut child = module.clone();
                child.push((*x).to_owned());
                modules.contains_key(&child)
            })
            .collect();
        let edges = graph.entry(relative.clone()).or_default();
        for path in referenced_paths(&tokens, &children) {
            if let Some(target) = resolve(&module, &path, &children, &modules)
                && target != relative
            {
                edges
                    .entry(target.clone())
                    .or_insert_with(|| path.join("::"));
            }
        }
    }
    Ok(graph)
}

/// The module path of a file relative to `src`: `lib.rs` is `[]`,
/// `a/mod.rs` and `a.rs` are `[a]`, `a/b.rs` is `[a, b]`.
fn module_path(relative: &str) -> Vec<String> {
    let mut parts: Vec<String> = relative.split('/').map(str::to_owned).collect();
    match parts.last().map(String::as_str) {
        Some("mod.rs") => {
            parts.pop();
        }
        Some("lib.rs") if parts.len() == 1 => parts.clear(),
        Some(last) => {
            let stem = last.strip_suffix(".rs").unwrap_or(last).to_owned();
            parts.pop();
            parts.push(stem);
        }
        None => {}
    }
    parts
}

/// Rust source with comments (line, doc and nested block comments) and
/// string, byte-string, raw-string and char literals blanked, so that a
/// path written inside one names nothing. Lifetimes stay.
fn code_only(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let at = |i: usize| chars.get(i).copied();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while let Some(c) = at(i) {
        if c == '/' && at(i + 1) == Some('/') {
            while at(i).is_some_and(|c| c != '\n') {
                i += 1;
            }
            out.push(' ');
        } else if c == '/' && at(i + 1) == Some('*') {
            let mut depth = 0usize;
            while let Some(c) = at(i) {
                if c == '/' && at(i + 1) == Some('*') {
                    depth += 1;
                    i += 2;
                } else if c == '*' && at(i + 1) == Some('/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            out.push(' ');
        } else if c == '"' {
            i += 1;
            while let Some(c) = at(i) {
                i += if c == '\\' { 2 } else { 1 };
                if c == '"' {
                    break;
                }
            }
            out.push(' ');
        } else if c == '\'' && at(i + 1) == Some('\\') {
            i += 3;
            while at(i).is_some_and(|c| c != '\'') {
                i += 1;
            }
            i += 1;
            out.push(' ');
        } else if c == '\'' && at(i + 2) == Some('\'') {
            i += 3;
            out.push(' ');
        } else if c.is_alphanumeric() || c == '_' {
            let start = i;
            while at(i).is_some_and(|c| c.is_alphanumeric() || c == '_') {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let mut hashes = 0;
            while at(i + hashes) == Some('#') {
                hashes += 1;
            }
            if matches!(word.as_str(), "r" | "br" | "cr") && at(i + hashes) == Some('"') {
                i += hashes + 1;
                while let Some(c) = at(i) {
                    i += 1;
                    if c == '"' && (0..hashes).all(|k| at(i + k) == Some('#')) {
                        i += hashes;
                        break;
                    }
                }
                out.push(' ');
            } else {
                out.push_str(&word);
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// Whether a token is an identifier or keyword (not a number or punctuation).
fn is_ident(token: &str) -> bool {
    token
        .chars()
        .next()
        .is_some_and(|c| c.is_alphabetic() || c == '_')
}

/// The tokens of blanked source: words, `::`, and single punctuation
/// characters.
fn lex(code: &str) -> Vec<String> {
    let chars: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(&c) = chars.get(i) {
        if c.is_whitespace() {
            i += 1;
        } else if c.is_alphanumeric() || c == '_' {
            let start = i;
            while chars
                .get(i)
                .is_some_and(|c| c.is_alphanumeric() || *c == '_')
            {
                i += 1;
            }
            out.push(chars[start..i].iter().collect());
        } else if c == ':' && chars.get(i + 1) == Some(&':') {
            out.push("::".to_owned());
            i += 2;
        } else {
            out.push(c.to_string());
            i += 1;
        }
    }
    out
}

/// The tokens without test-only items: each `#[cfg(test)]` or
/// `#[cfg(loom)]` and the item after it, up to its matching closing brace
/// or, for a one-line item, its `;`.
fn without_test_items(tokens: &[String]) -> Vec<String> {
    let test_attribute = |t: &[String]| {
        t.len() >= 7
            && t[0] == "#"
            && t[1] == "["
            && t[2] == "cfg"
            && t[3] == "("
            && (t[4] == "test" || t[4] == "loom")
            && t[5] == ")"
            && t[6] == "]"
    };
    let mut out = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        if !test_attribute(&tokens[i..]) {
            out.push(tokens[i].clone());
            i += 1;
            continue;
        }
        i += 7;
        let mut depth = 0usize;
        while let Some(t) = tokens.get(i) {
            i += 1;
            match t.as_str() {
                "(" | "[" | "{" => depth += 1,
                ")" | "]" => depth = depth.saturating_sub(1),
                "}" => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        break;
                    }
                }
                ";" if depth == 0 => break,
                _ => {}
            }
        }
    }
    out
}

/// Every path that may name a module of the crate, in source order: the
/// expanded leaves of each `use` tree, and each inline path starting with
/// `crate`, `super`, `self` or one of `children`.
fn referenced_paths(tokens: &[String], children: &BTreeSet<&str>) -> Vec<Vec<String>> {
    let mut paths = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        let t = tokens[i].as_str();
        if t == "use" {
            i += 1;
            use_tree(tokens, &mut i, &[], &mut paths);
            continue;
        }
        let before = |k: usize| i.checked_sub(k).map(|j| tokens[j].as_str());
        let starts = matches!(t, "crate" | "super" | "self") || children.contains(t);
        let restricted = before(1) == Some("in") && before(2) == Some("(");
        if starts
            && tokens.get(i + 1).is_some_and(|n| n == "::")
            && !matches!(before(1), Some("::" | "."))
            && !restricted
        {
            let mut path = vec![t.to_owned()];
            i += 1;
            while tokens.get(i).is_some_and(|n| n == "::")
                && tokens.get(i + 1).is_some_and(|n| is_ident(n))
            {
                path.push(tokens[i + 1].clone());
                i += 2;
            }
            paths.push(path);
            continue;
        }
        i += 1;
    }
    paths
}

/// Parses the `use` tree at `tokens[*i]` (after `use` or inside a group),
/// pushing each leaf's full path (`prefix` included) onto `out`; a glob
/// leaf ends in `*`. Stops after the tree, before its `,`, `}` or `;`.
fn use_tree(tokens: &[String], i: &mut usize, prefix: &[String], out: &mut Vec<Vec<String>>) {
    let mut path = prefix.to_vec();
    if tokens.get(*i).is_some_and(|t| t == "::") {
        // `use ::name`: an external crate, never a module of this one.
        path.push(String::new());
        *i += 1;
    }
    while let Some(t) = tokens.get(*i) {
        if t == "{" {
            *i += 1;
            while tokens.get(*i).is_some_and(|t| t != "}") {
                let from = *i;
                use_tree(tokens, i, &path, out);
                if tokens.get(*i).is_some_and(|t| t == ",") {
                    *i += 1;
                } else if *i == from {
                    return;
                }
            }
            *i += 1;
            return;
        } else if t == "*" {
            path.push(t.clone());
            *i += 1;
            out.push(path);
            return;
        } else if is_ident(t) {
            path.push(t.clone());
            *i += 1;
            if tokens.get(*i).is_some_and(|t| t == "::") {
                *i += 1;
                continue;
            }
            if tokens.get(*i).is_some_and(|t| t == "as") {
                *i += 2;
            }
            out.push(path);
            return;
        } else {
            return;
        }
    }
}

/// The file that `path`, written in the file of module `module`, names:
/// its base (`crate`, `super`/`self` relative to `module`, or one of the
/// file's `children`) extended by the longest run of its following
/// segments that is still a module file. `None` for a path naming no
/// module of this crate.
fn resolve<'m>(
    module: &[String],
    path: &[String],
    children: &BTreeSet<&str>,
    modules: &'m BTreeMap<Vec<String>, String>,
) -> Option<&'m String> {
    let first = path.first()?.as_str();
    let (mut base, rest) = if first == "crate" {
        (Vec::new(), &path[1..])
    } else if first == "super" || first == "self" {
        let mut base = module.to_vec();
        let mut k = 0;
        while let Some(segment) = path.get(k) {
            match segment.as_str() {
                "super" => {
                    base.pop()?;
                }
                "self" => {}
                _ => break,
            }
            k += 1;
        }
        (base, &path[k..])
    } else if children.contains(first) {
        let mut base = module.to_vec();
        base.push(first.to_owned());
        (base, &path[1..])
    } else {
        return None;
    };
    let depth = base.len();
    base.extend(rest.iter().cloned());
    (depth..=base.len())
        .rev()
        .find_map(|n| modules.get(&base[..n]))
}

/// Every import circle: for each strongly connected set of more than one
/// file, its files, one concrete circle through them with the text behind
/// each edge, and the set's other edges.
fn import_circles(graph: &FileGraph) -> Vec<String> {
    let reach: BTreeMap<&str, BTreeSet<&str>> = graph
        .keys()
        .map(|file| {
            let mut seen = BTreeSet::new();
            let mut stack = vec![file.as_str()];
            while let Some(f) = stack.pop() {
                for next in graph.get(f).into_iter().flat_map(BTreeMap::keys) {
                    if seen.insert(next.as_str()) {
                        stack.push(next);
                    }
                }
            }
            (file.as_str(), seen)
        })
        .collect();
    let mut done = BTreeSet::new();
    let mut circles = Vec::new();
    for (file, reached) in &reach {
        if done.contains(file) || !reached.contains(file) {
            continue;
        }
        let set: BTreeSet<&str> = reached
            .iter()
            .copied()
            .filter(|other| reach.get(other).is_some_and(|r| r.contains(file)))
            .collect();
        done.extend(set.iter().copied());
        let evidence = |from: &str, to: &str| {
            graph
                .get(from)
                .and_then(|e| e.get(to))
                .map_or("?", String::as_str)
                .to_owned()
        };
        let cycle = shortest_cycle(graph, file, &set);
        let mut text = format!(
            "import circle among {} files ({}): {}",
            set.len(),
            set.iter().copied().collect::<Vec<_>>().join(", "),
            cycle.join(" -> ")
        );
        let on_cycle: BTreeSet<(&str, &str)> = cycle.windows(2).map(|w| (w[0], w[1])).collect();
        for w in cycle.windows(2) {
            text.push_str(&format!(
                "\n    {} -> {} ({})",
                w[0],
                w[1],
                evidence(w[0], w[1])
            ));
        }
        let others: Vec<String> = set
            .iter()
            .flat_map(|from| {
                graph
                    .get(*from)
                    .into_iter()
                    .flat_map(BTreeMap::iter)
                    .filter(|(to, _)| set.contains(to.as_str()))
                    .filter(|(to, _)| !on_cycle.contains(&(*from, to.as_str())))
                    .map(move |(to, why)| format!("\n      {from} -> {to} ({why})"))
            })
            .collect();
        if !others.is_empty() {
            text.push_str("\n    other edges inside it:");
            text.push_str(&others.concat());
        }
        circles.push(text);
    }
    circles
}

/// A shortest path `start -> … -> start` through `set` (breadth first);
/// `start` is in a strongly connected `set` of more than one file, so one
/// exists.
fn shortest_cycle<'g>(graph: &'g FileGraph, start: &'g str, set: &BTreeSet<&str>) -> Vec<&'g str> {
    let mut parent: BTreeMap<&str, &str> = BTreeMap::new();
    let mut queue = std::collections::VecDeque::from([start]);
    while let Some(f) = queue.pop_front() {
        for next in graph.get(f).into_iter().flat_map(BTreeMap::keys) {
            let next = next.as_str();
            if next == start {
                let mut path = vec![start, f];
                let mut at = f;
                while let Some(&p) = parent.get(at) {
                    path.push(p);
                    at = p;
                }
                path.reverse();
                return path;
            }
            if set.contains(next) && !parent.contains_key(next) && next != start {
                parent.insert(next, f);
                queue.push_back(next);
            }
        }
    }
    vec![start]
}

/// Each of `descriptions` that does not exist, and each edge from a
/// description to a file that is not one.
fn description_violations(graph: &FileGraph, descriptions: &[&str]) -> Vec<String> {
    let mut violations = Vec::new();
    for description in descriptions {
        let Some(edges) = graph.get(*description) else {
            violations.push(format!(
                "description file {description} is listed but does not exist"
            ));
            continue;
        };
        for (to, why) in edges {
            if !descriptions.contains(&to.as_str()) {
                violations.push(format!(
                    "description {description} -> {to} ({why}), which is not a description"
                ));
            }
        }
    }
    violations
}

pub(crate) fn check_workspace() -> Result<()> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    check_sim_clock(&root)?;
    check_sim_library_deps(&root)?;
    let files = check_layers(&root.join("offload-core/src"), &DESCRIPTIONS)?;
    println!(
        "xtask arch: offload-core's {files} files import in layers (no circle; descriptions import only descriptions)"
    );
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let out = Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--locked"])
        .output()
        .context("cannot run `cargo metadata`")?;
    if !out.status.success() {
        bail!(
            "`cargo metadata` failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let metadata: Value = serde_json::from_slice(&out.stdout)?;
    for krate in NEUTRAL_CRATES {
        let closure = dependency_closure(&metadata, krate)?;
        platform_abstraction(krate, closure.iter().map(String::as_str))?;
        println!(
            "xtask arch: `{krate}` ({} dependencies) names no device library",
            closure.len()
        );
    }
    Ok(())
}

/// Names of every package reachable from `krate` in the resolve graph.
pub(crate) fn dependency_closure(metadata: &Value, krate: &str) -> Result<BTreeSet<String>> {
    let packages = metadata["packages"]
        .as_array()
        .ok_or_else(|| anyhow!("cargo metadata has no packages"))?;
    let name_of: BTreeMap<&str, &str> = packages
        .iter()
        .filter_map(|p| Some((p["id"].as_str()?, p["name"].as_str()?)))
        .collect();
    let root = name_of
        .iter()
        .find(|(_, n)| **n == krate)
        .map(|(id, _)| *id)
        .ok_or_else(|| anyhow!("package `{krate}` is not in the workspace"))?;
    let nodes = metadata["resolve"]["nodes"]
        .as_array()
        .ok_or_else(|| anyhow!("cargo metadata has no resolve graph"))?;
    let deps_of: BTreeMap<&str, Vec<&str>> = nodes
        .iter()
        .filter_map(|n| {
            let deps = n["deps"]
                .as_array()?
                .iter()
                .filter_map(|d| d["pkg"].as_str())
                .collect();
            Some((n["id"].as_str()?, deps))
        })
        .collect();
    let mut seen = BTreeSet::new();
    let mut stack = vec![root];
    while let Some(id) = stack.pop() {
        for dep in deps_of.get(id).into_iter().flatten() {
            if seen.insert(*dep) {
                stack.push(dep);
            }
        }
    }
    Ok(seen
        .into_iter()
        .filter_map(|id| name_of.get(id).map(|n| (*n).to_owned()))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A metadata document: packages `(id, name)` and edges `(from, to)`.
    fn metadata(packages: &[&str], edges: &[(&str, &str)]) -> Value {
        json!({
            "packages": packages.iter().map(|p| json!({"id": format!("{p}-id"), "name": p})).collect::<Vec<_>>(),
            "resolve": {"nodes": packages.iter().map(|p| json!({
                "id": format!("{p}-id"),
                "deps": edges.iter().filter(|(f, _)| f == p).map(|(_, t)| json!({"pkg": format!("{t}-id")})).collect::<Vec<_>>(),
            })).collect::<Vec<_>>()},
        })
    }

    fn check(packages: &[&str], edges: &[(&str, &str)], expect_violation: bool) {
        let m = metadata(packages, edges);
        let closure = dependency_closure(&m, "offload-core").unwrap();
        let result = platform_abstraction("offload-core", closure.iter().map(String::as_str));
        assert_eq!(
            result.is_err(),
            expect_violation,
            "{packages:?} {edges:?}: {result:?}"
        );
    }

    #[test]
    fn clean_closure_passes() {
        check(
            &["offload-core", "serde", "serde_derive"],
            &[("offload-core", "serde"), ("serde", "serde_derive")],
            false,
        );
    }

    #[test]
    fn planted_direct_cudarc_is_caught() {
        check(
            &["offload-core", "cudarc"],
            &[("offload-core", "cudarc")],
            true,
        );
    }

    #[test]
    fn planted_transitive_nccl_is_caught() {
        check(
            &["offload-core", "helper", "nccl-sys"],
            &[("offload-core", "helper"), ("helper", "nccl-sys")],
            true,
        );
    }

    #[test]
    fn backend_depending_on_cudarc_is_not_core() {
        check(
            &["offload-core", "offload-cuda", "cudarc"],
            &[("offload-cuda", "offload-core"), ("offload-cuda", "cudarc")],
            false,
        );
    }

    /// The wall-clock scan: the sanctioned read passes, a second one in the
    /// same file or any in another file is caught.
    #[test]
    fn wall_clock_scan_allows_only_the_hang_limit() {
        let root = std::env::temp_dir().join(format!("xtask-clock-{}", std::process::id()));
        let src = root.join("offload-sim/src");
        std::fs::create_dir_all(&src).unwrap();
        let scan = |collective: &str, device: &str| {
            std::fs::write(src.join("collective.rs"), collective).unwrap();
            std::fs::write(src.join("device.rs"), device).unwrap();
            check_sim_clock(&root).is_ok()
        };
        let once = "let now = Instant::now();";
        assert!(scan(once, ""));
        assert!(!scan(&format!("{once}{once}"), ""));
        assert!(!scan(once, "SystemTime"));
        assert!(!scan("", once));
        std::fs::remove_dir_all(&root).unwrap();
    }

    /// The command line crates are found by name in `cargo tree --prefix
    /// none` output, whatever follows the name; a crate whose name only
    /// contains one (`clap_lex`, `anyhow-ext`) is not one.
    #[test]
    fn cli_dependencies_are_found_by_name() {
        let clean = "offload-sim v0.1.0 (/w/offload-sim)\nclap_lex v0.7.0\nserde v1.0.0\n";
        assert_eq!(cli_only_in(clean), Vec::<&str>::new());
        let dirty =
            "offload-sim v0.1.0 (/w/offload-sim)\nanyhow v1.0.105\nclap v4.6.9\nclap v4.6.9 (*)\n";
        assert_eq!(cli_only_in(dirty), ["clap", "anyhow"]);
        assert_eq!(
            cli_only_in("tracing-subscriber v0.3.23\n"),
            ["tracing-subscriber"]
        );
    }

    /// Writes `files` (paths relative to `src`) into a fresh tree named
    /// `name` under the temporary folder; returns its `src`.
    fn write_tree(name: &str, files: &[(&str, &str)]) -> std::path::PathBuf {
        let root = std::env::temp_dir().join(format!("xtask-layers-{}-{name}", std::process::id()));
        let src = root.join("src");
        for (path, text) in files {
            let path = src.join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        }
        src
    }

    /// The layer check over a synthetic tree (removed afterwards), the
    /// error as text.
    fn layers(name: &str, files: &[(&str, &str)], descriptions: &[&str]) -> Result<usize, String> {
        let src = write_tree(name, files);
        let result = check_layers(&src, descriptions).map_err(|e| e.to_string());
        std::fs::remove_dir_all(src.parent().unwrap()).unwrap();
        result
    }

    /// The file graph of a synthetic tree (removed afterwards).
    fn graph_of(name: &str, files: &[(&str, &str)]) -> FileGraph {
        let src = write_tree(name, files);
        let graph = file_graph(&src).unwrap();
        std::fs::remove_dir_all(src.parent().unwrap()).unwrap();
        graph
    }

    /// The layer check failed, naming every one of `needles`.
    fn assert_caught(result: &Result<usize, String>, needles: &[&str]) {
        let Err(message) = result else {
            panic!("expected the layer check to fail naming {needles:?}, it passed: {result:?}");
        };
        for needle in needles {
            assert!(
                message.contains(needle),
                "`{needle}` missing from:\n{message}"
            );
        }
    }

    /// A layered tree passes: the root re-exports a child that imports
    /// downward, a leaf uses a root re-export nothing below depends on, a
    /// file naming itself is no edge, and neither is `mod x;`.
    #[test]
    fn layer_check_passes_a_layered_tree() {
        let files = [
            (
                "lib.rs",
                "pub mod base;\npub mod mid;\nmod top;\npub mod leaf;\npub use top::Top;\npub struct Root;",
            ),
            (
                "base.rs",
                "pub struct Base;\nimpl Base { pub fn new() -> crate::base::Base { self::Base } }",
            ),
            (
                "mid.rs",
                "use crate::base::Base;\npub struct Mid(pub Base);",
            ),
            (
                "top.rs",
                "use crate::{base::Base, mid::Mid};\npub struct Top(Mid, Base);",
            ),
            ("leaf.rs", "use crate::Root;\npub fn f(_: Root) {}"),
        ];
        assert_eq!(layers("clean", &files, &["base.rs"]), Ok(5));
    }

    /// `a.rs` and `b.rs` importing each other through `crate::` paths: the
    /// circle is named with the path text behind each edge.
    #[test]
    fn layer_check_names_a_two_file_circle() {
        let tree = |b| {
            [
                ("lib.rs", "mod a;\nmod b;"),
                ("a.rs", "use crate::b::X;\npub struct Y;"),
                ("b.rs", b),
            ]
        };
        assert_caught(
            &layers("two", &tree("use crate::a::Y;\npub struct X;"), &[]),
            &[
                "import circle among 2 files (a.rs, b.rs): a.rs -> b.rs -> a.rs",
                "a.rs -> b.rs (crate::b::X)",
                "b.rs -> a.rs (crate::a::Y)",
            ],
        );
        assert_eq!(layers("two-control", &tree("pub struct X;"), &[]), Ok(3));
    }

    /// Siblings importing each other through `super::`, one in a `use`, the
    /// other inline.
    #[test]
    fn layer_check_catches_a_circle_through_super() {
        let tree = |d| {
            [
                ("lib.rs", "pub mod p;"),
                ("p/mod.rs", "pub mod c;\npub mod d;"),
                ("p/c.rs", "use super::d::D;\npub struct C;"),
                ("p/d.rs", d),
            ]
        };
        assert_caught(
            &layers(
                "super",
                &tree("pub struct D;\npub fn make() -> super::c::C { super::c::C }"),
                &[],
            ),
            &[
                "p/c.rs -> p/d.rs (super::d::D)",
                "p/d.rs -> p/c.rs (super::c::C)",
            ],
        );
        assert_eq!(layers("super-control", &tree("pub struct D;"), &[]), Ok(4));
    }

    /// A `mod.rs` re-exporting its child (`mod x; pub use x::Thing;`) while
    /// the child uses an item defined in the `mod.rs` is a circle; the child
    /// importing from a sibling file instead is not.
    #[test]
    fn layer_check_catches_a_circle_through_a_re_exporting_mod_rs() {
        let tree = |x| {
            [
                ("lib.rs", "mod parent;"),
                (
                    "parent/mod.rs",
                    "mod x;\nmod y;\npub use x::Thing;\npub struct Other;",
                ),
                ("parent/x.rs", x),
                ("parent/y.rs", "pub struct Sibling;"),
            ]
        };
        assert_caught(
            &layers(
                "reexport",
                &tree("use crate::parent::Other;\npub struct Thing(Other);"),
                &[],
            ),
            &[
                "parent/mod.rs -> parent/x.rs (x::Thing)",
                "parent/x.rs -> parent/mod.rs (crate::parent::Other)",
            ],
        );
        assert_eq!(
            layers(
                "reexport-control",
                &tree("use crate::parent::y::Sibling;\npub struct Thing(Sibling);"),
                &[],
            ),
            Ok(4)
        );
    }

    /// A child of `lib.rs` that `lib.rs` re-exports, using a root re-export
    /// (`crate::B`), is in a circle with `lib.rs`; naming `crate::b::B` is not.
    #[test]
    fn layer_check_catches_a_circle_through_a_root_re_export() {
        let tree = |a| {
            [
                ("lib.rs", "mod a;\nmod b;\npub use a::A;\npub use b::B;"),
                ("a.rs", a),
                ("b.rs", "pub struct B;"),
            ]
        };
        assert_caught(
            &layers("root", &tree("use crate::B;\npub struct A(B);"), &[]),
            &["lib.rs -> a.rs (a::A)", "a.rs -> lib.rs (crate::B)"],
        );
        assert_eq!(
            layers(
                "root-control",
                &tree("use crate::b::B;\npub struct A(B);"),
                &[]
            ),
            Ok(3)
        );
    }

    /// A path in a comment, a doc comment, a string or raw string, or a
    /// test-only item makes no edge; the same path in code does, past
    /// lifetimes, char literals, comments and a removed test module.
    #[test]
    fn layer_check_ignores_comments_literals_and_test_items() {
        let tree = |a: &str| {
            let a = format!("pub struct Y;\n{a}\n");
            let files = [
                ("lib.rs", "mod a;\nmod b;".to_owned()),
                ("a.rs", a),
                ("b.rs", "use crate::a::Y;\npub struct X;".to_owned()),
            ];
            layers(
                "hidden",
                &files
                    .iter()
                    .map(|(p, t)| (*p, t.as_str()))
                    .collect::<Vec<_>>(),
                &[],
            )
        };
        let hidden = [
            "// use crate::b::X;",
            "/// See crate::b::X.\npub fn f() {}",
            "//! crate::b::X",
            "/* crate::b::X /* nested */ crate::b::X */",
            "/** crate::b::X */\npub fn f() {}",
            r#"pub const S: &str = "crate::b::X \" crate::b::X";"#,
            r##"pub const S: &str = r#"crate::b::X " crate::b::X"#;"##,
            r#"pub const S: &[u8] = b"crate::b::X";"#,
            r#"pub const C: char = '"'; pub const S: &str = "crate::b::X";"#,
            "#[cfg(test)]\nmod tests {\n    use super::*;\n    use crate::b::*;\n}",
            "#[cfg(loom)]\nmod loom_models {\n    use crate::b::X;\n    fn f() { let _ = crate::b::X; }\n}",
            "#[cfg(test)]\nuse crate::b::X;",
        ];
        for a in hidden {
            assert_eq!(tree(a), Ok(3), "{a}");
        }
        let visible = [
            "use crate::b::X;",
            "pub fn f() -> crate::b::X { crate::b::X }",
            "pub fn f<'a>(s: &'a str) -> &'a str { s }\npub const C: char = 'x';\nuse crate::b::X;",
            r#"pub const C: char = '\''; pub const S: &str = "\\"; use crate::b::X;"#,
            "/* c */ use crate::b::X; // c",
            "#[cfg(not(test))]\nuse crate::b::X;",
            "#[cfg(test)]\nmod tests {\n    use super::*;\n}\nuse crate::b::X;",
        ];
        for a in visible {
            assert_caught(&tree(a), &["a.rs -> b.rs (crate::b::X)"]);
        }
    }

    /// A grouped `use` tree makes an edge to each module it names, and none
    /// to the root it starts from.
    #[test]
    fn layer_check_expands_grouped_use_trees() {
        let tree = |c| {
            [
                ("lib.rs", "mod a;\nmod b;\nmod c;"),
                ("a.rs", "use crate::{b::X, c::{Y, Z}};\npub struct A;"),
                ("b.rs", "pub struct X;"),
                ("c.rs", c),
            ]
        };
        let graph = graph_of("grouped", &tree("pub struct Y;\npub struct Z;"));
        let expected: BTreeMap<String, String> = [
            ("b.rs".to_owned(), "crate::b::X".to_owned()),
            ("c.rs".to_owned(), "crate::c::Y".to_owned()),
        ]
        .into();
        assert_eq!(graph["a.rs"], expected);
        assert_caught(
            &layers(
                "grouped-circle",
                &tree("use crate::a::A;\npub struct Y;\npub struct Z;"),
                &[],
            ),
            &["a.rs -> c.rs (crate::c::Y)", "c.rs -> a.rs (crate::a::A)"],
        );
    }

    /// A path resolves to the longest prefix that names a module file, and
    /// `super` counts from the file's module.
    #[test]
    fn layer_check_resolves_the_longest_module_prefix() {
        let graph = graph_of(
            "prefix",
            &[
                ("lib.rs", "pub mod runtime;\nmod user;\npub struct Root;"),
                (
                    "runtime/mod.rs",
                    "mod layout;\npub struct Backend;\nuse super::Root;",
                ),
                (
                    "runtime/layout.rs",
                    "pub struct Unit;\npub fn root() -> super::super::Root { super::super::Root }",
                ),
                (
                    "user.rs",
                    "use crate::runtime::layout::Unit;\npub fn f(_: crate::runtime::Backend) {}",
                ),
            ],
        );
        let edges = |file: &str| -> Vec<(&str, &str)> {
            graph[file]
                .iter()
                .map(|(to, why)| (to.as_str(), why.as_str()))
                .collect()
        };
        assert_eq!(
            edges("user.rs"),
            [
                ("runtime/layout.rs", "crate::runtime::layout::Unit"),
                ("runtime/mod.rs", "crate::runtime::Backend"),
            ]
        );
        assert_eq!(edges("runtime/mod.rs"), [("lib.rs", "super::Root")]);
        assert_eq!(
            edges("runtime/layout.rs"),
            [("lib.rs", "super::super::Root")]
        );
        assert_eq!(edges("lib.rs"), []);
    }

    /// A description importing a file that is not one is caught, and so is
    /// a listed description that does not exist.
    #[test]
    fn layer_check_keeps_descriptions_to_descriptions() {
        let tree = |model| {
            [
                ("lib.rs", "mod model;\nmod plan;\nmod sync;"),
                ("model.rs", model),
                ("plan.rs", "pub struct Plan;"),
                ("sync.rs", "pub use std::sync::Arc;"),
            ]
        };
        let descriptions = ["model.rs", "sync.rs"];
        let planted = layers(
            "description",
            &tree("use crate::sync::Arc;\nuse crate::plan::Plan;"),
            &descriptions,
        );
        assert_caught(
            &planted,
            &["description model.rs -> plan.rs (crate::plan::Plan), which is not a description"],
        );
        assert!(!planted.unwrap_err().contains("-> sync.rs"));
        let clean = tree("use crate::sync::Arc;");
        assert_eq!(layers("description-control", &clean, &descriptions), Ok(4));
        assert_caught(
            &layers(
                "description-missing",
                &clean,
                &["model.rs", "sync.rs", "gone.rs"],
            ),
            &["description file gone.rs is listed but does not exist"],
        );
    }
}
