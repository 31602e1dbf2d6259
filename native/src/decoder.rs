//! The `Decoder` class: a request's resources, scopes and spans walked into span records, the
//! rejected spans' ids and the spans' journal line.

use crate::facts::{Facts, FACTS, FACTS_JSON, ROLES};
use crate::journal as write;
use crate::messages::{check, check_field, Msg};
use crate::values::{cap, key_value, string_value, utf8, Member};
use crate::wire::{fields, repeated, Stop, Value, R};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString, PyTuple};
use rustc_hash::FxHashMap;
use std::sync::Mutex;

/// Decodes requests into span records with their facts (`collector.core.classify.Facts`) for one matcher
/// (see `collector.formats.decode`).
#[pyclass(frozen, module = "agenteval_native")]
pub(crate) struct Decoder {
    /// Each wanted key's slot in a span's values.
    pub(crate) slots: FxHashMap<Box<str>, usize>,
    /// Per role, the slots of its keys, in the order `_first` tries them.
    pub(crate) roles: [Vec<usize>; ROLES],
    /// The class built per span, called with its fields positionally.
    record: Py<PyAny>,
    /// `collector.core.classify.finish_reason`, called with a finish-reason string.
    pub(crate) finish_reason: Py<PyAny>,
    /// Its answers so far: a handful of distinct strings recur on every chat span.
    pub(crate) finish_reasons: Mutex<FxHashMap<Box<str>, Py<PyAny>>>,
    /// `Matcher.is_agent_executor_type`, called with an executor-type string.
    pub(crate) hosts_agent: Py<PyAny>,
    pub(crate) run_names: Vec<String>,
    pub(crate) executor_prefixes: Vec<String>,
    pub(crate) agent_prefixes: Vec<String>,
    pub(crate) chat_prefixes: Vec<String>,
    pub(crate) chat_names: Vec<String>,
    pub(crate) chat_operations: Vec<String>,
    /// The ledger-source value of an AgentResponseEvent span.
    pub(crate) ledger_source: String,
    /// The kinds by name: run, executor, agent, other.
    pub(crate) kinds: [u64; 4],
    pub(crate) max_tokens: u64,
    own_scope: String,
    service_name: String,
    sdk_language: String,
    pub(crate) max_chars: usize,
    max_language_chars: usize,
    max_error_chars: usize,
    pub(crate) max_value_depth: u32,
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

#[pymethods]
impl Decoder {
    #[new]
    #[pyo3(signature = (record, *, keys, run_names, executor_prefixes, agent_prefixes, chat_prefixes,
                        chat_names, chat_operations, ledger_source, kinds, finish_reason, hosts_agent, max_tokens,
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
        chat_names: Vec<String>,
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
            chat_names,
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
        let (mut name, mut start, mut end, mut status) = ("", 0u64, 0u64, None);
        let mut values: Vec<Member<'_>> = vec![None; self.slots.len()];
        for field in fields(buf, 4)? {
            match field? {
                (1, Value::Len(bytes)) => trace_id = bytes,
                (2, Value::Len(bytes)) => span_id = bytes,
                (4, Value::Len(bytes)) => parent_id = bytes,
                (5, Value::Len(bytes)) => name = utf8(bytes)?,
                (7, Value::I64(nanos)) => start = nanos,
                (8, Value::I64(nanos)) => end = nanos,
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
            items: Vec::with_capacity(FACTS),
            json: Vec::with_capacity(FACTS_JSON),
        };
        facts.json.push(b'[');
        self.facts(py, name_text, &values, &mut facts, &mut out.exact)?;
        debug_assert_eq!(facts.items.len(), FACTS);
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
        line.push(b',');
        match end {
            0 => line.extend_from_slice(b"null"),
            nanos => write::int(line, false, nanos),
        }
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
            (end != 0).then_some(end), // unset: unknown
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
}
