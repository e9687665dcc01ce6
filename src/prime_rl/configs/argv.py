"""Argv into config data: `@ file.toml` layers, nested `--a.b-c value` flags, and where each key came from.

`parse_args` is one left-to-right pass (`_ArgvParser`); `configs/cli.py` validates what it returns and words the
errors. A flag may set one entry of a table field marked `FLAG_TABLE` (`--vllm.max-num-batched-tokens 8192`,
`--env-vars.OMP_NUM_THREADS 4`): the key after the table's name is kept as typed. This module imports no torch.
"""

from __future__ import annotations

import functools
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from prime_rl.configs.base import ConfigError
from prime_rl.configs.fields import (
    accepts_bool,
    dealias,
    did_you_mean,
    expand_shorthands,
    field_type,
    is_list,
    is_model,
    negated,
    shorthand,
    table_entry,
)

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
    path: list[str]  # field path, aliases resolved (for a table entry: the table's path + the key as typed)
    annotation: Any  # the field's unwrapped type; None when there is no such field
    negated: bool = False  # `--no-x` for bool field x
    entry: bool = False  # an entry of a FLAG_TABLE field; `annotation` is the table's value type

    @property
    def source(self) -> str:
        return f"flag --{self.key}"


def _resolve_flag(cls: type[BaseModel], tok: str) -> _Flag:
    key, eq, inline = tok[2:].partition("=")
    path = dealias(cls, key.replace("-", "_").split("."))
    annotation = field_type(cls, path)
    if annotation is None and (bool_path := negated(cls, path)) is not None:
        return _Flag(key, inline if eq else None, bool_path, bool, negated=True)
    if annotation is None and (found := table_entry(cls, key.split("."))) is not None:
        return _Flag(key, inline if eq else None, found[0], found[1], entry=True)
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
        elif flag.entry:
            self.entry(flag)
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

    def entry(self, flag: _Flag) -> None:
        """`--vllm.enforce-eager` (true), `--vllm.max-num-seqs 8`, `--vllm.x=false`: one entry of a table. Where the
        table takes booleans, a bare flag is true and `true`/`false` are booleans; any other value is its text."""
        takes_bool = accepts_bool(flag.annotation)
        value: Any
        if flag.inline is not None:
            value = flag.inline
        elif self.next_is_value():
            self.i += 1
            value = self.argv[self.i]
        elif takes_bool:
            value = True
        else:
            self.errors.append(f"option --{flag.key} expects a value")
            self.i += 1
            return
        if takes_bool and isinstance(value, str) and value.lower() in ("true", "false"):
            value = value.lower() == "true"
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
