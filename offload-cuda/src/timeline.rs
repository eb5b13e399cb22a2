//! A GPU timeline: timed CUDA events around every copy and around spans the
//! caller marks, read back as spans on one track per stream (for a
//! Chrome/Perfetto trace).
//!
//! # The base
//!
//! [`CudaDevice::timeline_start`] drains the context (`cuCtxSynchronize`),
//! records one base event on the null stream and waits for it. The base has
//! completed before `timeline_start` returns, so its timestamp precedes every
//! event recorded afterwards, on any stream; every span is measured from it,
//! so tracks share one zero. Draining first makes a timeline begin on an idle
//! device: work enqueued earlier does not show up as a delay of the first
//! spans. (A base per stream, recorded when the stream is first seen, would
//! give each track its own zero and lose the comparison across streams.)
//!
//! # Cost
//!
//! Off, a copy pays one relaxed atomic load. On, each copy and marked span
//! records two events under a mutex. Events (timed: never
//! `CU_EVENT_DISABLE_TIMING`) come from a pool kept by the device and reused
//! by later timelines; they are destroyed when the device goes, or at once
//! when a timeline fails.
//!
//! # Readings
//!
//! A span's start and end are both measured from the base, so spans of one
//! stream never overlap in the output; `cuEventElapsedTime` resolves about
//! 0.5 µs, and its `f32` milliseconds about 1 µs after 10 s.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use cudarc::driver::{result, sys};

use crate::{CudaContext, CudaDevice, CudaError, CudaEvent, CudaStream, invalid, wrap};

/// One span of a stopped timeline.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TimelineSpan {
    /// The stream's label ([`CudaDevice::label_stream`]), or `stream 0x…`.
    pub track: String,
    /// A copy's description (`h2d 67.1 MB pinned → dev 0x7f…+0`), or the
    /// name given to [`CudaDevice::timeline_begin`].
    pub name: String,
    /// Start, ns after the timeline's base.
    pub start_ns: u64,
    /// Duration, ns.
    pub duration_ns: u64,
}

/// A span begun by [`CudaDevice::timeline_begin`], to pass to
/// [`CudaDevice::timeline_end`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpanId {
    /// The timeline it belongs to; 0 when begun while recording was off.
    run: u64,
    index: usize,
}

impl SpanId {
    /// A span begun while recording was off: ending it does nothing.
    const NONE: Self = Self { run: 0, index: 0 };
}

/// A recorded span; `stream` is the raw handle's address, a key only.
struct Span {
    stream: usize,
    name: String,
    start: CudaEvent,
    end: Option<CudaEvent>,
}

#[derive(Default)]
struct State {
    /// The current (or last) timeline's number, from 1.
    run: u64,
    /// `Some` while recording.
    base: Option<CudaEvent>,
    spans: Vec<Span>,
    /// Completed events, reused by later timelines.
    pool: Vec<CudaEvent>,
    labels: HashMap<usize, String>,
}

impl State {
    fn event(&mut self, ctx: &Arc<CudaContext>) -> Result<CudaEvent, CudaError> {
        match self.pool.pop() {
            Some(e) => Ok(e),
            None => CudaEvent::create(ctx, sys::CUevent_flags::CU_EVENT_DEFAULT),
        }
    }

    fn track(&self, stream: usize) -> String {
        self.labels
            .get(&stream)
            .cloned()
            .unwrap_or_else(|| format!("stream {stream:#x}"))
    }
}

/// A device's timeline recorder.
#[derive(Default)]
pub(crate) struct Recorder {
    /// Mirrors `state.base.is_some()`, for the copies' fast path.
    on: AtomicBool,
    state: Mutex<State>,
}

fn key(stream: sys::CUstream) -> usize {
    stream as usize
}

fn record(
    event: &CudaEvent,
    stream: sys::CUstream,
    what: impl FnOnce() -> String,
) -> Result<(), CudaError> {
    // SAFETY: the event is live (it holds its context); `stream` is the
    // null stream or a live stream of the caller's.
    wrap(unsafe { result::event::record(event.raw, stream) }, || {
        format!("cuEventRecord({})", what())
    })
}

/// The time from `from` to `to`, two completed events, in whole ns.
fn elapsed_ns(from: &CudaEvent, to: &CudaEvent, what: &str) -> Result<u64, CudaError> {
    // SAFETY: both events are live, timed, of one context, recorded and
    // completed (the caller synchronised them). cudarc's note asks for one
    // stream; the driver does not (`cuEventElapsedTime` only needs both
    // recorded in the same context), and the base is on the null stream.
    let ms = wrap(unsafe { result::event::elapsed(from.raw, to.raw) }, || {
        format!("cuEventElapsedTime({what})")
    })?;
    Ok(ms_to_ns(ms))
}

