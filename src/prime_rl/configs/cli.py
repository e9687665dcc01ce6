"""The command line of every entrypoint: flags and `@ file.toml` layers into one validated config (docs/design.md §1).

Sources, highest precedence first: CLI flags > TOML files (`@ a.toml @ b.toml`, later wins) >
`PRIME_A__B_C` env vars > field defaults. Flags are nested and kebab-cased (`--optim.max-norm 1.0`);
booleans take `--flag` / `--no-flag`; lists take `--ids 1,2,3` or a repeated flag; a sub-config can
be filled from its own file (`--trainer @ t.toml`) or switched on with its defaults (`--ckpt`), and one whose
model declares a `shorthand` field takes a bare value for it (`--weight-transfer broadcast`, in TOML too).

A bad config never raises a traceback: `parse_config` prints one line per problem, naming the key and
where its value came from (a mistyped key gets `(did you mean --optim.max-norm?)`), and exits with status 2.
Reading argv is `configs/argv.py`'s; this module validates, words the errors and writes `--help`. It imports no
torch.

Why not pydantic-settings' `CliSettingsSource` / `CliApp` (checked at 2.16.3): it has kebab flags, `--no-flag`
(`cli_implicit_flags`), comma lists and a bare `--section`, but it is argparse underneath, so `@ a.toml` and
`--trainer @ t.toml` are "unrecognized arguments" (its parser sets no `fromfile_prefix_chars`, which would read
argv lines anyway, not TOML); it yields one merged dict with no record of which flag, file or env var set each
key, so errors cannot name the source; and an unknown flag aborts with one argparse message before validation.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import SettingsError

from prime_rl.configs.argv import MAX_DEPTH, _depth, deep_merge, parse_args
from prime_rl.configs.base import ENV_PREFIX, OUTPUT_DIR_VAR, C, ConfigError, FieldError, default_output_dir
from prime_rl.configs.fields import did_you_mean, env_json_kind, field_info, flag_table, is_model, shorthand, unwrap
from prime_rl.configs.shared import CHECK_MODEL_PATHS, ShowsValue

INT64_MAX = 2**63 - 1
HELP_WIDTH = 120  # the house line length: a terminal's width, not a paragraph

__all__ = ["ConfigError", "deep_merge", "format_validation_error", "help_text", "load_config", "parse_args",
           "parse_config"]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Sources


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
    if loc[-1:] == ("output_dir",) and os.environ.get("OUTPUT_DIR"):  # the services' default reads it
        return min((loc, *copies), key=len), "env OUTPUT_DIR"  # `rl`: once, as its shared key
    return loc, "default"


def _field_error_line(model_loc: tuple, error: FieldError, sources: dict, cls: type[BaseModel]) -> str:
    """`key: message [its source; other.key: its source]` for a failed cross-field check."""

    def at(key: str) -> tuple:
        return model_loc + tuple(key.split("."))

    loc, source = _source_of(at(error.key), sources, cls, exact=True)
    others = [f"{'.'.join(at(k))}: {_source_of(at(k), sources, cls, exact=True)[1]}" for k in error.also]
    return f"{'.'.join(loc)}: {error} [{'; '.join([source, *others])}]"


def _union_member(cls: type[BaseModel], loc: tuple) -> int | None:
    """Where pydantic's `loc` goes past a field into the members of its union type (`resume_step.int`,
    `resume_step.literal['latest']`): the length of the field's own key, else None."""
    for n in range(1, len(loc)):
        info = field_info(cls, list(loc[:n]))
        if info is None:
            return None
        annotation = unwrap(info.annotation)
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):
            return n
    return None


def _merge_union_errors(errors: list[dict], cls: type[BaseModel]) -> list[dict]:
    """One error per value a union field refused, not one per member type: `int | Literal['latest']` given
    'banana' is "Input should be a valid integer or 'latest'", once."""
    merged: list[dict] = []
    at: dict[tuple, dict] = {}
    for e in errors:
        loc = tuple(str(p) for p in e["loc"] if not isinstance(p, int))
        n = _union_member(cls, loc)
        if n is None:
            merged.append(e)
            continue
        # "Input should be a valid integer, unable to parse string as an integer" -> "a valid integer"
        wants = e["msg"].removeprefix("Value error, ").removeprefix("Input should be ").split(", ")[0]
        if loc[:n] in at:
            at[loc[:n]]["wants"].append(wants)
        else:
            at[loc[:n]] = {**e, "loc": loc[:n], "wants": [wants]}
            merged.append(at[loc[:n]])
    for e in at.values():
        e["msg"] = "Input should be " + " or ".join(dict.fromkeys(e.pop("wants")))
    return merged


