"""The command line of every entrypoint: flags and `@ file.toml` layers into one validated config (docs/design.md §1).

Sources, highest precedence first: CLI flags > TOML files (`@ a.toml @ b.toml`, later wins) >
`PRIME_A__B_C` env vars > field defaults. Flags are nested and kebab-cased (`--optim.max-norm 1.0`);
booleans take `--flag` / `--no-flag`; lists take `--ids 1,2,3` or a repeated flag; a sub-config can
be filled from its own file (`--trainer @ t.toml`) or switched on with its defaults (`--ckpt`), and one whose
model declares a `shorthand` field takes a bare value for it (`--weight-transfer broadcast`, in TOML too).

A bad config never raises a traceback: `parse_config` prints one line per problem, naming the key and
where its value came from (a mistyped key gets `(did you mean --optim.max-norm?)`), and exits with status 2.
This module imports no torch.

Why not pydantic-settings' `CliSettingsSource` / `CliApp` (checked at 2.16.3): it has kebab flags, `--no-flag`
(`cli_implicit_flags`), comma lists and a bare `--section`, but it is argparse underneath, so `@ a.toml` and
`--trainer @ t.toml` are "unrecognized arguments" (its parser sets no `fromfile_prefix_chars`, which would read
argv lines anyway, not TOML); it yields one merged dict with no record of which flag, file or env var set each
key, so errors cannot name the source; and an unknown flag aborts with one argparse message before validation.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_settings import SettingsError

from prime_rl.configs.base import ENV_PREFIX, C, FieldError
from prime_rl.configs.fields import (
    dealias,
    did_you_mean,
    env_json_kind,
    expand_shorthands,
    field_type,
    is_list,
    is_model,
    negated,
    shorthand,
    unwrap,
)


class ConfigError(Exception):
    """A problem with the user's config; `lines` are shown one per line."""

    def __init__(self, lines: list[str]):
        super().__init__("\n".join(lines))
        self.lines = lines


# ---------------------------------------------------------------------------------------------
# Sources

# No config is nested more than a few levels (rl.orchestrator.env.args.<value>); a deeper value is a mistake,
# and it would overflow Python's recursion in the parser or in validation (a traceback) long before it means much.
MAX_DEPTH = 32


