"""Settings for every layer: a dataclass of sections, loaded from its defaults, then
a TOML file, then `MARIANA_<SECTION>__<KEY>` environment variables, then dotted
overrides (`--set train.epochs=3`). Unknown keys and wrong types are errors that
name the key. The job, cluster and serving configs are all loaded here.

>>> from dataclasses import dataclass, field
>>> @dataclass
... class Train:
...     epochs: int = 1
...     rate: float = 0.1
>>> @dataclass
... class Job:
...     train: Train = field(default_factory=Train)
>>> load_settings(Job, env={"MARIANA_TRAIN__EPOCHS": "3"}, overrides={"train.rate": 0.5})
Job(train=Train(epochs=3, rate=0.5))
>>> load_settings(Job, env={}, overrides={"train.epoch": 2})
Traceback (most recent call last):
...
mariana.sparse.errors.ConfigError: train: unknown key 'train.epoch' (known: epochs, rate) from an override (--set)
"""
# No `from __future__ import annotations`: the doctest's dataclasses would get string
# annotations, which `typing.get_type_hints` resolves in this module, not the doctest.
import dataclasses
import logging
import os
import re
import tomllib
import types
import typing
from typing import Any, Mapping

from mariana.sparse.errors import ConfigError

log = logging.getLogger(__name__)

ENV_PREFIX = "MARIANA_"
INT_LIMIT = 1 << 63  # no integer setting counts past a signed 64-bit one (C, numpy and torch ints overflow)
SHOWN_CHARS = 80     # a value's repr in a message is cut at this length
MAX_THREADS = 1024   # a thread-count setting (a job's, a service's) counts at most this many


def load_settings(cls: type, path: str | os.PathLike | None = None, env: Mapping[str, str] | None = None,
                  overrides: Mapping[str, Any] | None = None, overrides_from: str = "--set") -> Any:
    """Defaults <- TOML file <- environment (default: os.environ) <- overrides ({"train.epochs": 2, ...});
    `overrides_from` says where an unknown override came from (the CLI's `--set`, the API's keywords)."""
    tree: dict = {}
    from_file = read_toml(path) if path else {}
    sections = {f.name for f in dataclasses.fields(cls)}
    from_env = env_overrides(os.environ if env is None else env, sections)
    given: dict = {}
    for dotted, value in (overrides or {}).items():
        _set_dotted(given, dotted, value)
    _refuse_unknown(cls, [(f"in {path}", from_file), ("from the environment", from_env),
                          (f"from an override ({overrides_from})", given)])
    _merge(tree, from_file, cls)
    if path:
        _say_overridden(tree, from_env, path)
    _merge(tree, from_env, cls)
    for dotted, value in (overrides or {}).items():
        _set_dotted(tree, dotted, value)
    try:
        return from_dict(cls, tree)
    except ConfigError as e:
        raise ConfigError(f"{e}{_env_source(str(e), from_env, set(overrides or {}))}") from None


def _env_source(message: str, from_env: dict, overridden: set[str]) -> str:
    """" (from MARIANA_TRAIN__EPOCHS)" when the key a ConfigError names came from the environment
    (and no override replaced it): with a config file and variables both in play, the user could not
    tell which one was wrong (an unknown key named its variable; a bad value did not).

    >>> _env_source("train.epochs must be a number of passes or 'auto', got 'abc'", {"train": {"epochs": "abc"}}, set())
    ' (from MARIANA_TRAIN__EPOCHS)'
    """
    named = [k for k in dotted_items(from_env)
             if k not in overridden and re.search(rf"(^|[^\w.]){re.escape(k)}([^\w.]|$)", message)]
    return f" (from {ENV_PREFIX}{named[0].upper().replace('.', '__')})" if named else ""


