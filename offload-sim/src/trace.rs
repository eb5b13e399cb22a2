//! The run's timeline: one track per stream, exported as a Chrome/Perfetto
//! trace (`chrome://tracing`, ui.perfetto.dev).

use serde::Serialize;
use serde_json::{Value, json};

/// One operation on one track.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TraceOp {
    /// The stream's name.
    pub track: String,
    /// What ran.
    pub name: String,
    /// Start, ns of virtual time.
    pub start_ns: u64,
    /// Duration, ns.
    pub duration_ns: u64,
}

/// Every operation of a run, in enqueue order.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Trace {
    /// The operations.
    pub ops: Vec<TraceOp>,
}

impl Trace {
    /// Appends one operation.
    pub fn push(&mut self, op: TraceOp) {
        self.ops.push(op);
    }

    /// The Chrome trace-event JSON: a complete event per operation, one
    /// thread (track) per stream, times in µs.
    pub fn to_chrome_json(&self) -> Value {
        let mut tracks: Vec<&str> = Vec::new();
        for op in &self.ops {
            if !tracks.contains(&op.track.as_str()) {
                tracks.push(&op.track);
            }
        }
        let tid = |t: &str| tracks.iter().position(|x| *x == t).unwrap_or(0);
        let mut events: Vec<Value> = tracks
            .iter()
            .enumerate()
            .map(|(i, t)| json!({"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": t}}))
            .collect();
        events.extend(self.ops.iter().map(|op| {
            json!({
                "name": op.name,
                "ph": "X",
                "pid": 0,
                "tid": tid(&op.track),
                "ts": op.start_ns as f64 / 1e3,
                "dur": op.duration_ns as f64 / 1e3,
            })
        }));
        json!({"traceEvents": events, "displayTimeUnit": "ms"})
    }
}
