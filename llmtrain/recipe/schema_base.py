"""Shared pieces of the recipe schema: the strict base model and the count bound."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

BIG = 1 << 24  # upper bound for counts: catches "huge number" typos without limiting real use
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
