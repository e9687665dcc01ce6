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
import os
import sys
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from prime_rl.configs.base import ENV_PREFIX, C
from prime_rl.configs.fields import (
    dealias,
    did_you_mean,
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
        key, source, hint = ".".join(loc), _source_of(loc, sources, cls), ""
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
            hint = did_you_mean(cls, list(loc), as_flag=source.startswith("flag "))
        elif e["type"] == "missing":
            msg = "required but not set"
        elif "input" in e and not isinstance(e["input"], dict):
            msg = f"{msg} (got {e['input']!r})"
        lines.append(f"{key}: {msg} [{source}]{hint}")
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