def _depth(value: Any) -> int:
    """How many tables and arrays deep `value` is (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def _load_toml(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError([f"config file not found: {path}"])
    try:
        with open(p, "rb") as f:
            tree = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError([f"{path}: invalid TOML: {e}"]) from None
    except UnicodeDecodeError as e:
        raise ConfigError([f"{path}: not UTF-8 text (TOML is UTF-8): byte {e.start}"]) from None
    except RecursionError:
        raise ConfigError([f"{path}: nested too deeply (more than {MAX_DEPTH} tables or arrays)"]) from None
    if _depth(tree) > MAX_DEPTH:
        raise ConfigError([f"{path}: nested too deeply (more than {MAX_DEPTH} tables or arrays)"])
    return tree


def _env_errors(cls: type[BaseModel]) -> list[str]:
    """One line per `PRIME_*` env var that pydantic-settings would read as JSON (a list or table field) and
    cannot: it raises a SettingsError naming only the top-level field, with a traceback."""
    lines = []
    for name, value in sorted(os.environ.items()):
        if not name.startswith(ENV_PREFIX):
            continue
        path = name[len(ENV_PREFIX) :].lower().split("__")
        kind = env_json_kind(cls, path)
        if kind is None:
            continue
        example = '\'["a", "b"]\'' if kind == "a list" else "'{\"key\": 1}'"
        try:
            too_deep = _depth(json.loads(value)) > MAX_DEPTH
        except RecursionError:
            too_deep = True
        except ValueError:
            shown = value if len(value) <= 80 else value[:77] + "..."
            lines.append(f"{'.'.join(path)}: not valid JSON ({kind} in an env var is JSON, e.g. {example}) "
                         f"(got {shown!r}) [env {name}]")  # fmt: skip
            continue
        if too_deep:
            lines.append(f"{'.'.join(path)}: nested too deeply (more than {MAX_DEPTH} levels) [env {name}]")
    return lines


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


@dataclass
class _Flag:
    """One `--key` / `--key=value` token, resolved against the config class."""

    key: str  # as typed, without the leading dashes
    inline: str | None  # the text after `=`; None when there is no `=`
    path: list[str]  # field path, aliases resolved
    annotation: Any  # the field's unwrapped type; None when there is no such field
    negated: bool = False  # `--no-x` for bool field x

    @property
    def source(self) -> str:
        return f"flag --{self.key}"


def _resolve_flag(cls: type[BaseModel], tok: str) -> _Flag:
    key, eq, inline = tok[2:].partition("=")
    path = dealias(cls, key.replace("-", "_").split("."))
    annotation = field_type(cls, path)
    if annotation is None and (bool_path := negated(cls, path)) is not None:
        return _Flag(key, inline if eq else None, bool_path, bool, negated=True)
    return _Flag(key, inline if eq else None, path, annotation)


class _ArgvParser:
    """One left-to-right pass over argv: each handler consumes its tokens and records values, TOML layers
    and problems. `parse_args` dispatches on the token; `option` on what the flag names."""

    def __init__(self, cls: type[BaseModel], argv: Sequence[str]):
        self.cls = cls
        self.argv = list(argv)
        self.i = 0
        self.layers: list[tuple[str, dict]] = []  # (file, its tree), in argv order
        self.cli: dict = {}
        self.sources: dict = {}  # key path -> "flag --x"
        self.errors: list[str] = []
        self.seen_lists: set[tuple] = set()

    def peek(self, ahead: int = 0) -> str | None:
        j = self.i + ahead
        return self.argv[j] if j < len(self.argv) else None

    def next_is_value(self) -> bool:
        nxt = self.peek(1)
        return nxt is not None and not nxt.startswith("--") and nxt != "@"

    def file(self, tok: str) -> None:
        """`@ a.toml` or `@a.toml`: a TOML layer over the whole config."""
        path = tok[1:] or (self.peek(1) or "")
        self.i += 1 if tok != "@" else 2
        if not path:
            self.errors.append("'@' must be followed by a TOML file path")
            return
        self.layers.append((path, expand_shorthands(self.cls, _load_toml(path))))

    def stray(self, tok: str) -> None:
        self.errors.append(f"unexpected argument {tok!r} (options look like --key value, files like @ config.toml)")
        self.i += 1

    def option(self, tok: str) -> None:
        flag = _resolve_flag(self.cls, tok)
        bare = flag.inline is None
        if flag.annotation is None:
            self.unknown(flag)
        elif is_model(flag.annotation) and bare and self.peek(1) == "@":
            self.section_file(flag)
        elif flag.annotation is bool:
            self.boolean(flag)
        elif is_model(flag.annotation) and bare and not self.next_is_value():
            self.switch_on(flag)
        else:
            self.value(flag)

    def unknown(self, flag: _Flag) -> None:
        hint = did_you_mean(self.cls, flag.path, as_flag=True)
        self.errors.append(f"unknown option --{flag.key} (flag); see --help{hint}")
        self.i += 1 + (flag.inline is None and self.next_is_value())

    def section_file(self, flag: _Flag) -> None:
        """`--trainer @ t.toml`: a file for one sub-config."""
        file = self.peek(2)
        if file is None:
            self.errors.append(f"--{flag.key} @ must be followed by a TOML file path")
            self.i = len(self.argv)
            return
        self.layers.append((file, expand_shorthands(self.cls, _nest(flag.path, _load_toml(file)))))
        self.i += 3

    def boolean(self, flag: _Flag) -> None:
        """`--x`, `--no-x`, `--x=false`, `--x true`."""
        nxt = self.peek(1)
        if flag.negated:
            value: Any = False
        elif flag.inline is not None:
            value = flag.inline
        elif self.next_is_value() and nxt is not None and nxt.lower() in ("true", "false", "1", "0"):
            self.i += 1
            value = nxt
        else:
            value = True
        _set(self.cli, flag.path, value, self.sources, flag.source)
        self.i += 1

    def switch_on(self, flag: _Flag) -> None:
        """`--ckpt`: switch an optional sub-config on with its defaults, keeping what earlier flags set in it."""
        current = functools.reduce(
            lambda node, part: node.get(part) if isinstance(node, dict) else None, flag.path, self.cli
        )
        _set(self.cli, flag.path, current if isinstance(current, dict) else {}, self.sources, flag.source)
        self.i += 1

    def value(self, flag: _Flag) -> None:
        """`--key value` / `--key=value`; a list takes `a,b,c` and appends on a repeated flag; a section with a
        shorthand field sets that field (`--weight-transfer broadcast` = `--weight-transfer.type broadcast`)."""
        if flag.inline is not None:
            raw = flag.inline
        elif self.next_is_value():
            self.i += 1
            raw = self.argv[self.i]
        else:
            self.errors.append(f"option --{flag.key} expects a value")
            self.i += 1
            return
        if is_list(flag.annotation):
            items = [x for x in raw.split(",") if x != ""]
            key = tuple(flag.path)
            _set(self.cli, flag.path, items, self.sources, flag.source, append=key in self.seen_lists)
            self.seen_lists.add(key)
        elif (field := shorthand(flag.annotation)) is not None:
            _set(self.cli, [*flag.path, field], raw, self.sources, flag.source)
        else:
            _set(self.cli, flag.path, raw, self.sources, flag.source)
        self.i += 1

    def result(self) -> tuple[dict, dict, list[str]]:
        """The TOML layers merged in order, the flags over them, and every key's source."""
        merged: dict = {}
        file_sources: dict = {}
        for name, layer in self.layers:
            merged = deep_merge(merged, layer)
            _record_sources(layer, name, file_sources)
        file_sources.update(self.sources)
        return deep_merge(merged, self.cli), file_sources, self.errors


