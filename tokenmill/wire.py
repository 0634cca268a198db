"""The one codec for messages between processes (the engine process's pipe, the executor's ranks).

A message is a `Message` (a msgspec Struct); what it carries is Structs, the contract dataclasses
(outputs.py, SamplingParams) and plain values. All of it travels as msgpack maps keyed by field
name, so a field added, moved or renamed on one side can never land in another's place:

- every message names its type (its tag), so a message of another union is refused;
- a Message with a field its reader does not know, and any Struct or dataclass missing a field
  without a default, is refused with the path of the field (`WireError`);
- never pickle: only the types the reader names can come out.

msgpack carries integers up to 64 bits: a value past that is an OverflowError when encoding.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

__all__ = ["Codec", "Message", "WireError"]

T = TypeVar("T")


class Message(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """Base of every message type: tagged with its class name, strict about its fields."""


class WireError(ValueError):
    """Bytes that are not a message of the expected type (another union's, or of another field layout)."""


class Codec(Generic[T]):
    """Encodes and decodes one message type (a Message, or a union of them).

    Usage::

        commands = Codec[Command](Command)
        data = commands.encode(Stop())
        assert commands.decode(data) == Stop()
    """

    def __init__(self, message_type: Any, name: str = "message") -> None:
        # Any: a union of Struct types is not a `type[T]` that mypy can express.
        self._name = name
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(message_type)

    def encode(self, message: T) -> bytes:
        return self._encoder.encode(message)

    def decode(self, data: bytes) -> T:
        try:
            return self._decoder.decode(data)
        except msgspec.DecodeError as exc:  # ValidationError included
            raise WireError(f"not a valid {self._name}: {exc}") from None