fn ms_to_ns(ms: f32) -> u64 {
    // Saturating: a negative reading (none is expected) gives 0.
    (f64::from(ms) * 1e6).round() as u64
}

/// A host→device copy's span name.
pub(crate) fn h2d_name(bytes: u64, source: &str, dst: sys::CUdeviceptr, offset: u64) -> String {
    format!(
        "h2d {:.1} MB {source} → dev {dst:#x}+{offset}",
        bytes as f64 / 1e6
    )
}

/// A device→host copy's span name.
pub(crate) fn d2h_name(bytes: u64, src: sys::CUdeviceptr, offset: u64) -> String {
    format!(
        "d2h {:.1} MB dev {src:#x}+{offset} → pinned",
        bytes as f64 / 1e6
    )
}

impl Recorder {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records a span's start on `stream`; `name` is called only when
    /// recording.
    pub(crate) fn begin(
        &self,
        ctx: &Arc<CudaContext>,
        stream: sys::CUstream,
        name: impl FnOnce() -> String,
    ) -> Result<SpanId, CudaError> {
        if !self.on.load(Ordering::Relaxed) {
            return Ok(SpanId::NONE);
        }
        let mut st = self.state();
        if st.base.is_none() {
            return Ok(SpanId::NONE);
        }
        ctx.bind()?;
        let start = st.event(ctx)?;
        let name = name();
        record(&start, stream, || format!("timeline, start of `{name}`"))?;
        st.spans.push(Span {
            stream: key(stream),
            name,
            start,
            end: None,
        });
        Ok(SpanId {
            run: st.run,
            index: st.spans.len() - 1,
        })
    }

    /// Records the end of span `id` on `stream`, the stream it began on.
    pub(crate) fn end(
        &self,
        ctx: &Arc<CudaContext>,
        stream: sys::CUstream,
        id: SpanId,
    ) -> Result<(), CudaError> {
        if id == SpanId::NONE {
            return Ok(());
        }
        let mut st = self.state();
        if st.base.is_none() {
            // Stopped since it began: the stop reported it as never ended.
            return Ok(());
        }
        let refuse = |why: String| {
            Err(invalid(
                sys::cudaError_enum::CUDA_ERROR_INVALID_VALUE,
                format!("timeline_end: {why}"),
            ))
        };
        let span = match st.spans.get(id.index) {
            Some(span) if id.run == st.run => span,
            _ => return refuse(format!("{id:?} is from an earlier timeline")),
        };
        if span.end.is_some() {
            return refuse(format!("span `{}` was already ended", span.name));
        }
        if span.stream != key(stream) {
            return refuse(format!(
                "span `{}` began on {} but ends on {}",
                span.name,
                st.track(span.stream),
                st.track(key(stream))
            ));
        }
        ctx.bind()?;
        let end = st.event(ctx)?;
        let span = &mut st.spans[id.index];
        record(&end, stream, || format!("timeline, end of `{}`", span.name))?;
        span.end = Some(end);
        Ok(())
    }

    pub(crate) fn start(&self, ctx: &Arc<CudaContext>) -> Result<(), CudaError> {
        let mut st = self.state();
        if st.base.is_some() {
            return Err(invalid(
                sys::cudaError_enum::CUDA_ERROR_INVALID_VALUE,
                "timeline_start: already recording".to_owned(),
            ));
        }
        ctx.synchronize()?;
        let base = st.event(ctx)?;
        record(&base, std::ptr::null_mut(), || {
            "timeline base, null stream".to_owned()
        })?;
        // SAFETY: the event is live and was just recorded.
        wrap(unsafe { result::event::synchronize(base.raw) }, || {
            "cuEventSynchronize(timeline base)".to_owned()
        })?;
        st.run += 1;
        st.base = Some(base);
        self.on.store(true, Ordering::Relaxed);
        Ok(())
    }