def format_validation_error(err: ValidationError, sources: dict, cls: type[BaseModel]) -> list[str]:
    lines: list[str] = []
    for e in _merge_union_errors(err.errors(), cls):
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
            elif "input" in e and not isinstance(e["input"], dict) and not isinstance(error, ShowsValue):
                shown = str(e["input"]) if isinstance(e["input"], Path) else e["input"]  # a default's Path
                msg = f"{msg} (got {shown!r})"
            line = f"{'.'.join(loc)}: {msg} [{source}]{hint}"
        if line not in lines:  # a shared key of `rl` fails once, not once per service it was copied to
            lines.append(line)
    return lines


def _takes_output_dir_var(cls: type[BaseModel]) -> bool:
    """The RL services (and `rl`, which shares theirs): their output_dir defaults to $OUTPUT_DIR."""
    fields = cls.model_fields
    subs = [unwrap(f.annotation) for f in fields.values() if is_model(unwrap(f.annotation))]
    return "output_dir" in fields and any(
        (info := getattr(model, "model_fields", {}).get("output_dir")) is not None
        and info.default_factory is default_output_dir
        for model in (cls, *subs)
    )


def _output_dir_from_env(cls: type[BaseModel], values: dict, sources: dict) -> list[str]:
    """`$OUTPUT_DIR` over the output_dir a TOML file sets, below a flag's: `--output-dir` > $OUTPUT_DIR > TOML >
    `outputs`. The variable says where this node's shared directory is (every node of a multi-node run exports
    it), the file what the experiment is: the shipped debug configs set `outputs/debug`, which won without a word
    and put each node's files on its own disk. Returns one note per file value replaced."""
    env = os.environ.get(OUTPUT_DIR_VAR)
    if not env or not _takes_output_dir_var(cls):
        return []
    notes, flagged = [], False
    for loc, source in list(sources.items()):
        if loc[-1] != "output_dir":
            continue
        if str(source).startswith("flag"):
            flagged = True
            continue
        parent = values
        for part in loc[:-1]:
            parent = parent.get(part) if isinstance(parent, dict) else None
        if isinstance(parent, dict) and "output_dir" in parent:
            if str(parent["output_dir"]) != env:
                notes.append(f"{'.'.join(loc)}: ${OUTPUT_DIR_VAR} ({env}) over {source}'s {parent['output_dir']}")
            del parent["output_dir"], sources[loc]
    if not flagged:
        values["output_dir"], sources[("output_dir",)] = env, f"env {OUTPUT_DIR_VAR}"
    return notes


def load_config(cls: type[C], argv: Sequence[str], check_paths: bool = False, notes: list[str] | None = None) -> C:
    """Build `cls` from argv and the environment; raises ConfigError with readable lines. `check_paths`: a local
    model path must exist now (the command runs here), unless the config submits to Slurm (its job checks).
    `notes`: gets a line per value the environment put over a file's (`_output_dir_from_env`)."""
    values, sources, errors = parse_args(cls, argv)
    said = _output_dir_from_env(cls, values, sources)
    if notes is not None:
        notes += said
    if env_errors := _env_errors(cls):
        raise ConfigError(errors + env_errors)
    prepare = getattr(cls, "prepare_args", None)
    if prepare is not None:
        values = prepare(values, sources)
    submits = values.get("slurm") is not None or any(k.startswith(f"{ENV_PREFIX}SLURM") for k in os.environ)
    token = CHECK_MODEL_PATHS.set(check_paths and not submits)
    try:
        config = cls(**values)
    except ValidationError as err:
        raise ConfigError(errors + format_validation_error(err, sources, cls)) from None
    except SettingsError as err:  # an env var `_env_errors` did not foresee: still one line, no traceback
        raise ConfigError([*errors, f"environment: {err}"]) from None
    finally:
        CHECK_MODEL_PATHS.reset(token)
    for loc, value in _too_large(config, ()):
        key, source = _source_of(loc, sources, cls)  # a shared key of `rl`: once, under the key the user set
        line = f"{'.'.join(key)}: {value} is too large (at most 2**63 - 1) [{source}]"
        if line not in errors:
            errors.append(line)
    if errors:
        raise ConfigError(errors)
    return config


