//! The crash-journal line (`collector.live.journal._encode`): JSON as `orjson.dumps` writes it, for the
//! values a decoded span holds.

const HEX: &[u8; 16] = b"0123456789abcdef";

pub(crate) fn hex(out: &mut Vec<u8>, bytes: &[u8]) {
    out.reserve(2 * bytes.len() + 2);
    out.push(b'"');
    for &byte in bytes {
        out.extend_from_slice(&[HEX[usize::from(byte >> 4)], HEX[usize::from(byte & 15)]]);
    }
    out.push(b'"');
}

/// A string: quote, backslash and control characters escaped, the rest raw UTF-8.
pub(crate) fn str(out: &mut Vec<u8>, text: &str) {
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

pub(crate) fn opt_str(out: &mut Vec<u8>, text: Option<&str>) {
    match text {
        Some(text) => str(out, text),
        None => out.extend_from_slice(b"null"),
    }
}

/// An integer (`negative`: minus `magnitude`), without the formatting machinery.
pub(crate) fn int(out: &mut Vec<u8>, negative: bool, mut magnitude: u64) {
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
