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

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyInt, PyList, PyString, PyTuple};
use rustc_hash::FxHashMap;
use std::sync::Mutex;

/// Message nesting past which a request is left to protobuf (`collector.formats.decode.parse_request`): the
/// shallowest an attribute value nested past `MAX_VALUE_NESTING` (100) can be is 207 (a resource
/// attribute's value is 5 messages deep, each array adds 2), so every request within it takes its
/// values whole and none of its spans is rejected for nesting.
const MAX_DEPTH: u32 = 206;

/// "Not certain to decode this exactly as protobuf does": the caller falls back to protobuf.
struct Bail;

/// Why a decode stopped: a request to leave to protobuf, or a Python error (out of memory).
enum Stop {
    Bail,
    Py(PyErr),
}

impl From<Bail> for Stop {
    fn from(_: Bail) -> Self {
        Stop::Bail
    }
}

impl From<PyErr> for Stop {
    fn from(err: PyErr) -> Self {
        Stop::Py(err)
    }
}

type R<T, E = Bail> = Result<T, E>;

// --- wire format ------------------------------------------------------------------------------------

/// One field's value as the wire carries it (groups are never accepted).
#[derive(Clone, Copy)]
enum Value<'a> {
    Varint(u64),
    I64(u64),
    Len(&'a [u8]),
    /// fixed32 (flags): never read
    I32,
}

/// The fields of one message, in wire order.
struct Fields<'a> {
    buf: &'a [u8],
    pos: usize,
}

/// The fields of a message nested `depth` messages deep (the request is 1).
fn fields(buf: &[u8], depth: u32) -> R<Fields<'_>> {
    if depth > MAX_DEPTH {
        return Err(Bail);
    }
    Ok(Fields { buf, pos: 0 })
}

impl<'a> Fields<'a> {
    /// A varint of at most `max_bytes` bytes; a 10-byte one whose last byte overflows 64 bits is
    /// left to protobuf.
    #[inline(always)]
    fn varint(&mut self, max_bytes: usize) -> R<u64> {
        match self.buf.get(self.pos) {
            Some(&byte) if byte < 0x80 => {
                self.pos += 1;
                Ok(u64::from(byte))
            }
            _ => self.long_varint(max_bytes),
        }
    }

    fn long_varint(&mut self, max_bytes: usize) -> R<u64> {
        let mut value = 0u64;
        for i in 0..max_bytes {
            let byte = *self.buf.get(self.pos).ok_or(Bail)?;
            self.pos += 1;
            value |= u64::from(byte & 0x7f) << (7 * i);
            if byte < 0x80 {
                return if i == 9 && byte > 1 { Err(Bail) } else { Ok(value) };
            }
        }
        Err(Bail)
    }

    #[inline(always)]
    fn take(&mut self, len: u64) -> R<&'a [u8]> {
        let end = usize::try_from(len)
            .ok()
            .and_then(|len| self.pos.checked_add(len))
            .ok_or(Bail)?;
        let bytes = self.buf.get(self.pos..end).ok_or(Bail)?;
        self.pos = end;
        Ok(bytes)
    }

    #[inline(always)]
    fn field(&mut self) -> R<(u32, Value<'a>)> {
        let tag = u32::try_from(self.varint(5)?).map_err(|_| Bail)?;
        let number = tag >> 3;
        if number == 0 {
            return Err(Bail);
        }
        let value = match tag & 7 {
            0 => Value::Varint(self.varint(10)?),
            1 => Value::I64(u64::from_le_bytes(self.take(8)?.try_into().map_err(|_| Bail)?)),
            2 => {
                let len = self.varint(10)?;
                Value::Len(self.take(len)?)
            }
            5 => {
                self.take(4)?;
                Value::I32
            }
            _ => return Err(Bail), // groups (3, 4) and invalid wire types
        };
        Ok((number, value))
    }
}

impl<'a> Iterator for Fields<'a> {
    type Item = R<(u32, Value<'a>)>;

    #[inline]
    fn next(&mut self) -> Option<Self::Item> {
        (self.pos < self.buf.len()).then(|| self.field())
    }
}

/// The length-delimited values of field `number` of a message already walked without error.
fn repeated(buf: &[u8], number: u32) -> impl Iterator<Item = &[u8]> {
    Fields { buf, pos: 0 }.filter_map(move |field| match field {
        Ok((n, Value::Len(bytes))) if n == number => Some(bytes),
        _ => None,
    })
}

/// `bytes` as text, if valid UTF-8 (protobuf refuses a string field that is not).
#[inline(always)]
fn utf8(bytes: &[u8]) -> R<&str> {
    if bytes.is_ascii() {
        // SAFETY: ASCII is valid UTF-8. (Most strings are ASCII; this skips a call per string.)
        return Ok(unsafe { std::str::from_utf8_unchecked(bytes) });
    }
    std::str::from_utf8(bytes).map_err(|_| Bail)
}

/// `text[:chars]` as Python slices it (code points, not bytes).
fn cap(text: &str, chars: usize) -> &str {
    if text.len() <= chars {
        return text;
    }
    match text.char_indices().nth(chars) {
        Some((end, _)) => &text[..end],
        None => text,
    }
}

// --- schema -----------------------------------------------------------------------------------------

/// The messages of `ExportTraceServiceRequest` (opentelemetry-proto 1.x).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Msg {
    Request,
    ResourceSpans,
    Resource,
    EntityRef,
    ScopeSpans,
    Scope,
    Span,
    Event,
    Link,
    Status,
    KeyValue,
    AnyValue,
    ArrayValue,
    KeyValueList,
}

