"""The base of every request model: strict types (a string is not an integer), no NaN or infinity, and
fields the model does not know ignored, as vLLM does, with one warning in the log per field name, so
that a client's misspelt or unsupported field is visible to whoever runs the server. A whole request
body (RequestBody) also refuses lone surrogates anywhere in it."""

from __future__ import annotations

import logging
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

logger = logging.getLogger(__name__)

# Field names warned about, so that each is logged once; bounded, since every request may bring new ones.
MAX_WARNED_FIELDS = 256
_warned: set[str] = set()


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _warn_unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = {field.alias or name for name, field in cls.model_fields.items()}
            for key in data.keys() - known:
                if data[key] is not None:  # a null asks for nothing (SDKs echo messages with "refusal": null)
                    _warn_once(cls.__name__, str(key))
        return data


def _warn_once(model: str, key: str) -> None:
    name = f"{model}.{key[:100]}"
    if name in _warned or len(_warned) >= MAX_WARNED_FIELDS:
        return
    _warned.add(name)
    logger.warning("ignoring the field %r of %s: this server does not know it (logged once)", key[:100], model)


class RequestBody(StrictModel):
    """A route's whole body: checked once for text that is not Unicode."""

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any) -> Any:
        if (where := _lone_surrogate(data)) is not None:
            raise PydanticCustomError(
                "invalid_unicode", "{where} holds a lone UTF-16 surrogate, which is not Unicode text", {"where": where}
            )
        return data


_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(data: object) -> str | None:
    """Where in a parsed JSON body a string holds a lone surrogate ("\\ud800" is valid JSON but no
    Unicode text: it can be neither tokenized nor sent back as UTF-8), else None. Iterative: bodies
    may nest deeply."""
    stack: list[tuple[object, str]] = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return path[:200] or "the body"
        elif isinstance(value, dict):
            for key, item in value.items():
                if _SURROGATE.search(key):
                    return f"a key of {path[:200] or 'the body'}"
                stack.append((item, f"{path}.{key}" if path else key))
        elif isinstance(value, list):
            stack.extend(
                (item, f"{path}.{i}" if path else str(i))
                for i, item in enumerate(value)
                if isinstance(item, (str, dict, list))  # not each token id of a long prompt
            )
    return None
