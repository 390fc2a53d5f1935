"""The base of every config section (``moezero.config.schema``): unknown keys rejected,
assignments validated, a failed assignment undone."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError


class Section(BaseModel):
    """Base of every section: unknown keys rejected, assignments validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    def __setattr__(self, name: str, value: Any) -> None:
        # pydantic keeps a value that failed an after-validator on assignment; undo it.
        old = self.__dict__.get(name, _MISSING)
        try:
            super().__setattr__(name, value)
        except ValidationError:
            if old is not _MISSING:
                self.__dict__[name] = old
            raise


_MISSING = object()
