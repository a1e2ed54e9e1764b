"""Built-in procedural task families; each module exposes ``domains() -> list[Domain]``."""

from __future__ import annotations

from posttrain.tasks.base import Domain

BUILTIN_FAMILIES = (
    "arithmetic",
    "strings",
    "lists",
    "logic",
    "structure",
    "bases",
    "sequences",
    "equations",
    "code",
    "tools",
)


def builtin_domains() -> list[Domain]:
    """Every built-in domain, procedural families first, then code and tool use."""
    import importlib

    out: list[Domain] = []
    for family in BUILTIN_FAMILIES:
        out.extend(importlib.import_module(f"posttrain.tasks.families.{family}").domains())
    return out
