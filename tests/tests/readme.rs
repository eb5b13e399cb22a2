//! The README's configuration block is what it claims: it parses as it is
//! (the Rust snippets are doctests of this crate, `src/lib.rs`).

use offload_core::{OffloadConfig, OffloadStrategy};

/// Every ```` ```toml ```` block of the README.
fn toml_blocks(readme: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in readme.lines() {
        match (&mut current, line.trim_end()) {
            (None, "```toml") => current = Some(String::new()),
            (Some(_), "```") => blocks.extend(current.take()),
            (Some(text), _) => {
                text.push_str(line);
                text.push('\n');
            }
            (None, _) => {}
        }
    }
    blocks
}

#[test]
fn the_readme_configuration_parses_and_selects_layerwise() {
    let readme = include_str!("../../README.md");
    let blocks = toml_blocks(readme);
    assert_eq!(blocks.len(), 1, "one TOML block in the README");
    let config = OffloadConfig::from_toml_str(&blocks[0]).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        config.select().unwrap().strategy,
        OffloadStrategy::Layerwise
    );
}
