"""The command line of every entrypoint: flags and `@ file.toml` layers into one validated config (docs/design.md §1).

Sources, highest precedence first: CLI flags > TOML files (`@ a.toml @ b.toml`, later wins) >
`PRIME_A__B_C` env vars > field defaults. Flags are nested and kebab-cased (`--optim.max-norm 1.0`);
booleans take `--flag` / `--no-flag`; lists take `--ids 1,2,3` or a repeated flag; a sub-config can
be filled from its own file (`--trainer @ t.toml`) or switched on with its defaults (`--ckpt`).

A bad config never raises a traceback: `parse_config` prints one line per problem, naming the key and
where its value came from, and exits with status 2. This module imports no torch.
"""

from __future__ import annotations

import functools
import os
import sys
import tomllib
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from prime_rl.configs.base import ENV_PREFIX, C


class ConfigError(Exception):
    """A problem with the user's config; `lines` are shown one per line."""

    def __init__(self, lines: list[str]):
        super().__init__("\n".join(lines))
        self.lines = lines


# ---------------------------------------------------------------------------------------------
# Type introspection


def _unwrap(annotation: Any) -> Any:
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


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _is_list(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (list, tuple, Sequence)


def _dealias(cls: type[BaseModel], path: list[str]) -> list[str]:
    """`path` with flag aliases replaced: a config class may map extra flag names to dotted field paths in a
    `flag_aliases` class variable (e.g. vLLM's `tensor_parallel_size` -> `parallel.tp`), at any depth."""
    out: list[str] = []
    model: Any = cls
    for part in path:
        aliases = getattr(model, "flag_aliases", {}) if _is_model(model) else {}
        out += aliases[part].split(".") if part in aliases else [part]
        model = _field(cls, out)
    return out


def _field(cls: type[BaseModel], path: list[str]) -> Any | None:
    """The unwrapped annotation of the field at `path`, or None if there is no such field."""
    annotation: Any = cls
    for part in path:
        if _is_list(annotation) and _is_model(_item(annotation)):
            annotation = _item(annotation)  # `--env.id x` addresses a list of tables written as one table
        if not _is_model(annotation) or part not in annotation.model_fields:
            return None
        annotation = _unwrap(annotation.model_fields[part].annotation)
    return annotation


def _item(annotation: Any) -> Any:
    args = typing.get_args(annotation)
    return _unwrap(args[0]) if args else None


# ---------------------------------------------------------------------------------------------
# Sources


def _load_toml(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError([f"config file not found: {path}"])
    try:
        with open(p, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError([f"{path}: invalid TOML: {e}"]) from None
    except UnicodeDecodeError as e:
        raise ConfigError([f"{path}: not UTF-8 text (TOML is UTF-8): byte {e.start}"]) from None


def _set(tree: dict, path: list[str], value: Any, sources: dict, source: str, append: bool = False) -> None:
    node = tree
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    if append and isinstance(node.get(path[-1]), list):
        node[path[-1]].extend(value)
    else:
        node[path[-1]] = value
    sources[tuple(path)] = source


def deep_merge(base: dict, top: dict) -> dict:
    """`top` over `base`, recursively; neither input is modified."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _record_sources(tree: dict, source: str, sources: dict, prefix: tuple = ()) -> None:
    for key, value in tree.items():
        sources[prefix + (key,)] = source
        if isinstance(value, dict):
            _record_sources(value, source, sources, prefix + (key,))


def _nest(path: list[str], tree: dict) -> dict:
    for part in reversed(path):
        tree = {part: tree}
    return tree


def parse_args(cls: type[BaseModel], argv: Sequence[str]) -> tuple[dict, dict, list[str]]:
    """Turn argv into one merged settings dict (TOML layers, then CLI), a map key-path -> source, and
    the problems found on the way (unknown flags, missing values)."""
    layers: list[tuple[str, dict]] = []
    cli: dict = {}
    sources: dict = {}
    errors: list[str] = []
    seen_lists: set[tuple] = set()
    argv = list(argv)
    i = 0

    def next_is_value() -> bool:
        return i + 1 < len(argv) and not argv[i + 1].startswith("--") and argv[i + 1] != "@"

    while i < len(argv):
        tok = argv[i]
        if tok == "@" or (tok.startswith("@") and len(tok) > 1):
            path = tok[1:] or (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if tok != "@" else 2
            if not path:
                errors.append("'@' must be followed by a TOML file path")
                continue
            layers.append((path, _load_toml(path)))
            continue
        if not tok.startswith("--") or len(tok) == 2:
            errors.append(f"unexpected argument {tok!r} (options look like --key value, files like @ config.toml)")
            i += 1
            continue
        key, eq, inline = tok[2:].partition("=")
        path = _dealias(cls, key.replace("-", "_").split("."))
        annotation = _field(cls, path)
        negated = False
        if annotation is None and path[-1].startswith("no_"):
            alt = path[:-1] + [path[-1][3:]]
            if _field(cls, alt) is bool:
                path, annotation, negated = alt, bool, True
        if annotation is None and path[0].startswith("no_") and len(path) > 1:
            alt = [path[0][3:]] + path[1:]
            if _field(cls, alt) is bool:
                path, annotation, negated = alt, bool, True
        if annotation is None:
            errors.append(f"unknown option --{key} (flag); see --help")
            i += 1 + (not eq and next_is_value())
            continue
        source = f"flag --{key}"
        if _is_model(annotation) and not eq and i + 1 < len(argv) and argv[i + 1] == "@":
            # `--trainer @ t.toml`: a file for one sub-config.
            if i + 2 >= len(argv):
                errors.append(f"--{key} @ must be followed by a TOML file path")
                break
            file = argv[i + 2]
            layers.append((file, _nest(path, _load_toml(file))))
            i += 3
            continue
        if annotation is bool:
            if negated:
                value: Any = False
            elif eq:
                value = inline
            elif next_is_value() and argv[i + 1].lower() in ("true", "false", "1", "0"):
                i += 1
                value = argv[i]
            else:
                value = True
            _set(cli, path, value, sources, source)
            i += 1
            continue
        if _is_model(annotation) and not eq and not next_is_value():
            # `--ckpt`: switch an optional sub-config on with its defaults, keeping what earlier flags set in it.
            current = functools.reduce(lambda node, part: node.get(part) if isinstance(node, dict) else None, path, cli)
            _set(cli, path, current if isinstance(current, dict) else {}, sources, source)
            i += 1
            continue
        if eq:
            raw = inline
        elif next_is_value():
            i += 1
            raw = argv[i]
        else:
            errors.append(f"option --{key} expects a value")
            i += 1
            continue
        if _is_list(annotation):
            items = [x for x in raw.split(",") if x != ""]
            _set(cli, path, items, sources, source, append=tuple(path) in seen_lists)
            seen_lists.add(tuple(path))
        else:
            _set(cli, path, raw, sources, source)
        i += 1

    merged: dict = {}
    file_sources: dict = {}
    for name, layer in layers:
        merged = deep_merge(merged, layer)
        _record_sources(layer, name, file_sources)
    file_sources.update(sources)
    return deep_merge(merged, cli), file_sources, errors


def _source_of(loc: tuple, sources: dict, cls: type[BaseModel]) -> str:
    for n in range(len(loc), 0, -1):
        if loc[:n] in sources:
            return sources[loc[:n]]
    for n in range(len(loc), 0, -1):
        env = ENV_PREFIX + "__".join(loc[:n]).upper()
        if env in os.environ:
            return f"env {env}"
    return "default"


def format_validation_error(err: ValidationError, sources: dict, cls: type[BaseModel]) -> list[str]:
    lines = []
    for e in err.errors():
        loc = tuple(str(p) for p in e["loc"] if not isinstance(p, int))
        msg = e["msg"].removeprefix("Value error, ")
        if not loc:
            lines.append(msg)
            continue
        key = ".".join(loc)
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif e["type"] == "missing":
            msg = "required but not set"
        elif "input" in e and not isinstance(e["input"], dict):
            msg = f"{msg} (got {e['input']!r})"
        lines.append(f"{key}: {msg} [{_source_of(loc, sources, cls)}]")
    return lines


def load_config(cls: type[C], argv: Sequence[str]) -> C:
    """Build `cls` from argv and the environment; raises ConfigError with readable lines."""
    values, sources, errors = parse_args(cls, argv)
    prepare = getattr(cls, "prepare_args", None)
    if prepare is not None:
        values = prepare(values, sources)
    try:
        config = cls(**values)
    except ValidationError as err:
        raise ConfigError(errors + format_validation_error(err, sources, cls)) from None
    if errors:
        raise ConfigError(errors)
    return config


# ---------------------------------------------------------------------------------------------
# Help and entrypoint helper


def help_text(cls: type[BaseModel], prog: str) -> str:
    lines = [f"usage: {prog} [@ config.toml ...] [--key value ...]", ""]
    if cls.__doc__:
        lines += [cls.__doc__.strip(), ""]
    lines.append(f"Precedence: flags > TOML (last file wins) > env {ENV_PREFIX}A__B_C > default.")
    lines.append("")

    def walk(model: type[BaseModel], prefix: str) -> None:
        for alias, target in getattr(model, "flag_aliases", {}).items():
            lines.append(f"  --{prefix}{alias.replace('_', '-')} VALUE  same as --{prefix}{target.replace('_', '-')}")
        fields = model.model_fields.items()
        sections = [(n, f) for n, f in fields if _is_model(_unwrap(f.annotation))]
        for name, field in fields:  # a section's own flags first, so none reads as part of a sub-section
            annotation = _unwrap(field.annotation)
            if _is_model(annotation):
                continue
            flag = prefix + name.replace("_", "-")
            default = field.default_factory() if field.default_factory is not None else field.default
            default = str(default) if isinstance(default, Path) else default
            kind = "--" + flag if annotation is bool else f"--{flag} VALUE"
            lines.append(f"  {kind}  {field.description or ''} (default: {default!r})")
        for name, field in sections:
            flag = prefix + name.replace("_", "-")
            extra = f" (off unless --{flag} is given)" if field.default is None else ""
            lines.append(f"[{flag}] {field.description or ''}{extra}")
            walk(_unwrap(field.annotation), flag + ".")

    walk(cls, "")
    return "\n".join(lines)


def parse_config(cls: type[C], argv: Sequence[str] | None = None, prog: str | None = None) -> C:
    """Entry-point helper: `--help` prints every field; a bad config exits 2 with one line per problem."""
    argv = sys.argv[1:] if argv is None else list(argv)
    prog = prog or Path(sys.argv[0]).name
    if "-h" in argv or "--help" in argv:
        try:
            print(help_text(cls, prog), flush=True)
        except BrokenPipeError:  # `--help | head`
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(0)
    try:
        return load_config(cls, argv)
    except ConfigError as err:
        for line in err.lines:
            print(f"{prog}: config error: {line}", file=sys.stderr)
        raise SystemExit(2) from None


SECRET_FIELDS = frozenset({"api_key"})  # never written to disk: `api_key_var` (the env var's name) is


def to_toml_dict(config: BaseModel) -> dict:
    """The config as TOML-ready data (TOML has no null, so unset optionals are left out), without secrets."""

    def public(tree: dict) -> dict:
        return {k: public(v) if isinstance(v, dict) else v for k, v in tree.items() if k not in SECRET_FIELDS}

    return public(config.model_dump(mode="json", exclude_none=True))


# ---------------------------------------------------------------------------------------------
