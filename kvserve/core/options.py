"""One declaration per option: its name (the dataclass field), type (the field's annotation), default,
help and simple validation (a bound or a set of choices), from which the command-line flags, the
dataclass's own checks and the docs table (docs/options.md) are made.

A field declared with `option(...)` carries an `Option` in its metadata. The config dataclasses
(kvserve/config.py), the server's options (kvserve/server/limits.py, serving.py, args.py) and
`EngineArgs` (kvserve/engine/args.py, whose fields copy a config field's declaration with
`Option.of`) declare their fields this way. Stdlib only: the API process and the torch-free layers
use it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from dataclasses import MISSING, Field, dataclass, field, fields, replace

from kvserve.core.errors import InvalidRequestError

_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


@dataclass(frozen=True)
class Option:
    """What one option declares beyond its name, type and default (see the module docstring).

    Bounds: `ge` / `gt` (at least / above), `le` (at most); `choices`: the allowed values. `None` is
    always allowed for an optional field (`int | None`). The rest places the flag: `flag` (default
    `--field-name`), `parse` (the flag's text -> the value; default: the type), `metavar`, `group`
    (the `--help` section), `cli` (False: no flag), `hidden` (a flag that `--help` and the docs do not
    show). `config`: for an `EngineArgs` field, the config field it sets, `(ConfigClass, "name")`;
    `resolved`: its value is resolved (not copied) into that field by `create_engine_config`."""

    help: str = ""
    choices: tuple | None = None
    ge: int | float | None = None
    gt: int | float | None = None
    le: int | float | None = None
    flag: str | None = None
    parse: Callable[[str], object] | None = None
    metavar: str | None = None
    group: str | None = None
    cli: bool = True
    hidden: bool = False
    config: tuple[type, str] | None = None
    resolved: bool = False

    def problem(self, value) -> str | None:
        """Why `value` breaks this option's bound or choices ('must be >= 1, got 0'), else None."""
        if value is None:
            return None
        if self.choices is not None:
            if value not in self.choices:
                return f"must be one of {self.choices}, got {value!r}"
            return None
        # `not value >= bound` also refuses NaN
        if self.ge is not None and self.le is not None:
            if not self.ge <= value <= self.le:
                return f"must be in [{self.ge}, {self.le}], got {value}"
            return None
        if self.gt is not None and self.le is not None:
            if not self.gt < value <= self.le:
                return f"must be in ({self.gt}, {self.le}], got {value}"
            return None
        if self.ge is not None and not value >= self.ge:
            return f"must be >= {self.ge}, got {value}"
        if self.gt is not None and not value > self.gt:
            return f"must be > {self.gt}, got {value}"
        if self.le is not None and not value <= self.le:
            return f"must be <= {self.le}, got {value}"
        return None

    @staticmethod
    def of(config_class: type, name: str, **changes) -> Field:
        """A field that is the option `config_class.name` (its default, help, bound and choices, with
        `changes`), and sets that config field (`config`)."""
        source = declared_field(config_class, name)
        resolved = changes.pop("resolved", False) or "default" in changes
        default = changes.pop("default", source.default)
        spec = replace(option_of(source), config=(config_class, name), resolved=resolved, **changes)
        return field(default=default, metadata={"option": spec})


def option(default=MISSING, help: str = "", **spec) -> Field:
    """A dataclass field declared as an option: `max_num_seqs: int = option(64, "...", ge=1)`."""
    return field(default=default, metadata={"option": Option(help=help, **spec)})


def option_of(f: Field) -> Option:
    return f.metadata["option"]


def declared_field(cls: type, name: str) -> Field:
    found = next((f for f in fields(cls) if f.name == name), None)
    if found is None or "option" not in found.metadata:
        raise LookupError(f"{cls.__name__}.{name} is not declared with option()")
    return found


def declared(cls: type) -> Iterator[tuple[Field, Option]]:
    """The fields of `cls` declared with `option()`, in order, with their declarations."""
    for f in fields(cls):
        if "option" in f.metadata:
            yield f, f.metadata["option"]


def value_type(f: Field) -> tuple[type, bool, bool]:
    """(type, optional, repeated) from the field's annotation: `int`, `float | None`,
    `tuple[str, ...]` (a repeatable flag)."""
    text = f.type if isinstance(f.type, str) else f.type.__name__
    parts = [p.strip() for p in text.split("|")]
    optional = "None" in parts
    (name,) = [p for p in parts if p != "None"]
    if name.startswith("tuple[") and name.endswith(", ...]"):
        return _TYPES[name[len("tuple[") : -len(", ...]")]], optional, True
    return _TYPES[name], optional, False


def flag_of(f: Field) -> str:
    return option_of(f).flag or "--" + f.name.replace("_", "-")


def check_options(obj, describe: Callable[[Field], str] | None = None) -> None:
    """Raise `InvalidRequestError` for the first declared field of `obj` that breaks its bound or
    choices, named by `describe(field)` (default: the field's name)."""
    for f, spec in declared(obj.__class__):
        problem = spec.problem(getattr(obj, f.name))
        if problem is not None:
            name = describe(f) if describe else f.name
            raise InvalidRequestError(f"{name} {problem}", f.name)


def check_types(obj, what: str) -> None:
    """Refuse a value of the wrong type for each declared field of the frozen dataclass `obj`
    ("engine option max_num_seqs must be int, got '4'"): a whole number passes for a float, a bool
    passes for nothing but a bool, a tuple field takes a list."""
    for f, _ in declared(obj.__class__):
        value = getattr(obj, f.name)
        kind, optional, repeated = value_type(f)
        if value is None and optional:
            continue
        if repeated and isinstance(value, list):
            object.__setattr__(obj, f.name, value := tuple(value))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            object.__setattr__(obj, f.name, value := float(value))  # 2 means 2.0 s
        items = value if repeated and isinstance(value, tuple) else (value,)
        wrong = repeated and not isinstance(value, tuple)
        # bool is an int in Python: refuse True for a count, and 1 for a switch
        if wrong or any(
            not isinstance(v, kind) or (kind is int and isinstance(v, bool)) for v in items
        ):
            shown = f"tuple of {kind.__name__}" if repeated else kind.__name__
            raise InvalidRequestError(
                f"{what} {f.name} must be {shown}{' or None' if optional else ''}, got {value!r}",
                f.name,
            )


# --- the command line -----------------------------------------------------------------------------


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    groups: dict | None = None,
    *,
    defaults: dict | None = None,
    dest_prefix: str = "",
) -> None:
    """A flag for every declared field of `cls` (but those with `cli=False`), with its help, type,
    default and choices; a field with a `group` goes in that argument group of `parser`.

    `defaults`: a command's own default for some fields, by name, in place of the declared one
    (`kvserve generate`'s greedy temperature). `dest_prefix`: where two classes on one parser
    declare the same name (the engine's `seed` and the sampling `seed`), the attribute of `args`
    is `dest_prefix + name`; `values_from_cli` takes the same prefix."""
    groups = {} if groups is None else groups
    defaults = {} if defaults is None else defaults
    unknown = set(defaults) - {f.name for f, spec in declared(cls) if spec.cli}
    if unknown:
        raise LookupError(f"{cls.__name__} declares no flag {sorted(unknown)}")
    for f, spec in declared(cls):
        if not spec.cli:
            continue
        default = defaults.get(f.name, f.default)
        dest = dest_prefix + f.name
        target = groups.get(spec.group)
        if target is None:
            target = parser
            if spec.group is not None:
                target = groups[spec.group] = parser.add_argument_group(spec.group)
        kind, _, repeated = value_type(f)
        shown = argparse.SUPPRESS if spec.hidden else spec.help
        if kind is bool:
            action = "store_true" if default is False else argparse.BooleanOptionalAction
            target.add_argument(flag_of(f), dest=dest, action=action, default=default, help=shown)
            continue
        metavar = spec.metavar
        if metavar is None and spec.choices is None:
            metavar = flag_of(f)[2:].replace("-", "_").upper()
        target.add_argument(
            flag_of(f),
            dest=dest,
            type=spec.parse or kind,
            default=list(default) if repeated else default,
            action="append" if repeated else "store",
            choices=spec.choices,
            metavar=metavar,
            help=shown,
        )


