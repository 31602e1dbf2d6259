"""Run documents (:mod:`collector.core.serialize` dicts) <-> ``agenteval.fidelity.v1`` messages.

One descriptor-driven walk each way, so a field added to the proto needs no code here: the proto's
field names are the document's keys. Enums carry buf-style prefixes on the wire (``STATUS_PASS``,
``VERDICT_TOKEN_MISMATCH``) and the domain spellings (``PASS``, ``TokenMismatch``) in documents.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar, cast

from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp

from collector.api.v1 import fidelity_pb2 as pb
from collector.core.model import NoTruthReason, Status, Verdict

if TYPE_CHECKING:
    # A message's descriptors are the C implementation's (upb) where it is loaded, as the stubs say.
    from google._upb import _message as upb
    from google.protobuf.descriptor import EnumDescriptor, FieldDescriptor

    _Field: TypeAlias = FieldDescriptor | upb.FieldDescriptor
    _Enum: TypeAlias = EnumDescriptor | upb.EnumDescriptor

M = TypeVar("M", bound=Message)

#: proto enum name -> (wire prefix, domain enum)
_ENUMS: dict[str, tuple[str, type[enum.Enum]]] = {
    "Status": ("STATUS_", Status),
    "Verdict": ("VERDICT_", Verdict),
    "NoTruthReason": ("NO_TRUTH_REASON_", NoTruthReason),
}


def status_number(status: str) -> pb.Status:
    """``"FAIL"`` (any case) -> ``pb.STATUS_FAIL``; ValueError for an unknown status."""
    # the generated stub types an enum's values as pb.Status, its Value() as int: the same values
    return cast("pb.Status", pb.Status.Value("STATUS_" + Status(status.upper()).name))


def _domain_to_wire(field: _Field, value: Any) -> Any:
    if (enum_type := field.enum_type) is not None:
        prefix, domain = _ENUMS[enum_type.name]
        return enum_type.values_by_name[prefix + domain(value).name].number
    return value


def _enum_to_domain(enum_type: _Enum, number: int) -> str | None:
    prefix, domain = _ENUMS[enum_type.name]
    name = enum_type.values_by_number[number].name.removeprefix(prefix)
    return None if name == "UNSPECIFIED" else domain[name].value


def status_name(number: int) -> str | None:
    """``pb.STATUS_FAIL`` -> ``"FAIL"``; None for STATUS_UNSPECIFIED."""
    return _enum_to_domain(pb.Status.DESCRIPTOR, number)


def _wire_to_domain(field: _Field, value: Any) -> Any:
    if (enum_type := field.enum_type) is not None:
        return _enum_to_domain(enum_type, value)
    if (message_type := field.message_type) is not None:
        if message_type.full_name == Timestamp.DESCRIPTOR.full_name:
            return value.ToNanoseconds() / 1e9
        return to_doc(value)
    return value


def fill(message: M, doc: dict[str, Any]) -> M:
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
    out: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
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
