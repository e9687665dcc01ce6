"""What a dotted key names in a config class: the field's type behind Annotated/Optional, flag aliases,
`no_` forms of booleans, sections a bare value fills (`shorthand`), tables whose entries flags set one by one
(`FLAG_TABLE`), and the nearest valid key for a mistyped one ("did you mean", or where a moved key went)."""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_settings import NoDecode


def unwrap(annotation: Any) -> Any:
    """Strip Annotated/Optional so we can see what a flag expects."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(args) != 1:
                return annotation
            annotation = args[0]
        else:
            return annotation


def is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def is_list(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (list, tuple, Sequence)


def dealias(cls: type[BaseModel], path: list[str]) -> list[str]:
    """`path` with flag aliases replaced: a config class may map extra flag names to dotted field paths in a
    `flag_aliases` class variable (e.g. vLLM's `tensor_parallel_size` -> `parallel.tp`), at any depth."""
    out: list[str] = []
    model: Any = cls
    for part in path:
        aliases = getattr(model, "flag_aliases", {}) if is_model(model) else {}
        out += aliases[part].split(".") if part in aliases else [part]
        model = field_type(cls, out)
    return out


def field_info(cls: type[BaseModel], path: list[str]) -> FieldInfo | None:
    """The field at `path` (non-empty), or None if there is no such field."""
    annotation: Any = cls
    info = None
    for part in path:
        if is_list(annotation) and is_model(item_type(annotation)):
            annotation = item_type(annotation)  # `--env.id x` addresses a list of tables written as one table
        if not is_model(annotation) or part not in annotation.model_fields:
            return None
        info = annotation.model_fields[part]
        annotation = unwrap(info.annotation)
    return info


def field_type(cls: type[BaseModel], path: list[str]) -> Any | None:
    """The unwrapped annotation of the field at `path`, or None if there is no such field."""
    if not path:
        return cls
    info = field_info(cls, path)
    return None if info is None else unwrap(info.annotation)


def env_json_kind(cls: type[BaseModel], path: list[str]) -> str | None:
    """'a list' or 'a table' when pydantic-settings reads an env var for the field at `path` as JSON, else None
    (its text is the value: scalars, and `NoDecode` fields such as `weight_transfer`)."""
    info = field_info(cls, path) if path else None
    if info is None or NoDecode in info.metadata:
        return None
    annotation = unwrap(info.annotation)
    if is_list(annotation):
        return "a list"
    if is_model(annotation) or annotation is dict or typing.get_origin(annotation) is dict:
        return "a table"
    return None


class FlagTable:
    """Marks a `dict[str, X]` field whose entries flags set one by one, the key kept as typed:
    `--vllm.max-num-batched-tokens 8192` sets `vllm["max-num-batched-tokens"]`, `--env-vars.OMP_NUM_THREADS 4`
    sets `env_vars["OMP_NUM_THREADS"]`. Put it in the field's `Annotated[...]`."""

    def __repr__(self) -> str:
        return "FLAG_TABLE"


FLAG_TABLE = FlagTable()


def flag_table(info: FieldInfo | None) -> Any | None:
    """The value type of a `FLAG_TABLE` field (Any when unparametrized), else None."""
    if info is None or not any(isinstance(m, FlagTable) for m in info.metadata):
        return None
    args = typing.get_args(unwrap(info.annotation))
    return args[1] if len(args) == 2 else Any


def table_entry(cls: type[BaseModel], parts: list[str]) -> tuple[list[str], Any] | None:
    """For the parts of a flag (`inference.vllm.max-num-seqs`, dashes as typed) that name an entry of a
    `FLAG_TABLE` field: (the field's path + the entry's key as typed, the table's value type); else None. The
    key is what follows the table's name (dots included: `--vllm.compilation-config.mode 0`)."""
    for n in range(1, len(parts)):
        path = dealias(cls, [p.replace("-", "_") for p in parts[:n]])
        info = field_info(cls, path)
        if info is None:
            return None
        if (value_type := flag_table(info)) is not None:
            return [*path, ".".join(parts[n:])], value_type
    return None


def accepts_bool(annotation: Any) -> bool:
    """Whether a value of this type may be a bool (a bare table-entry flag then means true)."""
    if annotation is Any or annotation is bool:
        return True
    return typing.get_origin(annotation) in (typing.Union, types.UnionType) and any(
        accepts_bool(a) for a in typing.get_args(annotation)
    )


def shorthand(annotation: Any) -> str | None:
    """The field a bare value of this section sets, when its model declares one in a `shorthand` class variable
    (`weight_transfer = "broadcast"` is `weight_transfer.type = "broadcast"`); else None."""
    return getattr(annotation, "shorthand", None) if is_model(annotation) else None


def expand_shorthands(cls: type[BaseModel], tree: dict) -> dict:
    """`tree` (a TOML layer, a config's input) with every bare value of a shorthand section written as its table,
    at any depth, so layers and flags merge key by key; `tree` itself is not modified."""
    out = dict(tree)
    for key, value in tree.items():
        annotation = field_type(cls, [key])
        if isinstance(value, str) and (field := shorthand(annotation)) is not None:
            out[key] = {field: value}
        elif isinstance(value, dict) and is_model(annotation):
            out[key] = expand_shorthands(annotation, value)
    return out


def item_type(annotation: Any) -> Any:
    args = typing.get_args(annotation)
    return unwrap(args[0]) if args else None


def negated(cls: type[BaseModel], path: list[str]) -> list[str] | None:
    """The path of bool field `x` when `path` spells `--no-x`, `--sec.no-x` or `--no-sec.x`, else None."""
    candidates = []
    if path[-1].startswith("no_"):
        candidates.append(path[:-1] + [path[-1][3:]])
    if path[0].startswith("no_") and len(path) > 1:
        candidates.append([path[0][3:]] + path[1:])
    return next((alt for alt in candidates if field_type(cls, alt) is bool), None)


def is_key(cls: type[BaseModel], path: list[str]) -> bool:
    path = dealias(cls, path)
    return field_type(cls, path) is not None or negated(cls, path) is not None


def _unknown_part(cls: type[BaseModel], path: list[str]) -> tuple[int, Any] | None:
    """The index of the first part of `path` that names no field, and the model it was looked up in."""
    n = next((n for n in range(len(path)) if field_type(cls, path[: n + 1]) is None), None)
    if n is None:
        return None
    level = field_type(cls, path[:n])
    if is_list(level):
        level = item_type(level)  # a list of tables takes its item's keys, as in `field_type`
    return (n, level) if is_model(level) else None


def moved(cls: type[BaseModel], path: list[str]) -> tuple[str, str] | None:
    """(old key, where its settings are now) when `path` names a key its model lists in a `moved_keys` class
    variable (old name -> new dotted location, e.g. `weight_broadcast` -> `weight_transfer.host/port/timeout`)."""
    found = _unknown_part(cls, path)
    if found is None:
        return None
    n, level = found
    new = getattr(level, "moved_keys", {}).get(path[n])
    return None if new is None else (".".join(path[: n + 1]), ".".join([*path[:n], new]))


def suggest(cls: type[BaseModel], path: list[str]) -> list[str] | None:
    """The valid key nearest an unknown `path`: its first unknown part replaced by the closest key at that level
    (difflib; flag aliases and `no_` forms of booleans count), or None when nothing there is close."""
    found = _unknown_part(cls, path)
    if found is None:
        return None
    n, level = found
    names = [*level.model_fields, *getattr(level, "flag_aliases", {})]
    if n == len(path) - 1:
        names += [f"no_{k}" for k, f in level.model_fields.items() if unwrap(f.annotation) is bool]
    match = difflib.get_close_matches(path[n], names, n=1)
    if not match:
        return None
    fixed = path[:n] + match + path[n + 1 :]
    return fixed if is_key(cls, fixed) else path[:n] + match


def did_you_mean(cls: type[BaseModel], path: list[str], as_flag: bool) -> str:
    """` (did you mean --optim.max-norm?)` for a mistyped key (`optim.max_norm` outside flags), `; the
    weight_broadcast settings are now weight_transfer.host/port/timeout` for a moved one, or ''."""
    if (found := moved(cls, path)) is not None:
        old, new = (f"--{key.replace('_', '-')}" if as_flag else key for key in found)
        return f"; the {old} settings are now {new}"
    fixed = suggest(cls, path)
    if fixed is None:
        return ""
    key = ".".join(fixed)
    return f" (did you mean --{key.replace('_', '-')}?)" if as_flag else f" (did you mean {key}?)"