def values_from_cli(cls: type, args: argparse.Namespace, dest_prefix: str = "") -> dict:
    """The values `add_flags(parser, cls, dest_prefix=...)` parsed into `args`, by field name; a
    value that breaks its bound or choices is an `InvalidRequestError` naming the flag
    ('--max-n must be >= 1, got 0')."""
    values = {}
    for f, spec in declared(cls):
        if not spec.cli:
            continue
        value = getattr(args, dest_prefix + f.name)
        if isinstance(value, list):
            value = tuple(value)
        problem = spec.problem(value)
        if problem is not None:
            raise InvalidRequestError(f"{flag_of(f)} {problem}", f.name)
        values[f.name] = value
    return values


# --- the docs -------------------------------------------------------------------------------------


def markdown_rows(cls: type, group: str | None = None) -> list[str]:
    """One Markdown table row per flag of `cls` in `group`: flag, field name, type (with its bound),
    default, help; hidden flags left out."""
    rows = []
    for f, spec in declared(cls):
        if not spec.cli or spec.hidden or spec.group != group:
            continue
        kind, _, repeated = value_type(f)
        flag = flag_of(f)
        if kind is bool:
            shown_flag = flag if f.default is False else f"{flag}, --no-{flag[2:]}"
            shown_type = "switch"
        else:
            shown_flag = f"{flag} {spec.metavar or flag[2:].replace('-', '_').upper()}"
            shown_type = kind.__name__
            if spec.choices is not None:
                shown_type = "one of " + ", ".join(f"`{c}`" for c in spec.choices)
            shown_type += _bound_text(spec) + (", repeatable" if repeated else "")
        default = "" if f.default in (None, ()) else f"`{f.default}`"
        help_text = spec.help.replace("%%", "%").replace("|", "\\|")
        cells = (f"`{shown_flag}`", f"`{f.name}`", shown_type, default, help_text)
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def _bound_text(spec: Option) -> str:
    if spec.choices is not None:
        return ""
    if spec.ge is not None and spec.le is not None:
        return f", in [{spec.ge}, {spec.le}]"
    if spec.gt is not None and spec.le is not None:
        return f", in ({spec.gt}, {spec.le}]"
    for name, sign in (("ge", ">="), ("gt", ">"), ("le", "<=")):
        if getattr(spec, name) is not None:
            return f", {sign} {getattr(spec, name)}"
    return ""


def groups_of(cls: type) -> list[str | None]:
    """The `group`s of `cls`'s flags, in order of first appearance (None: no group)."""
    return list(dict.fromkeys(spec.group for _, spec in declared(cls) if spec.cli))


def markdown_table(cls: type, group: str | None = None) -> str:
    """`markdown_rows` under a header."""
    header = "| flag | name | type | default | help |\n|---|---|---|---|---|\n"
    return header + "\n".join(markdown_rows(cls, group)) + "\n"