def _too_large(model: BaseModel, loc: tuple) -> list[tuple[tuple, int]]:
    """Integers past int64 (`--async-level 99999999999999999999`): Python takes them, torch and the step
    records would not."""
    found = []
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            found += _too_large(value, (*loc, name))
        elif isinstance(value, list | tuple):
            for item in value:
                if isinstance(item, BaseModel):
                    found += _too_large(item, (*loc, name))
                elif isinstance(item, int) and abs(item) > INT64_MAX:
                    found.append(((*loc, name), item))
        elif isinstance(value, int) and abs(value) > INT64_MAX:
            found.append(((*loc, name), value))
    return found


# ---------------------------------------------------------------------------------------------
# Help and entrypoint helper


def help_text(cls: type[BaseModel], prog: str) -> str:
    lines = [f"usage: {prog} [@ config.toml ...] [--key value ...]", ""]
    if cls.__doc__:
        lines += [cls.__doc__.strip(), ""]
    lines.append(f"Precedence: flags > TOML (last file wins) > env {ENV_PREFIX}A__B_C > default.")
    if _takes_output_dir_var(cls):
        lines.append(f"output_dir: --output-dir > env {OUTPUT_DIR_VAR} > TOML > outputs.")
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
            kind = "--" + flag if annotation is bool else f"--{flag} VALUE"
            if flag_table(field) is not None:  # one flag per entry; the table in TOML is [flag]
                kind = f"--{flag}.KEY VALUE"
            default = _help_default(cls, (*flag.replace("-", "_").split(".")[:-1], name), field)
            lines.append(f"  {kind}  {field.description or ''}{default}")
        for name, field in sections:
            flag = prefix + name.replace("_", "-")
            extra = f" (off unless --{flag} is given)" if _off_by_default(cls, (*prefix.split(".")[:-1], name)) else ""
            lines.append(f"[{flag}] {field.description or ''}{extra}")
            if (short := shorthand(unwrap(field.annotation))) is not None:
                lines.append(f"  --{flag} VALUE  same as --{flag}.{short.replace('_', '-')}")
            walk(unwrap(field.annotation), flag + ".")

    walk(cls, "")
    # One screen line each: a long description wraps under itself (a line ran to 481 characters).
    width = HELP_WIDTH
    wrapped = []
    for line in lines:
        indent = " " * (len(line) - len(line.lstrip()) + 4)
        wrapped += textwrap.wrap(line, width, subsequent_indent=indent, break_on_hyphens=False) or [""]
    return "\n".join(wrapped)


def _off_by_default(cls: type[BaseModel], path: tuple) -> bool:
    """A section left unset is off, unless it is a shared key of `rl` whose services have it on by default
    (`[parity]`: unset in `rl`, each service's own default is on)."""
    info = field_info(cls, list(path))
    if info is None or info.default is not None or info.default_factory is not None:
        return False
    copies = getattr(cls, "shared_copies", lambda loc: [])(path)
    return all(_default(c) is None for copy in copies if (c := field_info(cls, list(copy))) is not None)


def _default(field: FieldInfo) -> Any:
    default = field.default_factory() if field.default_factory is not None else field.default
    return str(default) if isinstance(default, Path) else default


def _help_default(cls: type[BaseModel], path: tuple, field: FieldInfo) -> str:
    """` (default: X)`. An unset key of `rl` that the services share takes their default: that one is shown, and
    where from; an unset key whose description says what unset means shows nothing more."""
    default = _default(field)
    if default is not None:
        return f" (default: {default!r})"
    copies = getattr(cls, "shared_copies", lambda loc: [])(path)
    taken = {copy[0]: _default(info) for copy in copies if (info := field_info(cls, list(copy))) is not None}
    if taken and len({repr(v) for v in taken.values()}) == 1 and (value := next(iter(taken.values()))) is not None:
        return f" (default: {value!r}, from {'/'.join(taken)})"
    if "unset" in (field.description or "") or "default" in (field.description or ""):
        return ""
    return " (default: unset)"


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
    notes: list[str] = []
    try:
        config = load_config(cls, argv, check_paths=True, notes=notes)
    except ConfigError as err:
        for line in err.lines:
            print(f"{prog}: config error: {line}", file=sys.stderr)
        raise SystemExit(2) from None
    for line in notes:
        print(f"{prog}: {line}", file=sys.stderr)
    return config
