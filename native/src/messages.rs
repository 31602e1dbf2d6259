//! The schema of `ExportTraceServiceRequest` (opentelemetry-proto 1.x), and checking a message or a
//! field against it as protobuf's parser would, without decoding it.

use crate::values::utf8;
use crate::wire::{fields, Bail, Value, R};

/// The messages of `ExportTraceServiceRequest` (opentelemetry-proto 1.x).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Msg {
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

pub(crate) const MESSAGES: [Msg; 14] = [
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
pub(crate) enum Kind {
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
pub(crate) fn kind(msg: Msg, number: u32) -> Option<Kind> {
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
pub(crate) fn fits(kind: Kind, value: Value<'_>) -> bool {
    matches!(
        (kind, value),
        (Kind::Str | Kind::Bytes | Kind::Message(_), Value::Len(_))
            | (Kind::Varint, Value::Varint(_))
            | (Kind::I64, Value::I64(_))
            | (Kind::I32, Value::I32)
    )
}

/// Check field `number` of a `msg` (nested `depth` deep) the way protobuf's parser would.
pub(crate) fn check_field(msg: Msg, number: u32, value: Value<'_>, depth: u32) -> R<()> {
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
pub(crate) fn check(msg: Msg, buf: &[u8], depth: u32) -> R<()> {
    for field in fields(buf, depth)? {
        let (number, value) = field?;
        check_field(msg, number, value, depth)?;
    }
    Ok(())
}
