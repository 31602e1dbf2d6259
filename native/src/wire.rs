//! Protobuf's wire format: a message's fields in wire order, varints and lengths walked with the
//! message nesting limit, and why a decode stops (left to protobuf, or a Python error).

use pyo3::PyErr;

/// Message nesting past which a request is left to protobuf (`collector.formats.decode.parse_request`): the
/// shallowest an attribute value nested past `MAX_VALUE_NESTING` (100) can be is 207 (a resource
/// attribute's value is 5 messages deep, each array adds 2), so every request within it takes its
/// values whole and none of its spans is rejected for nesting.
const MAX_DEPTH: u32 = 206;

/// "Not certain to decode this exactly as protobuf does": the caller falls back to protobuf.
pub(crate) struct Bail;

/// Why a decode stopped: a request to leave to protobuf, or a Python error (out of memory).
pub(crate) enum Stop {
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

pub(crate) type R<T, E = Bail> = Result<T, E>;

/// One field's value as the wire carries it (groups are never accepted).
#[derive(Clone, Copy)]
pub(crate) enum Value<'a> {
    Varint(u64),
    I64(u64),
    Len(&'a [u8]),
    /// fixed32 (flags): never read
    I32,
}

/// The fields of one message, in wire order.
pub(crate) struct Fields<'a> {
    buf: &'a [u8],
    pos: usize,
}

/// The fields of a message nested `depth` messages deep (the request is 1).
pub(crate) fn fields(buf: &[u8], depth: u32) -> R<Fields<'_>> {
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
pub(crate) fn repeated(buf: &[u8], number: u32) -> impl Iterator<Item = &[u8]> {
    Fields { buf, pos: 0 }.filter_map(move |field| match field {
        Ok((n, Value::Len(bytes))) if n == number => Some(bytes),
        _ => None,
    })
}