    pub(crate) fn stop(&self, ctx: &Arc<CudaContext>) -> Result<Vec<TimelineSpan>, CudaError> {
        self.on.store(false, Ordering::Relaxed);
        let mut st = self.state();
        let Some(base) = st.base.take() else {
            return Err(invalid(
                sys::cudaError_enum::CUDA_ERROR_INVALID_VALUE,
                "timeline_stop: no timeline was started".to_owned(),
            ));
        };
        // On any error below, the run's events drop here: destroyed (the
        // driver defers that for any still pending).
        let mut closed = Vec::with_capacity(st.spans.len());
        for span in std::mem::take(&mut st.spans) {
            let Some(end) = span.end else {
                return Err(invalid(
                    sys::cudaError_enum::CUDA_ERROR_INVALID_VALUE,
                    format!(
                        "timeline_stop: span `{}` on {} was begun but never ended",
                        span.name,
                        st.track(span.stream)
                    ),
                ));
            };
            closed.push((span.stream, span.name, span.start, end));
        }
        ctx.bind()?;
        let mut spans = Vec::with_capacity(closed.len());
        for (stream, name, start, end) in &closed {
            for e in [start, end] {
                // SAFETY: the event is live and was recorded.
                wrap(unsafe { result::event::synchronize(e.raw) }, || {
                    format!("cuEventSynchronize(timeline, `{name}`)")
                })?;
            }
            let start_ns = elapsed_ns(&base, start, name)?;
            spans.push(TimelineSpan {
                track: st.track(*stream),
                name: name.clone(),
                start_ns,
                duration_ns: elapsed_ns(&base, end, name)?.saturating_sub(start_ns),
            });
        }
        // Every event has completed: the pool keeps them for the next run.
        st.pool.push(base);
        for (_, _, start, end) in closed {
            st.pool.extend([start, end]);
        }
        // Stable: spans that start together keep their recording order.
        spans.sort_by_key(|s| s.start_ns);
        Ok(spans)
    }
}

impl CudaDevice {
    /// Starts recording a timeline: drains the device (`cuCtxSynchronize`),
    /// records the base (see the module documentation), and from then on
    /// `copy_h2d` and `copy_d2h` record a span each. Fails if a timeline is
    /// already recording.
    pub fn timeline_start(&self) -> Result<(), CudaError> {
        self.timeline.start(&self.ctx)
    }

    /// Names `stream`'s track in later [`TimelineSpan`]s (else
    /// `stream 0x…`). Keyed by the raw handle, so a label outlives its
    /// stream and names a later stream that reuses the handle.
    pub fn label_stream(&self, stream: &CudaStream, label: &str) {
        self.timeline
            .state()
            .labels
            .insert(key(stream.raw), label.to_owned());
    }

    /// Begins a span named `name` on `stream` (an event recorded there
    /// now), to end with [`Self::timeline_end`] on the same stream. While
    /// no timeline is recording, does nothing and returns an id that
    /// ending ignores.
    pub fn timeline_begin(
        &self,
        stream: &CudaStream,
        name: impl Into<String>,
    ) -> Result<SpanId, CudaError> {
        self.timeline.begin(&self.ctx, stream.raw, || name.into())
    }

    /// Ends span `span` on `stream` (an event recorded there now). Fails
    /// for a span already ended, begun on another stream, or from an
    /// earlier timeline; does nothing for a span begun while recording
    /// was off, or once the timeline has stopped.
    pub fn timeline_end(&self, stream: &CudaStream, span: SpanId) -> Result<(), CudaError> {
        self.timeline.end(&self.ctx, stream.raw, span)
    }

    /// Stops recording and blocks the host until every recorded event has
    /// completed (`cuEventSynchronize`), then returns the spans sorted by
    /// start. Fails, after releasing every event of the timeline, if a span
    /// was begun but never ended (naming it) or no timeline was started.
    pub fn timeline_stop(&self) -> Result<Vec<TimelineSpan>, CudaError> {
        self.timeline.stop(&self.ctx)
    }
}

#[cfg(test)]
mod tests {
    use super::{d2h_name, h2d_name, ms_to_ns};

    #[test]
    fn copy_names_give_megabytes_address_and_source() {
        let rows = [
            (
                h2d_name(680_000_000, "pinned", 0x7f00_0000_0000, 0),
                "h2d 680.0 MB pinned → dev 0x7f0000000000+0",
            ),
            (
                h2d_name(64 << 20, "registered", 0x10, 4096),
                "h2d 67.1 MB registered → dev 0x10+4096",
            ),
            (d2h_name(49_999, 0x20, 8), "d2h 0.0 MB dev 0x20+8 → pinned"),
        ];
        for (got, want) in rows {
            assert_eq!(got, want);
        }
    }

    #[test]
    fn milliseconds_become_whole_nanoseconds() {
        let rows = [(0.0, 0), (1.5, 1_500_000), (0.000_5, 500), (-0.001, 0)];
        for (ms, ns) in rows {
            assert_eq!(ms_to_ns(ms), ns, "{ms} ms");
        }
    }
}
