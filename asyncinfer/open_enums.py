"""The base of the enums a newer gateway may send a value of that this code has no member for.

The SDK keeps such a value as an instance of the enum outside its members, `UNKNOWN_<number>`
(asyncinfer.client._enums). Python's own containment check tells members apart differently by
version: 3.11's `in` looks the instance's name up among the members (False for it) and raises
TypeError for a plain string, 3.12's takes any instance of the enum for a member (True for it) and
looks a plain string up among the members' values. `OpenEnumType.__contains__` is one rule on
every Python: a member, or a plain string that is the value of one, is in the enum; an
`UNKNOWN_<number>` value is not, nor is another enum's member, nor anything else."""

from __future__ import annotations

import enum
from typing import Any


class OpenEnumType(enum.EnumType):
    def __contains__(cls, value: Any) -> bool:
        if isinstance(value, cls):
            return value._name_ in cls._member_map_
        if isinstance(value, enum.Enum):  # another enum's member, equal to a value as a string
            return False
        try:
            return value in cls._value2member_map_
        except TypeError:  # unhashable: no member's value (they are strings)
            return False


class OpenStrEnum(enum.StrEnum, metaclass=OpenEnumType):
    """A StrEnum whose `in` is OpenEnumType's."""
