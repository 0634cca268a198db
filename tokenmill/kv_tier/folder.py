"""The file tier's folder for one model's KV layout: a subfolder named by a digest of what makes stored
KV bytes valid (weights, dtypes, block layout, format), so another model or setting never reads them."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path

from tokenmill.loader.default_model import cache_dir


def tier_folder(path: str | None, identity: Mapping[str, object]) -> Path:
    """`path` (--kv-offloading-path; None: kv_tier/ in the tokenmill cache) / <digest of `identity`>/,
    created, with identity.json in it for people."""
    text = json.dumps(identity, sort_keys=True, default=str)
    base = Path(path) if path is not None else cache_dir() / "kv_tier"
    folder = base / hashlib.sha256(text.encode()).hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / "identity.json"
    if not target.exists():
        tmp = folder / f"identity.json.tmp{os.getpid()}"
        tmp.write_text(json.dumps(identity, sort_keys=True, indent=1, default=str) + "\n")
        os.replace(tmp, target)
    return folder
