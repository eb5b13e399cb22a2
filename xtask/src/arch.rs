//! The architecture check: the dependency closure (every edge kind, as
//! `cargo tree` counts them) of each hardware-neutral crate, taken from
//! `cargo metadata`, is fed to core's INV-6 predicate.

use std::collections::{BTreeMap, BTreeSet};
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

pub(crate) fn check_workspace() -> Result<()> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    check_sim_clock(&root)?;
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
}
