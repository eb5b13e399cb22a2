//! CONTRACT §4 as tables: dispatch order, the single forward override,
//! replacement, ownership, skip, and failure unwinding.

use offload_hooks::{
    BoxError, Forwarded, HookError, HookOwner, HookRegistry, ModelHook, PreForward, Registered,
};
use offload_tests::capture_logs;

/// The context: a trace of what ran.
type Trace = Vec<String>;

/// A hook scripted by its behaviour.
#[derive(Clone, Copy)]
enum Behaviour {
    Plain,
    Skip,
    FailPre,
    FailPost,
    Override,
    OverrideFails,
}

struct Scripted {
    name: &'static str,
    behaviour: Behaviour,
}

impl ModelHook<Trace> for Scripted {
    fn pre_forward(&mut self, t: &mut Trace) -> Result<PreForward, BoxError> {
        t.push(format!("pre:{}", self.name));
        match self.behaviour {
            Behaviour::Skip => Ok(PreForward::Skip),
            Behaviour::FailPre => Err("pre failed".into()),
            _ => Ok(PreForward::Continue),
        }
    }
    fn post_forward(&mut self, t: &mut Trace, f: &Forwarded) -> Result<(), BoxError> {
        let tag = match f {
            Forwarded::Ran => "ran".to_owned(),
            Forwarded::Skipped { by } => format!("skipped-by-{by}"),
            Forwarded::Failed => "failed".to_owned(),
        };
        t.push(format!("post:{}:{tag}", self.name));
        match self.behaviour {
            Behaviour::FailPost => Err("post failed".into()),
            _ => Ok(()),
        }
    }
    fn overrides_forward(&self) -> bool {
        matches!(
            self.behaviour,
            Behaviour::Override | Behaviour::OverrideFails
        )
    }
    fn forward(&mut self, t: &mut Trace) -> Result<(), BoxError> {
        t.push(format!("forward:{}", self.name));
        match self.behaviour {
            Behaviour::OverrideFails => Err("override failed".into()),
            _ => Ok(()),
        }
    }
}

fn owner() -> HookOwner {
    HookOwner::new("test")
}

