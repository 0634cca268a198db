"""How a model pools: its folder's sentence-transformers pooling config (modules.json naming a Pooling
module, whose config.json sets one pooling_mode_*), else the last token, as a decoder model's embedding
is read; and whether it has a classification head (*ForSequenceClassification)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.models.architectures import is_classifier
from tokenmill.pooling_params import PoolingParams, PoolingTask, PoolingType

logger = logging.getLogger(__name__)

# sentence-transformers' pooling_mode_* keys -> ours
_MODES: dict[str, PoolingType] = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}
_POOLING_MODULE = "sentence_transformers.models.Pooling"


@dataclass(frozen=True)
class ModelPooling:
    pooling_type: PoolingType
    hidden_size: int
    classifier: bool  # a *ForSequenceClassification model: its head scores, and it embeds nothing
    num_labels: int = 0
    unsupported: str | None = None  # a pooling mode the folder asks for that tokenmill has not

    @classmethod
    def of(cls, folder: Path | None, hf_config: Any) -> ModelPooling:
        pooling_type, unsupported = read_pooling_type(folder)
        classifier = is_classifier(hf_config)
        num_labels = int(getattr(hf_config, "num_labels", 0)) if classifier else 0
        return cls(pooling_type, int(hf_config.hidden_size), classifier, num_labels, unsupported)

    def params(self, task: PoolingTask) -> PoolingParams:
        """The pooling params of a request for `task`; ValueError if this model cannot do it."""
        if task == "classify":
            if not self.classifier:
                raise ValueError("this model has no classification head (a *ForSequenceClassification model).")
            return PoolingParams("classify", "LAST", normalize=False)
        if self.classifier:
            raise ValueError("this model is a classifier (*ForSequenceClassification): it scores, it does not embed.")
        if self.unsupported is not None:
            raise ValueError(f"the model's sentence-transformers pooling ({self.unsupported}) is not supported.")
        return PoolingParams("embed", self.pooling_type, normalize=True)


def read_pooling_type(folder: Path | None) -> tuple[PoolingType, str | None]:
    """(the folder's sentence-transformers pooling type, else LAST; the mode asked for if unsupported)."""
    if folder is None or not (folder / "modules.json").is_file():
        return "LAST", None
    try:
        modules = json.loads((folder / "modules.json").read_text())
        pooling = next((m for m in modules if m.get("type") == _POOLING_MODULE), None)
        if pooling is None:
            return "LAST", None
        config = json.loads((folder / pooling.get("path", "") / "config.json").read_text())
    except (OSError, ValueError, AttributeError) as exc:
        logger.warning("ignoring the unreadable sentence-transformers config in %s: %s", folder, exc)
        return "LAST", None
    modes = [key for key, on in config.items() if key.startswith("pooling_mode_") and on is True]
    known = [_MODES[m] for m in modes if m in _MODES]
    if len(modes) == 1 and known:
        return known[0], None
    return "LAST", ", ".join(modes) or "none"
