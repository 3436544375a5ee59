"""Machinery shared by the typed config sections: build a dataclass tree from a composed Hydra config and
validate it in ``__post_init__`` with messages that name the full dotted key, what was expected and what was
given (``data.max_response_length must be an integer >= 1 (got -5)``).

* :class:`BaseConfig` is the base of every section. A subclass declares its fields (default + a comment), its
  canonical dotted path in ``SECTION`` and its range/choice checks in ``check(c)``; the annotations themselves
  are checked first (a ``bool`` field given ``"yes"`` is an error naming the key).
* :meth:`BaseConfig.from_config` builds a section from a ``DictConfig`` / mapping (interpolations resolved, absent
  keys take the field defaults, nested sections built recursively with their own dotted paths) and raises one
  :class:`ConfigError` listing every problem of the whole tree.
* :func:`collect_errors` turns the raising off for a block and collects the messages instead (``validate_config``
  adds its cross-section checks to the same list).

Keys a section does not declare are ignored here; unknown keys are rejected when the config is composed.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, ClassVar, Optional, TypeVar, Union

from omegaconf import DictConfig, ListConfig, OmegaConf

__all__ = ["BaseConfig", "ConfigError", "Checks", "collect_errors", "to_plain"]

T = TypeVar("T", bound="BaseConfig")

_SINK: ContextVar[Optional[list[str]]] = ContextVar("config_error_sink", default=None)
_PATH: ContextVar[Optional[str]] = ContextVar("config_path", default=None)


class ConfigError(ValueError):
    """Invalid trainer configuration; ``errors`` holds one message per problem."""

    def __init__(self, errors: Sequence[str]):
        self.errors = list(errors)
        super().__init__("invalid config:\n  - " + "\n  - ".join(self.errors))


@contextmanager
def collect_errors() -> Iterator[list[str]]:
    """Within the block, sections append their validation messages to the yielded list instead of raising."""
    errors: list[str] = []
    token = _SINK.set(errors)
    try:
        yield errors
    finally:
        _SINK.reset(token)


def to_plain(node: Any) -> Any:
    """A resolved plain container of a DictConfig / ListConfig (other values unchanged)."""
    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=True)
    return node


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Checks:
    """Range and choice checks of one section; every message names ``<section>.<field>`` and the value."""

    def __init__(self, obj: BaseConfig, prefix: str, errors: list[str]):
        self.obj, self.prefix, self.errors = obj, prefix, errors
        # fields whose value does not fit the annotation, with that message; a range/choice check of the same
        # field replaces it with its own (more precise) message
        self.type_errors: dict[str, str] = {}
        self.bad: set[str] = set()  # fields whose type is wrong (checks doing arithmetic on a field skip these)

    def key(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name

    def error(self, message: str, name: Optional[str] = None) -> None:
        self.errors.append(message)
        if name is not None:
            self.type_errors.pop(name, None)

    def _value(self, name: str) -> tuple[bool, Any]:
        return True, getattr(self.obj, name)

    def choice(self, name: str, choices: Sequence[Any], allow_none: bool = False) -> None:
        ok, value = self._value(name)
        if not ok or (value is None and allow_none):
            return
        if isinstance(value, (list, dict)) or value not in choices:
            valid = ", ".join(map(str, choices)) + (", null" if allow_none else "")
            self.error(f"{self.key(name)} must be one of [{valid}] (got {value!r})", name)

    def integer(
        self, name: str, minimum: Optional[int] = None, allow_none: bool = False, also: Sequence[int] = ()
    ) -> None:
        """Integer >= minimum (or one of ``also``, e.g. -1 meaning 'off'), or null when allowed."""
        ok, value = self._value(name)
        if not ok or (value is None and allow_none):
            return
        if not (_is_int(value) and (value in also or minimum is None or value >= minimum)):
            parts = ([f">= {minimum}"] if minimum is not None else []) + [str(v) for v in also]
            parts += ["null"] if allow_none else []
            expected = "an integer" + (" " + " or ".join(parts) if parts else "")
            self.error(f"{self.key(name)} must be {expected} (got {value!r})", name)

    def number(self, name: str, check: Callable[[float], bool], expected: str, allow_none: bool = False) -> None:
        ok, value = self._value(name)
        if not ok or (value is None and allow_none):
            return
        if not _is_number(value) or not check(float(value)):
            self.error(f"{self.key(name)} must be {expected} (got {value!r})", name)


def _unwrap_optional(hint: Any) -> tuple[Any, bool]:
    """(inner type, whether None is allowed) of ``Optional[X]`` / ``X | None``; other hints unchanged."""
    origin = typing.get_origin(hint)
    if origin is Union or (hasattr(types, "UnionType") and origin is types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        allows_none = len(args) < len(typing.get_args(hint))
        return (args[0] if len(args) == 1 else Any), allows_none
    return hint, False


def _type_error(key: str, hint: Any, value: Any) -> Optional[str]:
    """Message when ``value`` does not fit the annotation ``hint`` (bool, int, float, str, list, dict, sections)."""
    inner, allows_none = _unwrap_optional(hint)
    if value is None:
        return None if allows_none or inner is Any else f"{key} must not be null"
    null = " or null" if allows_none else ""
    origin = typing.get_origin(inner) or inner
    if inner is bool and not isinstance(value, bool):
        return (
            f"{key} must be True, False{null} (got {value!r})"
            if null
            else f"{key} must be True or False (got {value!r})"
        )
    if inner is int and not _is_int(value):
        return f"{key} must be an integer{null} (got {value!r})"
    if inner is float and not _is_number(value):
        return f"{key} must be a number{null} (got {value!r})"
    if inner is str and not isinstance(value, str):
        return f"{key} must be a string{null} (got {value!r})"
    if origin in (list, tuple) and not isinstance(value, (list, tuple)):
        return f"{key} must be a list{null} (got {value!r})"
    if origin is dict and not isinstance(value, Mapping):
        return f"{key} must be a mapping{null} (got {value!r})"
    return None


@dataclasses.dataclass
class BaseConfig:
    """Base of the typed config sections (see the module docstring)."""

    # canonical dotted path of the section, used in messages when it is built on its own
    SECTION: ClassVar[str] = ""

    def __post_init__(self) -> None:
        prefix = _PATH.get() or self.SECTION
        object.__setattr__(self, "_path", prefix)
        errors: list[str] = []
        checks = Checks(self, prefix, errors)
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            message = _type_error(checks.key(f.name), hints[f.name], getattr(self, f.name))
            if message:
                checks.type_errors[f.name] = message
                checks.bad.add(f.name)
        self.check(checks)
        errors[:0] = checks.type_errors.values()
        for f in dataclasses.fields(self):  # YAML's `0` for a float field (after the checks: messages show `0`)
            if _unwrap_optional(hints[f.name])[0] is float and _is_int(getattr(self, f.name)):
                object.__setattr__(self, f.name, float(getattr(self, f.name)))
        if errors:
            sink = _SINK.get()
            if sink is None:
                raise ConfigError(errors)
            sink.extend(errors)

    def check(self, c: Checks) -> None:
        """Range and choice checks of this section (override); the annotations are already checked."""

    @property
    def path(self) -> str:
        """The dotted key of this section (``actor_rollout_ref.actor``)."""
        return getattr(self, "_path", self.SECTION)

    @classmethod
    def from_config(cls: type[T], node: Any, path: Optional[str] = None) -> T:
        """Build from a DictConfig / mapping / instance; raise one :class:`ConfigError` listing every problem."""
        if isinstance(node, cls):
            return node
        if _SINK.get() is not None:  # inside collect_errors: the caller reports
            return _build(cls, to_plain(node), path or cls.SECTION)
        with collect_errors() as errors:
            built = _build(cls, to_plain(node), path or cls.SECTION)
        if errors:
            raise ConfigError(list(dict.fromkeys(errors)))
        return built

    def to_dict(self) -> dict[str, Any]:
        """A plain nested dict of the fields."""
        return dataclasses.asdict(self)


def _section_type(hint: Any) -> Optional[type]:
    inner, _ = _unwrap_optional(hint)
    return inner if isinstance(inner, type) and issubclass(inner, BaseConfig) else None


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _build(cls: type[T], data: Any, path: str) -> T:
    if isinstance(data, cls):
        return data
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        data = {f.name: getattr(data, f.name) for f in dataclasses.fields(cls) if hasattr(data, f.name)}
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        sub = _section_type(hints[f.name])
        if f.name not in data:
            if sub is not None:  # an absent section: its defaults, with its own dotted path
                kwargs[f.name] = _build(sub, {}, _join(path, f.name))
            continue
        value = data[f.name]
        if sub is not None and (isinstance(value, Mapping) or value is None and not _unwrap_optional(hints[f.name])[1]):
            value = _build(sub, value, _join(path, f.name))
        elif isinstance(value, (DictConfig, ListConfig)):
            value = to_plain(value)
        kwargs[f.name] = value
    token = _PATH.set(path)
    try:
        return cls(**kwargs)
    finally:
        _PATH.reset(token)
