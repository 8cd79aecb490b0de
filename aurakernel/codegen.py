"""Render kernel sources from the Jinja templates in templates/.

Only typed values reach a template: ints, floats, bools, members of the enums AuraKernel
defines (DType) and Identifiers (names checked at construction). Other strings are refused, so no
free text is ever rendered into C/C++ source, and a missing value is an error (StrictUndefined),
never an empty string.
"""

from __future__ import annotations

import enum
import hashlib
import math
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import jinja2

from .paths import TEMPLATES_DIR


class Identifier(str):
    """A C / CMake identifier built from AuraKernel's own names (an operator, a variant, a dtype, widths):
    letters, digits and underscores, starting with a letter; anything else is refused here."""

    def __new__(cls, value: str):
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]{0,127}", value):
            raise ValueError(f"{value!r} is not an identifier: letters, digits and _, starting with a letter")
        return super().__new__(cls, value)


@dataclass(frozen=True)
class Source:
    template: str
    text: str
    hash: str = field(init=False)  # content hash: names the kernel in caches, the DB and plans

    def __post_init__(self):
        object.__setattr__(self, "hash", hashlib.sha256(self.text.encode()).hexdigest()[:20])


@lru_cache(maxsize=16)
def environment(search: tuple[str, ...] = ()) -> jinja2.Environment:
    """Templates from templates/, then from `search` (an operator's own template folders: a
    third-party operator's kernel can include AuraKernel's common headers)."""
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader([str(TEMPLATES_DIR), *search]),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )


def _check_value(name: str, value: Any) -> None:
    if isinstance(value, bool | enum.Enum | Identifier):
        return
    if isinstance(value, int):
        if not -(2**63) <= value < 2**63:
            raise ValueError(f"template value {name}={value} does not fit in int64")
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"template value {name}={value} is not finite")
        return
    if isinstance(value, tuple | list):
        for i, item in enumerate(value):
            _check_value(f"{name}[{i}]", item)
        return
    raise TypeError(f"template value {name} has type {type(value).__name__}: only int, float, bool, "
                    f"enum members and sequences of them may reach generated source")


def render(template: str, params: dict[str, Any], search=()) -> Source:
    for name, value in params.items():
        _check_value(name, value)
    text = environment(tuple(str(p) for p in search)).get_template(template).render(**params)
    return Source(template, text)
