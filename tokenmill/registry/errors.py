"""What the registry raises: every error is a ValueError whose message says what to do."""

from __future__ import annotations


class RegistryError(ValueError):
    """A registry operation that cannot be done as asked (bad name, existing version, protected version)."""


class UnknownModelError(RegistryError, KeyError):
    """No model, version or alias by that id; the message lists what the registry holds.

    A KeyError too, so `registry.resolve(id)` reads like a lookup to callers that catch KeyError.
    """

    def __str__(self) -> str:
        # KeyError's own __str__ would quote the message.
        return str(self.args[0]) if self.args else ""


class RegistryCorruptError(RegistryError):
    """A stored version's files no longer match its manifest (a file missing, resized or rewritten)."""


class RegistryBusyError(RegistryError):
    """Another writer held the registry's lock longer than this writer would wait."""