def dotted_items(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    """A nested config tree's leaves by dotted key.

    >>> dotted_items({"train": {"epochs": 2, "batch_size": "auto"}, "seed": 1})
    {'train.epochs': 2, 'train.batch_size': 'auto', 'seed': 1}
    """
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(dotted_items(value, f"{prefix}{key}.") if isinstance(value, Mapping) else {f"{prefix}{key}": value})
    return out


def _refuse_unknown(cls: type, sources: list[tuple[str, dict]]) -> None:
    """ConfigError naming every unknown key and where it came from: the file, the variable, the
    override (the first unknown key alone, and not its source, left a user to guess, e.g. at a
    key an older install's client read from a newer cluster's file)."""
    said = []
    for source, tree in sources:
        for dotted, where, known in _unknown(cls, tree):
            by = f"from {ENV_PREFIX}{dotted.upper().replace('.', '__')}" if source == "from the environment" else source
            said.append(f"{where}: unknown key {dotted!r} (known: {', '.join(sorted(known))}) {by}")
    if said:
        raise ConfigError("; ".join(said))


def _unknown(cls: type, data: Any, where: str = "") -> list[tuple[str, str, set]]:
    """(dotted key, its section, the section's keys) for each key of `data` that `cls` has not."""
    if not isinstance(data, Mapping):
        return []  # from_dict says what the type should be
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    out = [(_dotted(where, k), where or "config", names) for k in sorted(set(data) - names, key=str)]
    for k in sorted(set(data) & names):
        if dataclasses.is_dataclass(hints[k]):
            out += _unknown(hints[k], data[k], _dotted(where, k))
    return out


def _say_overridden(tree: dict, from_env: dict, path, where: str = "") -> None:
    """A key the file sets and the environment sets otherwise: the environment wins (the
    documented order), said in the log, since a --config FILE reads as the one that counts."""
    for key, value in from_env.items():
        dotted = _dotted(where, key)
        if isinstance(value, dict) and isinstance(tree.get(key), dict):
            _say_overridden(tree[key], value, path, dotted)
        elif key in tree and tree[key] != value:
            log.warning("%s = %r from MARIANA_%s overrides %r of %s", dotted, value,
                        dotted.upper().replace(".", "__"), tree[key], path)


def from_dict(cls: type, data: Mapping[str, Any], where: str = "") -> Any:
    """Build dataclass `cls` from a mapping; unknown keys and wrong types raise ConfigError."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where or 'config'}: expected a table, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{where or 'config'}: unknown key {_dotted(where, unknown[0])!r} "
                          f"(known: {', '.join(sorted(names))})")
    kwargs = {k: _coerce(hints[k], v, _dotted(where, k)) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{where or 'config'}: {e}") from None


def read_toml(path: str | os.PathLike) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a config file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None


def env_overrides(env: Mapping[str, str], sections: set[str] | None = None) -> dict:
    """`MARIANA_TRAIN__EPOCHS=3` -> {"train": {"epochs": 3}} (double underscore nests).

    With `sections`, only variables of those top-level sections count: the
    job config and the cluster config share the prefix, not their sections.

    >>> env_overrides({"MARIANA_TRAIN__EPOCHS": "3", "MARIANA_PS__COUNT": "2", "HOME": "/"}, {"train"})
    {'train': {'epochs': 3}}
    """
    tree: dict = {}
    for name, raw in env.items():
        if name.startswith(ENV_PREFIX) and "__" in name:
            dotted = name[len(ENV_PREFIX):].lower().replace("__", ".")
            if sections is None or dotted.split(".", 1)[0] in sections:
                _set_dotted(tree, dotted, _parse_scalar(raw))
    return tree


def parse_set_option(item: str) -> tuple[str, Any]:
    """'train.epochs=3' -> ('train.epochs', 3), for --set flags."""
    if "=" not in item:
        raise ConfigError(f"--set expects key=value, got {item!r}")
    key, raw = item.split("=", 1)
    if not key.strip():
        raise ConfigError(f"--set expects key=value, got {item!r} (no key before the '=')")
    return key.strip(), _parse_scalar(raw.strip())


def _dotted(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        if len(args) == 1:
            return _coerce(args[0], value, key)
        for arg in args:  # the first type the value is (int | str: 3 stays 3, "auto" a string)
            try:
                return _coerce(arg, value, key)
            except ConfigError:
                if arg in _SCALARS and isinstance(value, _SCALARS[arg][0]) and not isinstance(value, bool):
                    raise  # of the type but not its range (an int past 64 bits): that is what is wrong
        whats = " or ".join(_SCALARS[a][1] if a in _SCALARS else a.__name__ for a in args)
        raise ConfigError(f"{key}: expected {whats}, got {shown(value)}")
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {shown(value)}")
        return [_coerce(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a table, got {shown(value)}")
        return dict(value)
    if tp in _SCALARS:
        accepted, what = _SCALARS[tp]
        # bool is an int subclass in Python, but `epochs = true` is a mistake
        if not isinstance(value, accepted) or (tp is not bool and isinstance(value, bool)):
            raise ConfigError(f"{key}: expected {what}, got {shown(value)}")
        if tp is int and not -INT_LIMIT <= value < INT_LIMIT:
            raise ConfigError(f"{key}: expected an integer of 64 bits at most, got {shown(value)}")
        try:
            return tp(value)
        except OverflowError:  # float(10 ** 400)
            raise ConfigError(f"{key}: expected a number within a float's range (1.8e308), "
                              f"got {shown(value)}") from None
    return value


def shown(value: Any) -> str:
    """A value for an error message, short: an integer past 64 bits by its digits, a long repr cut.

    >>> shown(3), shown(10 ** 400), shown("x" * 100)[-8:]
    ('3', 'a 401-digit integer', 'xxxxx...')
    """
    if isinstance(value, int) and not isinstance(value, bool) and not -INT_LIMIT <= value < INT_LIMIT:
        try:
            return f"a {len(str(abs(value)))}-digit integer"
        except ValueError:  # past Python's int -> text limit
            return "an integer of more than 4,300 digits"
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."


def json_schema(tp: Any) -> dict:
    """The JSON schema (OpenAPI 3.0 dialect) of what `from_dict` accepts for `tp`: a
    dataclass is an object of its fields with no other keys; the checks in a
    dataclass's `__post_init__` (ranges, choices) are not expressed.

    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class Train:
    ...     epochs: int | str = 1
    ...     rate: float = 0.1
    ...     decay: typing.Optional[float] = None
    >>> s = json_schema(Train)
    >>> s["additionalProperties"], s["properties"]["epochs"]["anyOf"], s["properties"]["decay"]
    (False, [{'type': 'integer'}, {'type': 'string'}], {'type': 'number', 'nullable': True})
    """
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        return {"type": "object", "additionalProperties": False,
                "properties": {f.name: json_schema(hints[f.name]) for f in dataclasses.fields(tp) if f.init}}
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        kinds = [json_schema(a) for a in args if a is not type(None)]
        out = kinds[0] if len(kinds) == 1 else {"anyOf": kinds}
        return {**out, "nullable": True} if type(None) in args else out
    if origin in (list, tuple):
        (item, *_) = typing.get_args(tp) or (Any,)
        return {"type": "array", "items": json_schema(item)}
    if tp is dict or origin is dict:
        return {"type": "object"}
    return {bool: {"type": "boolean"}, int: {"type": "integer"}, float: {"type": "number"},
            str: {"type": "string"}}.get(tp, {})


_SCALARS = {bool: (bool, "true or false"), int: (int, "an integer"),
            float: ((int, float), "a number"), str: (str, "a string")}


def _parse_scalar(raw: str) -> Any:
    """A TOML value if it parses as one (3, 0.5, true, [1, 2], "x"), else the raw string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {p} is not a table")
    node[parts[-1]] = value


def _merge(base: dict, top: Mapping, cls: type) -> dict:
    """`top` over `base`, in place. A section (a field of `cls` that is a dataclass) merges
    key by key; any other value replaces, a free-form table too (`data.schema`: the
    environment's columns are not mixed into the file's)."""
    hints = typing.get_type_hints(cls)
    for k, v in top.items():
        section = hints.get(k)
        if isinstance(v, Mapping) and isinstance(base.get(k), dict) and dataclasses.is_dataclass(section):
            _merge(base[k], v, section)
        else:
            base[k] = v
    return base


SEEDS = 1 << 32  # numpy's and torch's generators alike take 0 .. 2^32 - 1


def check_seed(name: str, seed: int) -> None:
    """A seed every generator here takes, or ConfigError naming it.

    >>> check_seed("model.seed", -1)
    Traceback (most recent call last):
    mariana.sparse.errors.ConfigError: model.seed must be an integer in [0, 4294967295], got -1
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEEDS:
        raise ConfigError(f"{name} must be an integer in [0, {SEEDS - 1}], got {seed!r}")


def seed_arg(text: str) -> int:
    """A command line's --seed: an integer in [0, 2^32 - 1] (an argparse type).

    >>> seed_arg("7"), seed_arg("4294967295")
    (7, 4294967295)
    """
    import argparse

    try:
        seed = int(text)
        check_seed("a seed", seed)
    except (ValueError, ConfigError):
        raise argparse.ArgumentTypeError(f"expected an integer in [0, {SEEDS - 1}], got {text!r}") from None
    return seed


def count_arg(text: str) -> int:
    """A command line's count (a batch size, ...): an integer >= 1 (an argparse type).

    >>> count_arg("256")
    256
    """
    import argparse

    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return n
