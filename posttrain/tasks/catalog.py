"""The domain registry: names, filters and lookup.

``posttrain.tasks.registry`` is the process-wide instance holding the built-in families;
user domains (JSONL files, reasoning-gym datasets, wrappers) are added with ``register``.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Iterable

from posttrain.tasks.base import Domain


def _as_set(value, kind) -> set | None:
    if value is None:
        return None
    if isinstance(value, kind):
        return {value}
    return set(value)


class Registry:
    """Domains by name; iteration and listings are sorted by name."""

    def __init__(self, domains: Iterable[Domain] = ()):
        self._domains: dict[str, Domain] = {}
        for d in domains:
            self.register(d)

    def register(self, domain: Domain, *, replace: bool = False) -> Domain:
        if not isinstance(domain, Domain):
            raise TypeError(f"can only register a Domain, got {type(domain).__name__}")
        if domain.name in self._domains and not replace:
            raise ValueError(f"domain {domain.name!r} is already registered (pass replace=True)")
        self._domains[domain.name] = domain
        return domain

    def unregister(self, name: str) -> None:
        self.get(name)
        del self._domains[name]

    def get(self, name: str) -> Domain:
        try:
            return self._domains[name]
        except KeyError:
            close = difflib.get_close_matches(str(name), self._domains, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise KeyError(f"unknown domain {name!r}{hint}") from None

    def __contains__(self, name) -> bool:
        return name in self._domains

    def __len__(self) -> int:
        return len(self._domains)

    def __iter__(self):
        return iter(self.filter())

    def filter(
        self,
        family: str | Iterable[str] | None = None,
        level: int | Iterable[int] | None = None,
        pattern: str | None = None,
    ) -> list[Domain]:
        """Domains matching every given criterion: family, level(s), and a glob on the name."""
        families = _as_set(family, str)
        levels = _as_set(level, int)
        out = []
        for name in sorted(self._domains):
            d = self._domains[name]
            if families is not None and d.family not in families:
                continue
            if levels is not None and d.level not in levels:
                continue
            if pattern is not None and not fnmatch.fnmatchcase(name, pattern):
                continue
            out.append(d)
        return out

    def names(self, family=None, level=None, pattern=None) -> list[str]:
        return [d.name for d in self.filter(family, level, pattern)]

    def families(self) -> list[str]:
        return sorted({d.family for d in self._domains.values()})


registry = Registry()