const MESSAGES: [Msg; 14] = [
    Msg::Request,
    Msg::ResourceSpans,
    Msg::Resource,
    Msg::EntityRef,
    Msg::ScopeSpans,
    Msg::Scope,
    Msg::Span,
    Msg::Event,
    Msg::Link,
    Msg::Status,
    Msg::KeyValue,
    Msg::AnyValue,
    Msg::ArrayValue,
    Msg::KeyValueList,
];

/// A known field's type, as far as parsing goes.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Str,
    Bytes,
    Varint,
    I64,
    I32,
    Message(Msg),
    /// Known to some proto versions only, with a meaning for the result: always left to protobuf.
    Unsure,
}

/// The type of field `number` of `msg`; None for a field the schema does not have (protobuf skips it).
#[inline(always)]
fn kind(msg: Msg, number: u32) -> Option<Kind> {
    use Kind::*;
    Some(match (msg, number) {
        (Msg::Request, 1) => Message(Msg::ResourceSpans),
        (Msg::ResourceSpans, 1) => Message(Msg::Resource),
        (Msg::ResourceSpans, 2) => Message(Msg::ScopeSpans),
        (Msg::ResourceSpans, 3) => Str,
        (Msg::ResourceSpans, 1000) => Unsure, // instrumentation_library_spans, gone from newer protos
        (Msg::Resource, 1) => Message(Msg::KeyValue),
        (Msg::Resource, 2) => Varint,
        (Msg::Resource, 3) => Message(Msg::EntityRef),
        (Msg::EntityRef, 1..=4) => Str,
        (Msg::ScopeSpans, 1) => Message(Msg::Scope),
        (Msg::ScopeSpans, 2) => Message(Msg::Span),
        (Msg::ScopeSpans, 3) => Str,
        (Msg::Scope, 1 | 2) => Str,
        (Msg::Scope, 3) => Message(Msg::KeyValue),
        (Msg::Scope, 4) => Varint,
        (Msg::Span, 1 | 2 | 4) => Bytes,
        (Msg::Span, 3 | 5) => Str,
        (Msg::Span, 6 | 10 | 12 | 14) => Varint,
        (Msg::Span, 7 | 8) => I64,
        (Msg::Span, 9) => Message(Msg::KeyValue),
        (Msg::Span, 11) => Message(Msg::Event),
        (Msg::Span, 13) => Message(Msg::Link),
        (Msg::Span, 15) => Message(Msg::Status),
        (Msg::Span, 16) => I32,
        (Msg::Event, 1) => I64,
        (Msg::Event, 2) => Str,
        (Msg::Event, 3) => Message(Msg::KeyValue),
        (Msg::Event, 4) => Varint,
        (Msg::Link, 1 | 2) => Bytes,
        (Msg::Link, 3) => Str,
        (Msg::Link, 4) => Message(Msg::KeyValue),
        (Msg::Link, 5) => Varint,
        (Msg::Link, 6) => I32,
        (Msg::Status, 2) => Str,
        (Msg::Status, 3) => Varint,
        (Msg::KeyValue, 1) => Str,
        (Msg::KeyValue, 2) => Message(Msg::AnyValue),
        (Msg::KeyValue, 3) => Varint, // key_strindex (profiles only): never read
        (Msg::AnyValue, 1) => Str,
        (Msg::AnyValue, 2 | 3) => Varint,
        (Msg::AnyValue, 4) => I64,
        (Msg::AnyValue, 5) => Message(Msg::ArrayValue),
        (Msg::AnyValue, 6) => Message(Msg::KeyValueList),
        (Msg::AnyValue, 7) => Bytes,
        (Msg::AnyValue, 8) => Unsure, // string_value_strindex: a member of the oneof in newer protos only
        (Msg::ArrayValue, 1) => Message(Msg::AnyValue),
        (Msg::KeyValueList, 1) => Message(Msg::KeyValue),
        _ => return None,
    })
}

/// Whether a value of wire type `value` is a value of `kind` (else protobuf would keep it as an
/// unknown field, which this decoder does not reproduce).
fn fits(kind: Kind, value: Value<'_>) -> bool {
    matches!(
        (kind, value),
        (Kind::Str | Kind::Bytes | Kind::Message(_), Value::Len(_))
            | (Kind::Varint, Value::Varint(_))
            | (Kind::I64, Value::I64(_))
            | (Kind::I32, Value::I32)
    )
}

