//! A fast path for `collector.formats.decode.decode_request`: OTLP `ExportTraceServiceRequest` bytes straight
//! to `SpanRecord` objects, without building protobuf objects first.
//!
//! The Python decoder stays the reference. This one reads the canonical encodings exporters send and
//! answers `None` ("not certain") for anything whose result it could get wrong: malformed wire data,
//! invalid UTF-8 in any string field (protobuf refuses the request), a known field with another wire
//! type, groups, a repeated singular message (protobuf would merge it), several `AnyValue` members,
//! fields whose meaning depends on the proto version installed, or nesting that may pass
//! `MAX_VALUE_NESTING`. The caller then decodes the request with protobuf, which gives the same
//! answer, or raises.
//!
//! In the same pass it writes the spans' crash-journal line (`collector.live.journal._encode`), so the
//! journal costs the event loop no Python work per span.
//!
//! Modules, by job: `wire` (protobuf's wire format), `messages` (the request's messages, checked as
//! protobuf checks them), `values` (strings and attribute values), `facts` (a span's facts),
//! `journal` (the journal line's JSON), `decoder` (the `Decoder` class walking a request).

mod decoder;
mod facts;
mod journal;
mod messages;
mod values;
mod wire;

use messages::{check, kind, Msg, MESSAGES};
use pyo3::prelude::*;
use wire::repeated;

/// The number of spans in a serialized request, or None when protobuf may not parse it (it then
/// says why, or counts them itself).
#[pyfunction]
fn count_spans(payload: &[u8]) -> Option<usize> {
    check(Msg::Request, payload, 1).ok()?;
    let scopes = repeated(payload, 1).flat_map(|resource_spans| repeated(resource_spans, 2));
    Some(scopes.map(|scope_spans| repeated(scope_spans, 2).count()).sum())
}

/// The schema this decoder was written against, `{message: {field number: type}}` with message types
/// named, for a test to compare with the protobuf package installed.
#[pyfunction]
fn schema() -> Vec<(String, Vec<(u32, String)>)> {
    MESSAGES
        .iter()
        .map(|&msg| {
            let known = (1..=1000).filter_map(|number| kind(msg, number).map(|k| (number, format!("{k:?}"))));
            (format!("{msg:?}"), known.collect())
        })
        .collect()
}

#[pymodule]
fn agenteval_native(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_class::<decoder::Decoder>()?;
    module.add_function(wrap_pyfunction!(count_spans, module)?)?;
    module.add_function(wrap_pyfunction!(schema, module)?)?;
    module.add_function(wrap_pyfunction!(facts::py_strip, module)?)?;
    Ok(())
}
