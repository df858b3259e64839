"""The base of every config section: unknown keys and bad assignments are errors, and a renamed key is
refused in one line naming its new name."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    renamed: ClassVar[dict[str, str]] = {}
    """The section's renamed keys, ``"section.old_name": "section.new_name"``: a config that still says
    the old one fails at start with the new name, not as an unknown key."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_renamed(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for old, new in cls.renamed.items():
                if old.rpartition(".")[2] in data:
                    raise ValueError(f"{old} is now {new}: rename it")
        return data
