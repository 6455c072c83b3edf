"""One registry per extension point: a name -> factory (a class, a function or an object) table.

Reward kinds, benchmark suites, generation and judge backends and model families each keep one
:class:`Registry`; adding one is one ``register`` call (or decorator) in any module imported before
the config is read. ``get`` is the only lookup: an unknown name is one line listing the known
names, with the nearest one offered. The configuration reference lists every registry
(:func:`registries`). No torch import here: the lowest layer.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

from rolemrc.errors import ConfigError

T = TypeVar("T")
_UNSET: Any = object()
_ALL: dict[str, Registry[Any]] = {}


class Registry(Generic[T]):
    """Named entries of one extension point, in registration order.

    ``key``: the config key whose value names an entry (``generation.backend``), used in errors;
    ``error``: the exception class ``get`` raises (a ``ValueError`` subclass keeps callers' handling)."""

    def __init__(self, key: str, *, doc: str = "", error: type[Exception] = ConfigError) -> None:
        self.key, self.doc, self.error = key, doc, error
        self._entries: dict[str, T] = {}
        self._docs: dict[str, str] = {}
        _ALL[key] = self

    def register(self, name: str, factory: T = _UNSET, *, doc: str = "") -> Any:
        """Add ``factory`` under ``name``; without ``factory``, a decorator that adds what it decorates.
        A name registered twice is a ValueError (a plug-in must not silently replace a built-in)."""
        if factory is _UNSET:
            def decorate(f: T) -> T:
                self.register(name, f, doc=doc)
                return f
            return decorate
        if name in self._entries:
            raise ValueError(f"{self.key}: {name!r} is registered already")
        self._entries[name] = factory
        self._docs[name] = doc or (getattr(factory, "__doc__", None) or "").strip().split("\n")[0]
        return factory

    def get(self, name: Any, default: Any = _UNSET, *, where: str | None = None, hint: str = "") -> T:
        """The entry ``name``; ``default`` when given and ``name`` is unknown, else ``error``:
        ``<where> must be one of a, b<hint>, got 'x'; did you mean 'a'?``."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            if default is not _UNSET:
                return default
        close = difflib.get_close_matches(str(name), self.names(), n=1) if isinstance(name, str) else []
        raise self.error(f"{where or self.key} must be one of {', '.join(self._entries)}{hint}, got {name!r}"
                         + (f"; did you mean {close[0]!r}?" if close else ""))

    def names(self) -> list[str]:
        return list(self._entries)

    def describe(self, name: str) -> str:
        """The one-line doc given at registration (or the factory's docstring's first line)."""
        return self._docs[name]

    def items(self) -> list[tuple[str, T]]:
        return list(self._entries.items())

    def values(self) -> list[T]:
        return list(self._entries.values())

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def __setitem__(self, name: str, factory: T) -> None:
        """Replace (or add) an entry outright: for tests (``monkeypatch.setitem``); plug-ins use ``register``."""
        self._entries[name] = factory
        self._docs.setdefault(name, "")

    def __delitem__(self, name: str) -> None:
        del self._entries[name]
        del self._docs[name]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.key!r}: {', '.join(self._entries)})"


def registries() -> dict[str, Registry[Any]]:
    """Every registry created so far (those of the modules imported), by config key."""
    return dict(_ALL)


# The modules that create and fill the project's registries (importing one registers its entries):
# what ``--help`` and the configuration reference list. Named, not imported, here: importing them
# is the listing's business (:func:`all_registries`), not this module's.
REGISTRY_MODULES = ("rolemrc.config_objectives", "rolemrc.rewards", "rolemrc.eval.generation", "rolemrc.eval.judge",
                    "rolemrc.eval.suites", "rolemrc.models.family", "rolemrc.rollout", "rolemrc.env",
                    "rolemrc.synth.pipeline")


def all_registries() -> dict[str, Registry[Any]]:
    """Every registry of the project (importing the modules that fill them), by config key."""
    for module in REGISTRY_MODULES:
        importlib.import_module(module)
    return registries()


def help_text() -> str:
    """The registered names of every extension point, one line each: the ``--help`` section
    (``${registered_names:}`` in conf/hydra/default.yaml's help template)."""
    return "\n".join(f"{key}: {', '.join(reg)}" for key, reg in sorted(all_registries().items()))