/// Registers `hooks` in the given order, dispatches once with a module
/// forward that succeeds (or fails), and checks the trace and outcome.
fn check(
    hooks: &[(&'static str, Behaviour)],
    module_forward_fails: bool,
    expect_trace: &[&str],
    expect: Result<Forwarded, &str>,
) {
    let mut reg = HookRegistry::<Trace>::new();
    for (name, behaviour) in hooks {
        reg.register(
            *name,
            owner(),
            Box::new(Scripted {
                name,
                behaviour: *behaviour,
            }),
        )
        .unwrap();
    }
    let mut trace = Trace::new();
    let out = reg.dispatch(&mut trace, |t| {
        t.push("forward:module".into());
        if module_forward_fails {
            Err("module failed".into())
        } else {
            Ok(())
        }
    });
    assert_eq!(
        trace,
        expect_trace,
        "{:?}",
        hooks.iter().map(|h| h.0).collect::<Vec<_>>()
    );
    match (out, expect) {
        (Ok(got), Ok(want)) => assert_eq!(got, want),
        (Err(e), Err(needle)) => assert!(e.to_string().contains(needle), "`{e}` lacks `{needle}`"),
        (got, want) => panic!("got {got:?}, want {want:?}"),
    }
}

use Behaviour::*;

#[test]
fn dispatch_table() {
    let ran = Ok(Forwarded::Ran);
    // Pre in name order, post in reverse, whatever the registration order.
    check(
        &[("c", Plain), ("a", Plain), ("b", Plain)],
        false,
        &[
            "pre:a",
            "pre:b",
            "pre:c",
            "forward:module",
            "post:c:ran",
            "post:b:ran",
            "post:a:ran",
        ],
        ran.clone(),
    );
    check(&[], false, &["forward:module"], ran.clone());
    // An override replaces the module's forward.
    check(
        &[("b", Override), ("a", Plain)],
        false,
        &["pre:a", "pre:b", "forward:b", "post:b:ran", "post:a:ran"],
        ran.clone(),
    );
    // Skip: later pres and the forward do not run; posts of those that ran do.
    check(
        &[("a", Plain), ("b", Skip), ("c", Plain)],
        false,
        &[
            "pre:a",
            "pre:b",
            "post:b:skipped-by-b",
            "post:a:skipped-by-b",
        ],
        Ok(Forwarded::Skipped { by: "b".into() }),
    );
    check(
        &[("a", Skip), ("b", Override)],
        false,
        &["pre:a", "post:a:skipped-by-a"],
        Ok(Forwarded::Skipped { by: "a".into() }),
    );
    // A failing pre-forward unwinds the hooks that ran.
    check(
        &[("a", Plain), ("b", FailPre), ("c", Plain)],
        false,
        &["pre:a", "pre:b", "post:b:failed", "post:a:failed"],
        Err("pre_forward of `b` failed"),
    );
    // A failing forward: every post runs, the forward's error is returned.
    check(
        &[("a", Plain), ("b", Plain)],
        true,
        &[
            "pre:a",
            "pre:b",
            "forward:module",
            "post:b:failed",
            "post:a:failed",
        ],
        Err("forward of `forward` failed"),
    );
    check(
        &[("a", OverrideFails)],
        false,
        &["pre:a", "forward:a", "post:a:failed"],
        Err("forward of `a` failed"),
    );
    // A failing post: the others still run; the first error is returned.
    check(
        &[("a", FailPost), ("b", FailPost)],
        false,
        &[
            "pre:a",
            "pre:b",
            "forward:module",
            "post:b:ran",
            "post:a:ran",
        ],
        Err("post_forward of `b` failed"),
    );
}

#[test]
fn at_most_one_forward_override() {
    let mut reg = HookRegistry::<Trace>::new();
    reg.register(
        "cache",
        owner(),
        Box::new(Scripted {
            name: "cache",
            behaviour: Override,
        }),
    )
    .unwrap();
    let err = reg
        .register(
            "compile",
            owner(),
            Box::new(Scripted {
                name: "compile",
                behaviour: Override,
            }),
        )
        .unwrap_err();
    assert!(
        matches!(&err, HookError::SecondForwardOverride { name, existing } if name == "compile" && existing == "cache"),
        "{err:?}"
    );
    assert_eq!(
        reg.names().collect::<Vec<_>>(),
        ["cache"],
        "the failed registration changed nothing"
    );
    // Replacing the overriding hook itself is allowed.
    assert_eq!(
        reg.register(
            "cache",
            owner(),
            Box::new(Scripted {
                name: "cache",
                behaviour: Override
            })
        )
        .unwrap(),
        Registered::Replaced
    );
    assert_eq!(reg.forward_override(), Some("cache"));
}

#[test]
fn replacement_warns_and_ownership_is_enforced() {
    let layerwise = HookOwner::new("layerwise_offload");
    let cache = HookOwner::new("block_cache");
    let mut reg = HookRegistry::<Trace>::new();
    assert_eq!(
        reg.register(
            "layerwise_offload",
            layerwise.clone(),
            Box::new(Scripted {
                name: "x",
                behaviour: Plain
            })
        )
        .unwrap(),
        Registered::New
    );
    let (replaced, logs) = capture_logs(|| {
        reg.register(
            "layerwise_offload",
            layerwise.clone(),
            Box::new(Scripted {
                name: "y",
                behaviour: Plain,
            }),
        )
        .unwrap()
    });
    assert_eq!(replaced, Registered::Replaced);
    assert!(
        logs.contains("WARN") && logs.contains("layerwise_offload") && logs.contains("replaced"),
        "{logs}"
    );

    // Another owner may neither replace nor remove it.
    let err = reg
        .register(
            "layerwise_offload",
            cache.clone(),
            Box::new(Scripted {
                name: "z",
                behaviour: Plain,
            }),
        )
        .unwrap_err();
    assert!(matches!(err, HookError::NotOwner { .. }), "{err:?}");
    let err = reg.remove("layerwise_offload", &cache).err().unwrap();
    assert!(
        err.to_string().contains("owned by `layerwise_offload`"),
        "{err}"
    );
    let err = reg.remove("missing", &cache).err().unwrap();
    assert!(
        matches!(&err, HookError::NotFound { registered, .. } if registered == &["layerwise_offload"]),
        "{err:?}"
    );

    reg.register(
        "block_cache",
        cache.clone(),
        Box::new(Scripted {
            name: "c",
            behaviour: Skip,
        }),
    )
    .unwrap();
    reg.register(
        "timing",
        cache.clone(),
        Box::new(Scripted {
            name: "t",
            behaviour: Plain,
        }),
    )
    .unwrap();
    assert_eq!(reg.remove_owned_by(&layerwise), 1);
    assert_eq!(reg.names().collect::<Vec<_>>(), ["block_cache", "timing"]);
    assert!(reg.remove("timing", &cache).is_ok());
    assert_eq!(reg.owner_of("block_cache"), Some(&cache));
    assert_eq!(reg.len(), 1);
}
