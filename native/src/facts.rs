//! A span's facts (`collector.core.classify.span_facts`) from its wanted attribute values and name: its
//! kind, roles, token counts and finish reason, as Python values and as their journal JSON.

use crate::decoder::Decoder;
use crate::journal as write;
use crate::values::{any_member, cap, utf8, Member};
use crate::wire::{fields, Stop, Value, R};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyInt, PyString};
use rustc_hash::FxHashMap;

/// Whether Python's `str.isspace()` holds for `c` (what `str.strip()` strips; a test checks every
/// code point against the running Python).
fn py_space(c: char) -> bool {
    matches!(c, '\t'..='\r' | '\x1c'..='\x1f' | ' ' | '\u{85}' | '\u{a0}' | '\u{1680}' | '\u{2000}'..='\u{200a}'
        | '\u{2028}' | '\u{2029}' | '\u{202f}' | '\u{205f}' | '\u{3000}')
}

/// `text.strip()`, as Python strips.
#[pyfunction]
pub(crate) fn py_strip(text: &str) -> &str {
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
    CacheRead,
    CacheWrite,
    Reasoning,
}

pub(crate) const ROLES: usize = 20;

/// Values in a span's facts (`collector.core.classify.FACTS`): its kind, then one per role (the ledger
/// source, operation and executor type as whether it is a ledger span, a chat call, hosted by an agent's executor).
pub(crate) const FACTS: usize = ROLES + 1;
/// Room for the facts' JSON of a usual span (a chat call's names, counts and reason), so it is not grown.
pub(crate) const FACTS_JSON: usize = 192;

/// Finish-reason strings whose answers a decoder remembers.
const FINISH_REASONS: usize = 4096;

/// A span's facts being written: the Python values and their JSON (`[` and each value followed by `,`).
pub(crate) struct Facts<'py> {
    pub(crate) items: Vec<Bound<'py, PyAny>>,
    pub(crate) json: Vec<u8>,
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

impl Decoder {
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
    pub(crate) fn facts<'py>(
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
        let chat = self.chat_names.iter().any(|n| n == name)
            || match operation {
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
        for role in [Role::CacheRead, Role::CacheWrite, Role::Reasoning] {
            facts.int(py, self.tokens(self.first(role, values)));
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
