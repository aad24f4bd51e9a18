"""What every config section shares: MindIE's camelCase keys as aliases, frozen models.

Scalars are strict (``"1025"`` is not a port, ``true`` is not an integer), as MindIE's
C++ param checker is.  Unknown keys are kept (``extra="allow"``) and the loader warns
about them.  Every model is frozen: config is read once and never mutated.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

U32 = 2**32 - 1
I32 = 2**31 - 1


def F(alias: str, default: Any = None, *, lo: int | None = None, hi: int | None = None,
      doc: str | None = None) -> Any:
    """A field under MindIE's key ``alias`` with an inclusive range [lo, hi]."""
    return Field(default, alias=alias, ge=lo, le=hi, description=doc)


class Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="allow",
                              protected_namespaces=(), populate_by_name=False)