/// Check field `number` of a `msg` (nested `depth` deep) the way protobuf's parser would.
fn check_field(msg: Msg, number: u32, value: Value<'_>, depth: u32) -> R<()> {
    let Some(kind) = kind(msg, number) else {
        return Ok(());
    };
    if !fits(kind, value) {
        return Err(Bail);
    }
    match (kind, value) {
        (Kind::Str, Value::Len(bytes)) => utf8(bytes).map(drop),
        (Kind::Message(inner), Value::Len(bytes)) => check(inner, bytes, depth + 1),
        _ => Ok(()),
    }
}

/// Check a whole `msg` without decoding it: Ok only when protobuf parses it (as every other check
/// here, an Err may also be a message protobuf takes but this decoder leaves to it).
fn check(msg: Msg, buf: &[u8], depth: u32) -> R<()> {
    for field in fields(buf, depth)? {
        let (number, value) = field?;
        check_field(msg, number, value, depth)?;
    }
    Ok(())
}

/// An `AnyValue`'s member (field number and value, of the member's wire type), unchecked inside.
fn any_member<'a>(buf: &'a [u8], depth: u32) -> R<Option<(u32, Value<'a>)>> {
    let mut member = None;
    for field in fields(buf, depth)? {
        let (number, value) = field?;
        match kind(Msg::AnyValue, number) {
            Some(kind) if !fits(kind, value) => return Err(Bail),
            // Several members: the last one wins, but a repeated array or kvlist merges.
            Some(_) if member.is_some() => return Err(Bail),
            Some(_) => member = Some((number, value)),
            None => {}
        }
    }
    Ok(member)
}

/// A `KeyValue`'s key and (unchecked) value.
fn key_value(buf: &[u8], depth: u32) -> R<(&str, Option<&[u8]>)> {
    let (mut key, mut value) = ("", None);
    for field in fields(buf, depth)? {
        match field? {
            (1, Value::Len(bytes)) => key = utf8(bytes)?,
            (2, Value::Len(bytes)) => {
                if value.replace(bytes).is_some() {
                    return Err(Bail);
                }
            }
            (number, other) => check_field(Msg::KeyValue, number, other, depth)?,
        }
    }
    Ok((key, value))
}

/// An `AnyValue`'s `string_value` as protobuf reads it ("" when another member is set), checking
/// the whole value.
fn string_value(buf: Option<&[u8]>, depth: u32) -> R<&str> {
    let Some(buf) = buf else { return Ok("") };
    match any_member(buf, depth)? {
        Some((1, Value::Len(bytes))) => utf8(bytes),
        Some((number, value)) => check_field(Msg::AnyValue, number, value, depth).map(|_| ""),
        None => Ok(""),
    }
}

// --- the journal line -------------------------------------------------------------------------------

/// JSON as `orjson.dumps` writes it, for the values a decoded span holds.
mod write {
    const HEX: &[u8; 16] = b"0123456789abcdef";

    pub fn hex(out: &mut Vec<u8>, bytes: &[u8]) {
        out.reserve(2 * bytes.len() + 2);
        out.push(b'"');
        for &byte in bytes {
            out.extend_from_slice(&[HEX[usize::from(byte >> 4)], HEX[usize::from(byte & 15)]]);
        }
        out.push(b'"');
    }

    /// A string: quote, backslash and control characters escaped, the rest raw UTF-8.
    pub fn str(out: &mut Vec<u8>, text: &str) {
        let bytes = text.as_bytes();
        // Most strings need no escape: one branch-free pass (vectorized) finds out.
        let plain = !bytes
            .iter()
            .fold(false, |any, &b| any | (b < 0x20) | (b == b'"') | (b == b'\\'));
        out.reserve(bytes.len() + 2);
        out.push(b'"');
        if plain {
            out.extend_from_slice(bytes);
            out.push(b'"');
            return;
        }
        let mut start = 0;
        for (i, &byte) in bytes.iter().enumerate() {
            let short = match byte {
                b'"' => b'"',
                b'\\' => b'\\',
                b'\n' => b'n',
                b'\r' => b'r',
                b'\t' => b't',
                0x08 => b'b',
                0x0c => b'f',
                0..=0x1f => 0,
                _ => continue,
            };
            out.extend_from_slice(&bytes[start..i]);
            if short == 0 {
                out.extend_from_slice(b"\\u00");
                out.extend_from_slice(&[HEX[usize::from(byte >> 4)], HEX[usize::from(byte & 15)]]);
            } else {
                out.extend_from_slice(&[b'\\', short]);
            }
            start = i + 1;
        }
        out.extend_from_slice(&bytes[start..]);
        out.push(b'"');
    }

    pub fn opt_str(out: &mut Vec<u8>, text: Option<&str>) {
        match text {
            Some(text) => str(out, text),
            None => out.extend_from_slice(b"null"),
        }
    }