def parse_args(cls: type[BaseModel], argv: Sequence[str]) -> tuple[dict, dict, list[str]]:
    """Turn argv into one merged settings dict (TOML layers, then CLI), a map key-path -> source, and
    the problems found on the way (unknown flags, missing values)."""
    parser = _ArgvParser(cls, argv)
    while (tok := parser.peek()) is not None:
        if tok.startswith("@"):
            parser.file(tok)
        elif not tok.startswith("--") or len(tok) == 2:
            parser.stray(tok)
        else:
            parser.option(tok)
    return parser.result()


def _env_var(loc: tuple) -> str | None:
    name = ENV_PREFIX + "__".join(loc).upper()
    return name if name in os.environ else None


def _source_of(loc: tuple, sources: dict, cls: type[BaseModel], exact: bool = False) -> tuple[tuple, str]:
    """Where the value at `loc` came from, and the key it was given under: `loc` itself, or, for a value a
    class copies between keys (`rl`'s shared keys, `shared_copies`), the key the user set. A file or flag beats
    an env var for the same key, a more specific key beats a table that holds it; `exact`: no tables."""
    copies = getattr(cls, "shared_copies", lambda loc: [])(loc)
    for key in (loc, *copies):
        if key in sources:
            return key, sources[key]
    for key in (loc, *copies):
        if env := _env_var(key):
            return key, f"env {env}"
    for n in range(len(loc) - 1, 0, -1) if not exact else ():
        if loc[:n] in sources:
            return loc, sources[loc[:n]]
        if env := _env_var(loc[:n]):
            return loc, f"env {env}"
    return loc, "default"


def _field_error_line(model_loc: tuple, error: FieldError, sources: dict, cls: type[BaseModel]) -> str:
    """`key: message [its source; other.key: its source]` for a failed cross-field check."""

    def at(key: str) -> tuple:
        return model_loc + tuple(key.split("."))

    loc, source = _source_of(at(error.key), sources, cls, exact=True)
    others = [f"{'.'.join(at(k))}: {_source_of(at(k), sources, cls, exact=True)[1]}" for k in error.also]
    return f"{'.'.join(loc)}: {error} [{'; '.join([source, *others])}]"


def format_validation_error(err: ValidationError, sources: dict, cls: type[BaseModel]) -> list[str]:
    lines: list[str] = []
    for e in err.errors():
        loc = tuple(str(p) for p in e["loc"] if not isinstance(p, int))
        msg = e["msg"].removeprefix("Value error, ")
        if isinstance(error := e.get("ctx", {}).get("error"), FieldError):
            line = _field_error_line(loc, error, sources, cls)
        elif not loc:
            line = msg
        else:
            loc, source = _source_of(loc, sources, cls)
            hint = ""
            if e["type"] == "extra_forbidden":
                msg = "unknown key"
                hint = did_you_mean(cls, list(loc), as_flag=source.startswith("flag "))
            elif e["type"] == "missing":
                msg = "too few items" if isinstance(e["loc"][-1], int) else "required but not set"
            elif "input" in e and not isinstance(e["input"], dict):
                msg = f"{msg} (got {e['input']!r})"
            line = f"{'.'.join(loc)}: {msg} [{source}]{hint}"
        if line not in lines:  # a shared key of `rl` fails once, not once per service it was copied to
            lines.append(line)
    return lines


def load_config(cls: type[C], argv: Sequence[str]) -> C:
    """Build `cls` from argv and the environment; raises ConfigError with readable lines."""
    values, sources, errors = parse_args(cls, argv)
    if env_errors := _env_errors(cls):
        raise ConfigError(errors + env_errors)
    prepare = getattr(cls, "prepare_args", None)
    if prepare is not None:
        values = prepare(values, sources)
    try:
        config = cls(**values)
    except ValidationError as err:
        raise ConfigError(errors + format_validation_error(err, sources, cls)) from None
    except SettingsError as err:  # an env var `_env_errors` did not foresee: still one line, no traceback
        raise ConfigError([*errors, f"environment: {err}"]) from None
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
        sections = [(n, f) for n, f in fields if is_model(unwrap(f.annotation))]
        for name, field in fields:  # a section's own flags first, so none reads as part of a sub-section
            annotation = unwrap(field.annotation)
            if is_model(annotation):
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
            if (short := shorthand(unwrap(field.annotation))) is not None:
                lines.append(f"  --{flag} VALUE  same as --{flag}.{short.replace('_', '-')}")
            walk(unwrap(field.annotation), flag + ".")

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
