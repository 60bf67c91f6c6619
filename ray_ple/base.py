"""The one base model of the package: every value that crosses a boundary is frozen and strict.

Frozen, so a record cannot change after it was checked (a handle, a verdict); `extra="forbid"`,
so a misspelt key is an error rather than a default. Ray pickles these models across calls.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