    /// An integer (`negative`: minus `magnitude`), without the formatting machinery.
    pub fn int(out: &mut Vec<u8>, negative: bool, mut magnitude: u64) {
        let mut digits = [0u8; 20];
        let mut at = digits.len();
        loop {
            at -= 1;
            digits[at] = b'0' + (magnitude % 10) as u8;
            magnitude /= 10;
            if magnitude == 0 {
                break;
            }
        }
        if negative {
            out.push(b'-');
        }
        out.extend_from_slice(&digits[at..]);
    }
}

// --- span facts -----------------------------------------------------------------------------------

/// Whether Python's `str.isspace()` holds for `c` (what `str.strip()` strips; a test checks every
/// code point against the running Python).
fn py_space(c: char) -> bool {
    matches!(c, '\t'..='\r' | '\x1c'..='\x1f' | ' ' | '\u{85}' | '\u{a0}' | '\u{1680}' | '\u{2000}'..='\u{200a}'
        | '\u{2028}' | '\u{2029}' | '\u{202f}' | '\u{205f}' | '\u{3000}')
}

/// `text.strip()`, as Python strips.
#[pyfunction]
fn py_strip(text: &str) -> &str {
    text.trim_matches(py_space)
}

/// The attribute roles of `collector.core.classify.span_facts`, in the order `collector.formats.decode` passes
/// their keys.
#[derive(Clone, Copy)]
enum Role {
    LedgerSource,
    Operation,
    AgentId,
    ExecutorId,
    BridgeExecutor,
    ExecutorType,
    Subject,
    Error,
    Input,
    Output,
    Total,
    Finish,
    MafRelease,
    InstrumentationVersion,
    InstrumentationStatus,
    Model,
    Provider,
}

const ROLES: usize = 17;

/// Finish-reason strings whose answers a decoder remembers.
const FINISH_REASONS: usize = 4096;

/// A wanted attribute's value as the wire holds it (its `AnyValue` member); None where
/// `collector.formats.decode.any_value` gives None (no member, bytes).
type Member<'a> = Option<(u32, Value<'a>)>;

// --- decoding ---------------------------------------------------------------------------------------

/// Decodes requests into span records with their facts (`collector.core.classify.Facts`) for one matcher
/// (see `collector.formats.decode`).
#[pyclass(frozen, module = "agenteval_native")]
struct Decoder {
    /// Each wanted key's slot in a span's values.
    slots: FxHashMap<Box<str>, usize>,
    /// Per role, the slots of its keys, in the order `_first` tries them.
    roles: [Vec<usize>; ROLES],
    /// The class built per span, called with its fields positionally.
    record: Py<PyAny>,
    /// `collector.core.classify.finish_reason`, called with a finish-reason string.
    finish_reason: Py<PyAny>,
    /// Its answers so far: a handful of distinct strings recur on every chat span.
    finish_reasons: Mutex<FxHashMap<Box<str>, Py<PyAny>>>,
    /// `Matcher.is_agent_executor_type`, called with an executor-type string.
    hosts_agent: Py<PyAny>,
    run_names: Vec<String>,
    executor_prefixes: Vec<String>,
    agent_prefixes: Vec<String>,
    chat_prefixes: Vec<String>,
    chat_operations: Vec<String>,
    /// The ledger-source value of an AgentResponseEvent span.
    ledger_source: String,
    /// The kinds by name: run, executor, agent, other.
    kinds: [u64; 4],
    max_tokens: u64,
    own_scope: String,
    service_name: String,
    sdk_language: String,
    max_chars: usize,
    max_language_chars: usize,
    max_error_chars: usize,
    max_value_depth: u32,
    status_error: i32,
}

/// What one request decodes to: (span records, (name, trace id, span id, parent id) of each span
/// rejected for its ids, spans of our own scope, the records' journal line).
struct Out<'py> {
    spans: Bound<'py, PyList>,
    rejected: Bound<'py, PyList>,
    own: usize,
    /// The journal line so far: `[` and the rows of the records built, each followed by `,`.
    line: Vec<u8>,
    /// Whether every row so far reads back as exactly its record.
    exact: bool,
}

/// A resource's `service.name` and `telemetry.sdk.language` (None when empty), each with its JSON.
struct Resource<'py> {
    subject: Option<Bound<'py, PyString>>,
    language: Option<Bound<'py, PyString>>,
    subject_json: Vec<u8>,
    language_json: Vec<u8>,
}

/// A span's facts being written: the Python values and their JSON (`[` and each value followed by `,`).
struct Facts<'py> {
    items: Vec<Bound<'py, PyAny>>,
    json: Vec<u8>,
}

impl<'py> Facts<'py> {
    fn int(&mut self, py: Python<'py>, value: Option<u64>) {
        match value {
            Some(value) => {
                write::int(&mut self.json, false, value);
                self.items.push(PyInt::new(py, value).into_any());
            }
            None => self.none(py),
        }
        self.json.push(b',');
    }

    fn bool(&mut self, py: Python<'py>, value: bool) {
        self.json.extend_from_slice(if value { b"true," } else { b"false," });
        self.items.push(PyBool::new(py, value).to_owned().into_any());
    }

