"""Model validators that state one cross-field rule, for records and configs alike.

Assign one in a model's class body (``_check_sizes = ordered_fields("min_samples",
"max_samples")``); pydantic runs it after the fields are validated.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, model_validator

__all__ = ["exactly_one", "ordered_fields"]

ModelT = TypeVar("ModelT", bound=BaseModel)


def ordered_fields(low: str, high: str, *, verb: str = "is larger than") -> Any:
    """A model validator, assigned in a model's class body: field ``low`` may not be above
    field ``high`` (the error names both, with their values)."""

    def check(model: ModelT) -> ModelT:
        lo, hi = getattr(model, low), getattr(model, high)
        if lo > hi:
            raise ValueError(f"{low} ({lo}) {verb} {high} ({hi})")
        return model

    return model_validator(mode="after")(check)


def exactly_one(first: str, second: str, message: str) -> Any:
    """A model validator, assigned in a model's class body: exactly one of the fields
    ``first`` and ``second`` is set (not None); else ``ValueError(message)``."""

    def check(model: ModelT) -> ModelT:
        if (getattr(model, first) is None) == (getattr(model, second) is None):
            raise ValueError(message)
        return model

    return model_validator(mode="after")(check)
