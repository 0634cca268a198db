"""The base of every request model: strict types (a string is not an integer), no NaN or infinity, and
fields the model does not know ignored, as vLLM does, with one warning in the log per field name, so
that a client's misspelt or unsupported field is visible to whoever runs the server."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

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