    fn text(&mut self, py: Python<'py>, value: Option<&str>) {
        match value {
            Some(text) => {
                write::str(&mut self.json, text);
                self.items.push(PyString::new(py, text).into_any());
            }
            None => self.none(py),
        }
        self.json.push(b',');
    }

    fn none(&mut self, py: Python<'py>) {
        self.json.extend_from_slice(b"null");
        self.items.push(py.None().into_bound(py));
    }
}

#[pymethods]
impl Decoder {
    #[new]
    #[pyo3(signature = (record, *, keys, run_names, executor_prefixes, agent_prefixes, chat_prefixes,
                        chat_operations, ledger_source, kinds, finish_reason, hosts_agent, max_tokens,
                        own_scope, service_name, sdk_language, max_chars, max_language_chars,
                        max_error_chars, max_value_depth, status_error))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        record: Py<PyAny>,
        keys: Vec<Vec<String>>,
        run_names: Vec<String>,
        executor_prefixes: Vec<String>,
        agent_prefixes: Vec<String>,
        chat_prefixes: Vec<String>,
        chat_operations: Vec<String>,
        ledger_source: String,
        kinds: [u64; 4],
        finish_reason: Py<PyAny>,
        hosts_agent: Py<PyAny>,
        max_tokens: u64,
        own_scope: String,
        service_name: String,
        sdk_language: String,
        max_chars: usize,
        max_language_chars: usize,
        max_error_chars: usize,
        max_value_depth: u32,
        status_error: i32,
    ) -> PyResult<Self> {
        if keys.len() != ROLES {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "keys: {ROLES} roles expected"
            )));
        }
        let mut slots = FxHashMap::default();
        let mut roles: [Vec<usize>; ROLES] = Default::default();
        for (role, role_keys) in roles.iter_mut().zip(keys) {
            for key in role_keys {
                let next = slots.len();
                role.push(*slots.entry(key.into_boxed_str()).or_insert(next));
            }
        }
        Ok(Decoder {
            slots,
            roles,
            record,
            finish_reason,
            finish_reasons: Mutex::default(),
            hosts_agent,
            run_names,
            executor_prefixes,
            agent_prefixes,
            chat_prefixes,
            chat_operations,
            ledger_source,
            kinds,
            max_tokens,
            own_scope,
            service_name,
            sdk_language,
            max_chars,
            max_language_chars,
            max_error_chars,
            max_value_depth,
            status_error,
        })
    }

    /// `(spans, rejected, own, line)` for a serialized request, or None to leave it to protobuf.
    /// `line` is `collector.live.journal._encode(spans)` in meaning (and in bytes, as orjson writes it),
    /// or None when it could not be written exactly (a finish reason Python decoded to a lone
    /// surrogate, which UTF-8 cannot hold).
    fn decode<'py>(&self, py: Python<'py>, payload: &[u8]) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let mut out = Out {
            spans: PyList::empty(py),
            rejected: PyList::empty(py),
            own: 0,
            line: Vec::new(),
            exact: true,
        };
        out.line.push(b'[');
        match self.request(py, payload, &mut out) {
            Ok(()) => {
                let line = out.exact.then(|| {
                    match out.line.last_mut() {
                        Some(last @ b',') => *last = b']', // after the last row
                        _ => out.line.push(b']'),
                    }
                    out.line.push(b'\n');
                    PyBytes::new(py, &out.line)
                });
                Ok(Some((out.spans, out.rejected, out.own, line).into_pyobject(py)?))
            }
            Err(Stop::Bail) => Ok(None),
            Err(Stop::Py(err)) => Err(err),
        }
    }
}

