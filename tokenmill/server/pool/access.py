"""Which models each API key may use, from a JSON file (the registry's access.json by default)::

    {
      "keys": {
        "sk-team-a": ["smol", "smol-stable"],
        "sk-ops": ["*"],
        "sk-eval": ["smol@1", "tiny-*"]
      }
    }

Every key in the file is an API key of the server (beside --api-key's). A pattern (shell-style: `*`, `?`,
`[...]`) grants a model when it matches the id the request sent, the `name@version` it resolves to, or that
version's bare name: "smol" grants every version of smol and every alias pointing at one, "smol@1" only
that version. A key the file does not list (a --api-key one) may use no model: grant it ["*"] to keep
today's behaviour. Read once at start-up."""

from __future__ import annotations

import json
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path


@dataclass(frozen=True)
class AccessPolicy:
    """API key -> the model patterns it may use."""

    patterns: dict[str, tuple[str, ...]]  # by the key itself

    @classmethod
    def load(cls, path: Path) -> AccessPolicy:
        """Parse the file; ValueError with the file's name on anything malformed."""
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read the access config {path}: {exc}") from None
        keys = data.get("keys") if isinstance(data, dict) else None
        if not isinstance(keys, dict) or not keys:
            raise ValueError(f'the access config {path} needs {{"keys": {{"API_KEY": ["model", ...]}}}}')
        patterns: dict[str, tuple[str, ...]] = {}
        for key, models in keys.items():
            if not key.strip() or not isinstance(models, list) or not all(isinstance(m, str) for m in models):
                raise ValueError(f"the access config {path}: each key needs a list of model names or patterns")
            patterns[key.strip()] = tuple(models)
        return cls(patterns)

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(self.patterns)

    def allows(self, patterns: tuple[str, ...], ids: tuple[str, ...]) -> bool:
        """Whether any of `patterns` matches any of the ids a request's model goes by."""
        return any(fnmatchcase(model_id, p) for p in patterns for model_id in ids)


@dataclass(frozen=True)
class KeyAccess:
    """The policy by key name (what ApiKeys.identify returns), as the routes see it."""

    policy: AccessPolicy
    by_name: dict[str, tuple[str, ...]]  # key name -> patterns; names absent here may use nothing

    def allows(self, key_name: str, ids: tuple[str, ...]) -> bool:
        return self.policy.allows(self.by_name.get(key_name, ()), ids)
