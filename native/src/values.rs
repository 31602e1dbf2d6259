//! Strings and attribute values: UTF-8 checks, Python's slicing, an `AnyValue`'s member, a
//! `KeyValue`, and a span's wanted attribute values (checked as `collector.formats.decode.any_value` reads them).

use crate::decoder::Decoder;
use crate::messages::{check, check_field, fits, kind, Msg};
use crate::wire::{fields, Bail, Value, R};

/// `bytes` as text, if valid UTF-8 (protobuf refuses a string field that is not).
#[inline(always)]
pub(crate) fn utf8(bytes: &[u8]) -> R<&str> {
    if bytes.is_ascii() {
        // SAFETY: ASCII is valid UTF-8. (Most strings are ASCII; this skips a call per string.)
        return Ok(unsafe { std::str::from_utf8_unchecked(bytes) });
    }
    std::str::from_utf8(bytes).map_err(|_| Bail)
}

/// `text[:chars]` as Python slices it (code points, not bytes).
pub(crate) fn cap(text: &str, chars: usize) -> &str {
    if text.len() <= chars {
        return text;
    }
    match text.char_indices().nth(chars) {
        Some((end, _)) => &text[..end],
        None => text,
    }
}

/// An `AnyValue`'s member (field number and value, of the member's wire type), unchecked inside.
pub(crate) fn any_member<'a>(buf: &'a [u8], depth: u32) -> R<Option<(u32, Value<'a>)>> {
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
pub(crate) fn key_value(buf: &[u8], depth: u32) -> R<(&str, Option<&[u8]>)> {
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
pub(crate) fn string_value(buf: Option<&[u8]>, depth: u32) -> R<&str> {
    let Some(buf) = buf else { return Ok("") };
    match any_member(buf, depth)? {
        Some((1, Value::Len(bytes))) => utf8(bytes),
        Some((number, value)) => check_field(Msg::AnyValue, number, value, depth).map(|_| ""),
        None => Ok(""),
    }
}

/// A wanted attribute's value as the wire holds it (its `AnyValue` member); None where
/// `collector.formats.decode.any_value` gives None (no member, bytes).
pub(crate) type Member<'a> = Option<(u32, Value<'a>)>;

impl Decoder {
    /// Keep one span attribute's value in its slot when its key is wanted (a later one of the same
    /// key replaces it, as in a dict); check it either way.
    pub(crate) fn attribute<'a>(&self, buf: &'a [u8], values: &mut [Member<'a>]) -> R<()> {
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
}