impl Decoder {
    fn request<'py>(&self, py: Python<'py>, buf: &[u8], out: &mut Out<'py>) -> R<(), Stop> {
        for field in fields(buf, 1)? {
            match field? {
                (1, Value::Len(resource_spans)) => self.resource_spans(py, resource_spans, out)?,
                (number, value) => check_field(Msg::Request, number, value, 1)?,
            }
        }
        Ok(())
    }

    fn resource_spans<'py>(&self, py: Python<'py>, buf: &[u8], out: &mut Out<'py>) -> R<(), Stop> {
        let mut resource = None;
        for field in fields(buf, 2)? {
            match field? {
                (1, Value::Len(bytes)) => {
                    if resource.replace(bytes).is_some() {
                        return Err(Stop::Bail); // protobuf merges the two
                    }
                }
                (2, Value::Len(_)) => {} // after the resource, which may come later on the wire
                (number, value) => check_field(Msg::ResourceSpans, number, value, 2)?,
            }
        }
        let resource = self.resource(py, resource.unwrap_or_default())?;
        for scope_spans in repeated(buf, 2) {
            self.scope_spans(py, scope_spans, &resource, out)?;
        }
        Ok(())
    }

    fn resource<'py>(&self, py: Python<'py>, buf: &[u8]) -> R<Resource<'py>> {
        let (mut subject, mut language) = ("", "");
        for field in fields(buf, 3)? {
            match field? {
                (1, Value::Len(attribute)) => {
                    let (key, value) = key_value(attribute, 4)?;
                    if key == self.service_name {
                        subject = cap(string_value(value, 5)?, self.max_chars);
                    } else if key == self.sdk_language {
                        language = cap(string_value(value, 5)?, self.max_language_chars);
                    } else if let Some(value) = value {
                        check(Msg::AnyValue, value, 5)?;
                    }
                }
                (number, value) => check_field(Msg::Resource, number, value, 3)?,
            }
        }
        let text = |s: &str| (!s.is_empty()).then(|| PyString::new(py, s));
        let text_json = |s: &str| {
            let mut out = Vec::new();
            write::opt_str(&mut out, (!s.is_empty()).then_some(s));
            out
        };
        Ok(Resource {
            subject: text(subject),
            language: text(language),
            subject_json: text_json(subject),
            language_json: text_json(language),
        })
    }

    fn scope_spans<'py>(
        &self,
        py: Python<'py>,
        buf: &[u8],
        resource: &Resource<'py>,
        out: &mut Out<'py>,
    ) -> R<(), Stop> {
        let (mut scope, mut spans) = (None, 0);
        for field in fields(buf, 3)? {
            match field? {
                (1, Value::Len(bytes)) => {
                    if scope.replace(bytes).is_some() {
                        return Err(Stop::Bail);
                    }
                }
                (2, Value::Len(_)) => spans += 1,
                (number, value) => check_field(Msg::ScopeSpans, number, value, 3)?,
            }
        }
        let own = match scope {
            Some(bytes) => self.scope_name(bytes)? == self.own_scope,
            None => false,
        };
        if own {
            out.own += spans;
        }
        for span in repeated(buf, 2) {
            if own {
                check(Msg::Span, span, 4)?;
            } else {
                self.span(py, span, resource, out)?;
            }
        }
        Ok(())
    }

    fn scope_name<'a>(&self, buf: &'a [u8]) -> R<&'a str> {
        let mut name = "";
        for field in fields(buf, 4)? {
            match field? {
                (1, Value::Len(bytes)) => name = utf8(bytes)?,
                (number, value) => check_field(Msg::Scope, number, value, 4)?,
            }
        }
        Ok(name)
    }

    fn span<'py>(&self, py: Python<'py>, buf: &[u8], resource: &Resource<'py>, out: &mut Out<'py>) -> R<(), Stop> {
        let (mut trace_id, mut span_id, mut parent_id): (&[u8], &[u8], &[u8]) = (&[], &[], &[]);
        let (mut name, mut start, mut status) = ("", 0u64, None);
        let mut values: Vec<Member<'_>> = vec![None; self.slots.len()];
        for field in fields(buf, 4)? {
            match field? {
                (1, Value::Len(bytes)) => trace_id = bytes,
                (2, Value::Len(bytes)) => span_id = bytes,
                (4, Value::Len(bytes)) => parent_id = bytes,
                (5, Value::Len(bytes)) => name = utf8(bytes)?,
                (7, Value::I64(nanos)) => start = nanos,
                (9, Value::Len(attribute)) => self.attribute(attribute, &mut values)?,
                (15, Value::Len(bytes)) => {
                    if status.replace(bytes).is_some() {
                        return Err(Stop::Bail);
                    }
                }
                (number, value) => check_field(Msg::Span, number, value, 4)?,
            }
        }
        let error = match status {
            Some(bytes) => self.status_error(bytes)?,
            None => None,
        };
        let name_text = cap(name, self.max_chars);
        let name = PyString::new(py, name_text);
        let usable = trace_id.len() == 16
            && span_id.len() == 8
            && (parent_id.is_empty() || parent_id.len() == 8)
            && trace_id != [0; 16]
            && span_id != [0; 8];
        if !usable {
            let ids = (
                name,
                PyBytes::new(py, trace_id),
                PyBytes::new(py, span_id),
                PyBytes::new(py, parent_id),
            );
            out.rejected.append(ids)?;
            return Ok(());
        }
        if parent_id == [0; 8] {
            parent_id = &[];
        }
        let mut facts = Facts {
            items: Vec::with_capacity(18),
            json: Vec::with_capacity(96),
        };
        facts.json.push(b'[');
        self.facts(py, name_text, &values, &mut facts, &mut out.exact)?;
        facts.json.pop(); // the last value's comma
        facts.json.push(b']');
        let line = &mut out.line;
        line.push(b'[');
        for id in [trace_id, span_id, parent_id] {
            write::hex(line, id);
            line.push(b',');
        }
        write::str(line, name_text);
        line.push(b',');
        write::int(line, false, start);
        line.push(b',');
        line.extend_from_slice(&facts.json);
        line.push(b',');
        line.extend_from_slice(&resource.subject_json);
        line.push(b',');
        write::opt_str(line, error);
        line.push(b',');
        line.extend_from_slice(&resource.language_json);
        line.extend_from_slice(b"],");
        let record = self.record.bind(py).call1((
            PyBytes::new(py, trace_id),
            PyBytes::new(py, span_id),
            PyBytes::new(py, parent_id),
            name,
            start,
            PyTuple::new(py, facts.items)?,
            &resource.subject,
            error.map(|message| PyString::new(py, message)),
            &resource.language,
        ))?;
        out.spans.append(record)?;
        Ok(())
    }

    /// The status message (capped) when the status code is ERROR, else None.
    fn status_error<'a>(&self, buf: &'a [u8]) -> R<Option<&'a str>> {
        let (mut message, mut code) = ("", 0);
        for field in fields(buf, 5)? {
            match field? {
                (2, Value::Len(bytes)) => message = utf8(bytes)?,
                (3, Value::Varint(value)) => code = value as i32, // an enum is an int32: truncated
                (number, value) => check_field(Msg::Status, number, value, 5)?,
            }
        }
        Ok((code == self.status_error).then(|| cap(message, self.max_error_chars)))
    }

    /// Keep one span attribute's value in its slot when its key is wanted (a later one of the same
    /// key replaces it, as in a dict); check it either way.
    fn attribute<'a>(&self, buf: &'a [u8], values: &mut [Member<'a>]) -> R<()> {
        let (key, value) = key_value(buf, 5)?;
        let Some(&slot) = self.slots.get(key) else {
            if let Some(value) = value {
                check(Msg::AnyValue, value, 6)?;
            }
            return Ok(());
        };
        let member = match value {
            Some(value) => any_member(value, 6)?,
            None => None,
        };
        self.check_value(member, 0, 6)?;
        values[slot] = member.filter(|&(number, _)| number != 7); // bytes: None, as any_value reads them
        Ok(())
    }

    /// Check a wanted value `level` values deep in an attribute and `depth` messages deep in the
    /// request as `collector.formats.decode.any_value` reads it: every nested value with one member at most
    /// (protobuf would keep the last, or merge repeated ones).
    fn check_value(&self, member: Member<'_>, level: u32, depth: u32) -> R<()> {
        let Some((number, value)) = member else {
            return Ok(());
        };
        if level > self.max_value_depth {
            return check_field(Msg::AnyValue, number, value, depth);
        }
        match (number, value) {
            (1, Value::Len(bytes)) => utf8(bytes).map(drop),
            (2 | 3, Value::Varint(_)) | (4, Value::I64(_)) | (7, Value::Len(_)) => Ok(()),
            (5, Value::Len(bytes)) => {
                for field in fields(bytes, depth + 1)? {
                    match field? {
                        (1, Value::Len(item)) => {
                            self.check_value(any_member(item, depth + 2)?, level + 1, depth + 2)?
                        }
                        (number, other) => check_field(Msg::ArrayValue, number, other, depth + 1)?,
                    }
                }
                Ok(())
            }
            (6, Value::Len(bytes)) => {
                for field in fields(bytes, depth + 1)? {
                    match field? {
                        (1, Value::Len(entry)) => {
                            let member = match key_value(entry, depth + 2)?.1 {
                                Some(value) => any_member(value, depth + 3)?,
                                None => None,
                            };
                            self.check_value(member, level + 1, depth + 3)?;
                        }
                        (number, other) => check_field(Msg::KeyValueList, number, other, depth + 1)?,
                    }
                }
                Ok(())
            }
            _ => Err(Bail),
        }
    }

    /// The first value of `role`'s keys that is not None (`_first`).
    fn first<'a>(&self, role: Role, values: &[Member<'a>]) -> Member<'a> {
        self.roles[role as usize].iter().find_map(|&slot| values[slot])
    }

    /// A string value, capped.
    fn string<'a>(&self, member: Member<'a>) -> Option<&'a str> {
        match member {
            // checked as UTF-8 by `check_value`
            Some((1, Value::Len(bytes))) => utf8(bytes).ok().map(|text| cap(text, self.max_chars)),
            _ => None,
        }
    }

    /// `_text`: a string value, stripped; None when empty or not a string.
    fn text<'a>(&self, member: Member<'a>) -> Option<&'a str> {
        self.string(member).map(py_strip).filter(|text| !text.is_empty())
    }

    /// `_int`: a token count from an integer, an integral double or ASCII digits, clamped.
    fn tokens(&self, member: Member<'_>) -> Option<u64> {
        match member {
            Some((3, Value::Varint(raw))) => {
                let value = raw as i64;
                (value >= 0).then(|| (value as u64).min(self.max_tokens))
            }
            Some((4, Value::I64(bits))) => {
                let value = f64::from_bits(bits);
                let max = self.max_tokens as f64;
                (value.is_finite() && value.fract() == 0.0 && value >= 0.0).then_some(if value >= max {
                    self.max_tokens
                } else {
                    value as u64
                })
            }
            Some((1, _)) => {
                let text = py_strip(self.string(member)?);
                if text.is_empty() || text.len() > 32 || !text.bytes().all(|b| b.is_ascii_digit()) {
                    return None;
                }
                // 32 digits at most: a u128 holds them
                text.parse::<u128>()
                    .ok()
                    .map(|n| n.min(u128::from(self.max_tokens)) as u64)
            }
            _ => None,
        }
    }

    /// The kind of a span by its name (`Matcher.kind`).
    fn kind(&self, name: &str) -> u64 {
        let first_word = name.split(' ').next().unwrap_or(name);
        let starts = |prefixes: &[String]| prefixes.iter().any(|p| name.starts_with(p.as_str()));
        let [run, executor, agent, other] = self.kinds;
        if self.run_names.iter().any(|n| n == name || n == first_word) {
            run
        } else if starts(&self.executor_prefixes) {
            executor
        } else if starts(&self.agent_prefixes) {
            agent
        } else {
            other
        }
    }

    /// `collector.core.classify.span_facts` of a span, into `facts`; `exact` is cleared when their JSON
    /// cannot be written.
    fn facts<'py>(
        &self,
        py: Python<'py>,
        name: &str,
        values: &[Member<'_>],
        facts: &mut Facts<'py>,
        exact: &mut bool,
    ) -> R<(), Stop> {
        facts.int(py, Some(self.kind(name)));
        let bridge = self.string(self.first(Role::LedgerSource, values));
        facts.bool(py, bridge == Some(self.ledger_source.as_str()));
        let operation = self.roles[Role::Operation as usize]
            .iter()
            .find_map(|&slot| self.string(values[slot]));
        let chat = match operation {
            Some(op) => self.chat_operations.iter().any(|c| c == op),
            None => self.chat_prefixes.iter().any(|p| name.starts_with(p.as_str())),
        };
        facts.bool(py, chat);
        facts.text(py, self.text(self.first(Role::AgentId, values)));
        facts.text(py, self.text(self.first(Role::ExecutorId, values)));
        facts.text(py, self.text(self.first(Role::BridgeExecutor, values)));
        let hosts_agent = match self.string(self.first(Role::ExecutorType, values)) {
            Some(kind) => self.hosts_agent.bind(py).call1((kind,))?.is_truthy()?,
            None => false,
        };
        facts.bool(py, hosts_agent);
        facts.text(py, self.text(self.first(Role::Subject, values)));
        facts.text(py, self.text(self.first(Role::Error, values)));
        facts.int(py, self.tokens(self.first(Role::Input, values)));
        facts.int(py, self.tokens(self.first(Role::Output, values)));
        facts.int(py, self.tokens(self.first(Role::Total, values)));
        let finish = self.first(Role::Finish, values);
        if let Some(text) = self.string(finish) {
            let reason = self.finish_reason(py, text)?;
            match reason.cast::<PyString>() {
                Ok(text) => match text.to_str() {
                    Ok(text) => write::str(&mut facts.json, text),
                    Err(_) => *exact = false, // a lone surrogate, from a JSON escape
                },
                Err(_) => facts.json.extend_from_slice(b"null"),
            }
            facts.items.push(reason);
            facts.json.push(b',');
        } else if let Some((5, Value::Len(items))) = finish {
            facts.text(py, self.first_reason(items)?);
        } else {
            facts.text(py, None);
        }
        for role in [Role::MafRelease, Role::InstrumentationVersion, Role::InstrumentationStatus, Role::Model,
                     Role::Provider] {
            facts.text(py, self.text(self.first(role, values)));
        }
        Ok(())
    }

    /// `finish_reason` of a string, remembered (up to [`FINISH_REASONS`] strings at a time). The lock
    /// is never held across the call into Python, which may let another decoding thread run.
    fn finish_reason<'py>(&self, py: Python<'py>, text: &str) -> PyResult<Bound<'py, PyAny>> {
        if let Some(reason) = self.known_reasons().get(text) {
            return Ok(reason.bind(py).clone());
        }
        let reason = self.finish_reason.bind(py).call1((text,))?;
        let mut known = self.known_reasons();
        if known.len() >= FINISH_REASONS {
            known.clear(); // hostile variety: memory stays bounded
        }
        known.insert(text.into(), reason.clone().unbind());
        Ok(reason)
    }

    fn known_reasons(&self) -> std::sync::MutexGuard<'_, FxHashMap<Box<str>, Py<PyAny>>> {
        self.finish_reasons
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// `finish_reason` of an array value: its first string item that is not blank, stripped.
    fn first_reason<'a>(&self, items: &'a [u8]) -> R<Option<&'a str>> {
        if self.max_value_depth < 1 {
            return Ok(None); // the items are too deep: None
        }
        for field in fields(items, 7)? {
            if let (1, Value::Len(item)) = field? {
                if let Some(text) = self.text(any_member(item, 8)?) {
                    return Ok(Some(text));
                }
            }
        }
        Ok(None)
    }
}

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
    module.add_class::<Decoder>()?;
    module.add_function(wrap_pyfunction!(count_spans, module)?)?;
    module.add_function(wrap_pyfunction!(schema, module)?)?;
    module.add_function(wrap_pyfunction!(py_strip, module)?)?;
    Ok(())
}
