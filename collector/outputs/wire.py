"""Run documents (:mod:`collector.core.serialize` dicts) <-> ``agenteval.fidelity.v1`` messages.

One descriptor-driven walk each way, so a field added to the proto needs no code here: the proto's
field names are the document's keys. Enums carry buf-style prefixes on the wire (``STATUS_PASS``,
``VERDICT_TOKEN_MISMATCH``) and the domain spellings (``PASS``, ``TokenMismatch``) in documents.
"""

from __future__ import annotations

import enum
from typing import Any

from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp

from collector.api.v1 import fidelity_pb2 as pb
from collector.core.model import NoTruthReason, Status, Verdict

#: proto enum name -> (wire prefix, domain enum)
_ENUMS: dict[str, tuple[str, type[enum.Enum]]] = {
    "Status": ("STATUS_", Status),
    "Verdict": ("VERDICT_", Verdict),
    "NoTruthReason": ("NO_TRUTH_REASON_", NoTruthReason),
}


def status_number(status: str) -> int:
    """``"FAIL"`` (any case) -> ``pb.STATUS_FAIL``; ValueError for an unknown status."""
    return pb.Status.Value("STATUS_" + Status(status.upper()).name)


def _domain_to_wire(field: FieldDescriptor, value: Any) -> Any:
    if field.type == FieldDescriptor.TYPE_ENUM:
        prefix, domain = _ENUMS[field.enum_type.name]
        return field.enum_type.values_by_name[prefix + domain(value).name].number
    return value


def _enum_to_domain(enum_type: EnumDescriptor, number: int) -> str | None:
    prefix, domain = _ENUMS[enum_type.name]
    name = enum_type.values_by_number[number].name.removeprefix(prefix)
    return None if name == "UNSPECIFIED" else domain[name].value


def status_name(number: int) -> str | None:
    """``pb.STATUS_FAIL`` -> ``"FAIL"``; None for STATUS_UNSPECIFIED."""
    return _enum_to_domain(pb.Status.DESCRIPTOR, number)


def _wire_to_domain(field: FieldDescriptor, value: Any) -> Any:
    if field.type == FieldDescriptor.TYPE_ENUM:
        return _enum_to_domain(field.enum_type, value)
    if field.message_type is not None:
        return to_doc(value)
    return value


def fill(message: Message, doc: dict[str, Any]) -> Message:
    """Set ``message``'s fields from ``doc``; keys the proto does not know are ignored."""
    for field in message.DESCRIPTOR.fields:
        value = doc.get(field.name)
        if value is None:
            continue
        if field.message_type is not None and field.message_type.full_name == Timestamp.DESCRIPTOR.full_name:
            getattr(message, field.name).FromNanoseconds(int(value * 1e9))
        elif field.is_repeated:
            target = getattr(message, field.name)
            for item in value:
                if field.message_type is not None:
                    fill(target.add(), item)
                else:
                    target.append(_domain_to_wire(field, item))
        elif field.message_type is not None:
            getattr(message, field.name).SetInParent()  # present, even with every field of it unset
            fill(getattr(message, field.name), value)
        else:
            setattr(message, field.name, _domain_to_wire(field, value))
    return message


#: Fields that say how a message travelled, not what the run is: never part of a run document.
_DELIVERY_FIELDS = frozenset({"replayed"})


def to_doc(message: Message) -> dict[str, Any]:
    """The document for a message; optional fields that are unset come back as ``None``."""
    descriptor: Descriptor = message.DESCRIPTOR
    if descriptor.full_name == Timestamp.DESCRIPTOR.full_name:
        return message.ToNanoseconds() / 1e9  # type: ignore[attr-defined, return-value]
    out: dict[str, Any] = {}
    for field in descriptor.fields:
        if field.name in _DELIVERY_FIELDS:
            continue
        value = getattr(message, field.name)
        if field.is_repeated:
            out[field.name] = [_wire_to_domain(field, v) for v in value]
        elif field.has_presence and not message.HasField(field.name):
            out[field.name] = None
        else:
            out[field.name] = _wire_to_domain(field, value)
    return out


def run_message(doc: dict[str, Any], include_executors: bool = True) -> pb.RunVerdict:
    message = fill(pb.RunVerdict(), doc)
    if not include_executors:
        message.ClearField("executors")
    return message
