"""Settings dataclasses that build their own command-line flags: one declaration per setting, read by `LLM(**overrides)`,
`openk3 serve` and `openk3 generate` alike, with the same validation message wherever a value comes from.

A field declared with `setting(default, help, ...)` carries its help text, its range or choices, and optionally a CLI unit
(a byte count given in MiB or GiB on the command line). `add_arguments(parser, cls)` adds one flag per field
(`--max-num-seqs`; booleans as `--x / --no-x`), `from_args(cls, args)` builds the dataclass from parsed flags, and
`check_settings(obj)` -- called from the dataclass's `__post_init__` -- validates every field against its declaration.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from openk3.checks import check_choice, check_int, check_number

_UNITS = {"MiB": 2**20, "GiB": 2**30}


def setting(
    default: Any,
    help: str,
    *,
    low: float | None = None,
    high: float | None = None,
    choices: Sequence[str] | None = None,
    unit: str | None = None,
    flag: str | None = None,
    cli: bool = True,
) -> Any:
    """A dataclass field with what its flag and its check need. `unit`: the flag takes the value in MiB or GiB (the field
    holds bytes); `flag`: the flag's name when it is not the field's (e.g. --cache-memory-mb); `cli=False`: no flag."""
    if unit is not None and unit not in _UNITS:
        raise ValueError(f"setting: unit={unit!r}, expected one of {sorted(_UNITS)}")
    meta = {"help": help, "low": low, "high": high, "choices": tuple(choices) if choices else None, "unit": unit, "flag": flag, "cli": cli}
    return dataclasses.field(default=default, metadata={"setting": meta})


_BASE_TYPES: dict[str, type] = {"int": int, "float": float, "str": str, "bool": bool}


def _settings(cls: type) -> list[tuple[dataclasses.Field, dict[str, Any], str]]:
    return [(f, f.metadata["setting"], str(f.type)) for f in dataclasses.fields(cls) if "setting" in f.metadata]


def _base_type(annotation: str) -> tuple[type, bool]:
    """(int | float | str | bool, whether None is allowed) of a setting's annotation, read from its text so that no other
    annotation of the class (a torch type, say) has to be importable: the CLI builds its flags without importing torch."""
    parts = [p.strip() for p in annotation.split("|")]
    names = [p for p in parts if p != "None"]
    if len(names) != 1 or names[0] not in _BASE_TYPES:
        raise TypeError(f"setting of type {annotation!r}: only int, float, str and bool settings (or optional ones) have flags")
    return _BASE_TYPES[names[0]], "None" in parts


def check_settings(obj: Any) -> None:
    """Validate every `setting` field of a dataclass instance against its declared type, range and choices."""
    owner = type(obj).__name__
    for f, meta, hint in _settings(type(obj)):
        value = getattr(obj, f.name)
        base, optional = _base_type(hint)
        if value is None and optional:
            continue
        if meta["choices"] is not None:
            check_choice(owner, f.name, value, meta["choices"])
        elif base is bool:
            if not isinstance(value, bool):
                raise ValueError(f"{owner}.{f.name}={value!r} is invalid: expected True or False")
        elif base is int:
            check_int(owner, f.name, value, low=meta["low"], high=meta["high"], optional=optional)
        elif base is float:
            check_number(owner, f.name, value, low=meta["low"], high=meta["high"], optional=optional)


def _flag(f: dataclasses.Field, meta: dict[str, Any]) -> str:
    return meta["flag"] or "--" + f.name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser, cls: type, exclude: Sequence[str] = ()) -> None:
    """One flag per `setting` field of `cls` (but those in `exclude` and those declared cli=False)."""
    for f, meta, hint in _settings(cls):
        if not meta["cli"] or f.name in exclude:
            continue
        base, _ = _base_type(hint)
        default: Any = f.default
        help_text = meta["help"]
        if meta["unit"] is not None:
            help_text += f" ({meta['unit']})"
            default = None if default is None else default / _UNITS[meta["unit"]]
        kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": help_text}
        if base is bool:
            parser.add_argument(_flag(f, meta), action=argparse.BooleanOptionalAction, **kwargs)
            continue
        if meta["choices"] is not None:
            kwargs["choices"] = meta["choices"]
        kwargs["type"] = float if meta["unit"] is not None else base
        parser.add_argument(_flag(f, meta), **kwargs)


def from_args(cls: type, args: argparse.Namespace, exclude: Sequence[str] = (), **fixed: Any) -> Any:
    """`cls` from parsed flags (the fields that have a flag, but those `exclude`d as in add_arguments: a command may use
    the same name for a flag of its own), plus `fixed` values; validation is the dataclass's own."""
    values: dict[str, Any] = {}
    for f, meta, _ in _settings(cls):
        if not meta["cli"] or f.name in exclude or not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if meta["unit"] is not None and value is not None:
            value = int(value * _UNITS[meta["unit"]])
        values[f.name] = value
    values.update(fixed)
    return cls(**values)


def split_overrides(overrides: Mapping[str, Any], *classes: type) -> list[dict[str, Any]]:
    """Keyword overrides sorted by the settings class that has each (in `classes` order); an unknown name is a ValueError
    that lists the valid ones."""
    names = [{f.name for f in dataclasses.fields(cls)} for cls in classes]
    unknown = sorted(k for k in overrides if not any(k in n for n in names))
    if unknown:
        valid = sorted(set().union(*names))
        raise ValueError(f"unknown setting(s) {', '.join(map(repr, unknown))}: expected any of {', '.join(valid)}")
    return [{k: v for k, v in overrides.items() if k in n} for n in names]
