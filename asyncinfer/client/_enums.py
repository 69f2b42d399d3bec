"""Proto enum numbers to the SDK's enums and back, numbers newer than this SDK included.

The protos only ever add enum values (buf breaking holds them to it), so a newer gateway may send a
number this SDK has no member for: a new job or batch state, waiting reason, priority, callback
event or delivery state. Protobuf keeps such a number as it is; so does the SDK, as a value of the
same enum outside its members, named `UNKNOWN_<number>` (`JobState.UNKNOWN_9` prints as
"UNKNOWN_9"). Reading a job never raises for it, and the value goes back as the same number
(resubmitting with a job's priority). It is no member: not listed by `list(JobState)`, not
`in JobState` on any Python (asyncinfer.open_enums: 3.12's enum took any instance for a member),
not terminal (`Job.done` is False), `JobState("UNKNOWN_9")` still raises; `unknown_number` tells it
apart. The domain's enums stay as they are: the services iterate them (a queue per priority)."""

from __future__ import annotations

import enum
from functools import partial
from typing import Any, TypeVar, cast

E = TypeVar("E", bound=enum.StrEnum)

UNKNOWN_PREFIX = "UNKNOWN_"
_unknown_values: dict[tuple[type[enum.StrEnum], int], enum.StrEnum] = {}
_unknown_numbers: dict[tuple[type[enum.StrEnum], str], int] = {}


def unknown_name(number: int) -> str:
    """How a number without a name is written: `UNKNOWN_9`."""
    return f"{UNKNOWN_PREFIX}{number}"


def unknown_value(enum_cls: type[E], number: int) -> E:
    """The value of `enum_cls` that stands for `number`, which it has no member for: made the way
    enum makes a Flag's combined values (an instance outside the members), once per number, so that
    two reads of the same number give the same object."""
    key = (cast(type[enum.StrEnum], enum_cls), number)
    found = _unknown_values.get(key)
    if found is None:
        name = unknown_name(number)
        found = str.__new__(enum_cls, name)
        found._name_ = name
        found._value_ = name
        # Pickled as this call (Enum's own reduce, JobState("UNKNOWN_9"), would not load): pickle
        # looks __reduce_ex__ up on the object, so the instance's attribute is the one it takes.
        found.__reduce_ex__ = partial(_reduced, enum_cls, number)  # type: ignore[method-assign]
        _unknown_numbers[(key[0], name)] = number
        _unknown_values[key] = found
    return cast(E, found)


def _reduced(enum_cls: type[enum.StrEnum], number: int, _protocol: object) -> tuple[Any, tuple[Any, ...]]:
    return unknown_value, (enum_cls, number)


def unknown_number(value: enum.Enum) -> int | None:
    """The proto enum number of a value newer than this SDK (`JobState.UNKNOWN_9`: 9); None for one
    of the enum's members."""
    if value.name in type(value).__members__:
        return None
    return _unknown_numbers.get((cast(type[enum.StrEnum], type(value)), value.name))


def from_proto(enum_cls: type[E], proto_enum: Any, number: int, prefix: str) -> E:
    """The member whose name is the number's proto name less `prefix` (JOB_STATE_QUEUED: QUEUED);
    for a number the SDK has no member for (newer, or UNSPECIFIED), its `unknown_value`."""
    try:
        return enum_cls(proto_enum.Name(number).removeprefix(prefix))
    except ValueError:
        return unknown_value(enum_cls, number)


def optional_from_proto(enum_cls: type[E], proto_enum: Any, number: int, prefix: str) -> E | None:
    """As `from_proto`, with None for 0 (UNSPECIFIED: the field was not set)."""
    return None if number == 0 else from_proto(enum_cls, proto_enum, number, prefix)


def to_proto(value: enum.StrEnum, proto_enum: Any, prefix: str) -> int:
    """The proto number of a member (its name with `prefix`), or the number an unknown value stands
    for. ValueError for a name the protos do not have."""
    number = unknown_number(value)
    if number is not None:
        return number
    result: int = proto_enum.Value(prefix + value.value)
    return result


def name_from_proto(proto_enum: Any, number: int, prefix: str) -> str:
    """The number's proto name less `prefix`, or `UNKNOWN_<number>` for one newer than this SDK (for
    the fields the SDK gives as plain strings: a model version's state, a batch's priority)."""
    try:
        name: str = proto_enum.Name(number)
    except ValueError:
        return unknown_name(number)
    return name.removeprefix(prefix)
