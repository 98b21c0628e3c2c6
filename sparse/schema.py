"""Record schemas: which columns of a delimited file are the label, numeric
features, categorical features, or ignored.

Built-ins: `criteo()` (TSV, no header: label, I1..I13, C1..C26) and `avazu()`
(CSV with header; `hour` YYMMDDHH becomes hour-of-day and weekday). Any other
CSV/TSV is described by a `Schema` built from config (`Schema.from_dict`).

>>> s = criteo(); (len(s.columns), s.label, s.numeric[0], s.categorical[-1])
(40, 'label', 'I1', 'C26')
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from mariana.sparse.errors import ConfigError

FORMATS = ("criteo", "avazu", "csv")  # csv: any CSV/TSV described by a Schema in the config
CRITEO_NUMERIC = tuple(f"I{i}" for i in range(1, 14))
CRITEO_CATEGORICAL = tuple(f"C{i}" for i in range(1, 27))

AVAZU_COLUMNS = (
    "id", "click", "hour", "C1", "banner_pos", "site_id", "site_domain",
    "site_category", "app_id", "app_domain", "app_category", "device_id",
    "device_ip", "device_model", "device_type", "device_conn_type",
    "C14", "C15", "C16", "C17", "C18", "C19", "C20", "C21",
)

# Derived categorical fields made from an hour column (YYMMDDHH).
HOUR_FIELDS = ("hour_of_day", "weekday")


@dataclass(frozen=True)
class Schema:
    """Column layout of a delimited click log.

    `columns` is the file's column order. Every column must be exactly one of
    label, numeric, categorical, ignore, or the `hour` column (YYMMDDHH).
    The feature fields, in model order, are `numeric + categorical` followed
    by `HOUR_FIELDS` when `hour` is set.
    """

    name: str
    columns: tuple[str, ...]
    label: str
    numeric: tuple[str, ...] = ()
    categorical: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    hour: str | None = None
    delimiter: str = "\t"
    header: bool = False
    quoted: bool = False

    def __post_init__(self) -> None:
        # An empty label means an unlabeled layout (files to predict on).
        roles = [*([self.label] if self.label else []), *self.numeric, *self.categorical, *self.ignore]
        if self.hour:
            roles.append(self.hour)
        dup = sorted({c for c in roles if roles.count(c) > 1})
        if dup:
            raise ConfigError(f"schema {self.name!r}: columns with two roles: {dup}")
        missing = sorted(set(roles) - set(self.columns))
        if missing:
            raise ConfigError(f"schema {self.name!r}: roles name columns not in 'columns': {missing}")
        unassigned = [c for c in self.columns if c not in roles]
        if unassigned:
            raise ConfigError(
                f"schema {self.name!r}: columns without a role (label, numeric, categorical, "
                f"ignore or hour): {unassigned}")
        if len(set(self.columns)) != len(self.columns):
            raise ConfigError(f"schema {self.name!r}: duplicate column names")
        if len(self.delimiter) != 1 or self.delimiter in '\r\n"':  # a line break or the quote ends fields anyway
            raise ConfigError(f"schema {self.name!r}: delimiter must be one character other than a line break or "
                              f"'\"', got {self.delimiter!r}")
        if not self.numeric and not self.categorical and not self.hour:
            raise ConfigError(f"schema {self.name!r}: no feature columns")

    @property
    def fields(self) -> tuple[str, ...]:
        """Feature fields in model order (one hashed id per field per row)."""
        return self.numeric + self.categorical + (HOUR_FIELDS if self.hour else ())

    def without_label(self) -> "Schema":
        """The same layout for unlabeled files (the label column absent)."""
        if not self.label:
            return self
        return Schema(
            name=self.name, columns=tuple(c for c in self.columns if c != self.label),
            label="", numeric=self.numeric, categorical=self.categorical,
            ignore=self.ignore, hour=self.hour, delimiter=self.delimiter,
            header=self.header, quoted=self.quoted,
        )

    def label_ignored(self) -> "Schema":
        """The same layout with the label column read but not used or checked (prediction:
        a row whose label is missing or not 0/1 is still scored)."""
        if not self.label:
            return self
        return replace(self, label="", ignore=self.ignore + (self.label,))

    def to_dict(self) -> dict:
        return {
            "name": self.name, "columns": list(self.columns), "label": self.label,
            "numeric": list(self.numeric), "categorical": list(self.categorical),
            "ignore": list(self.ignore), "hour": self.hour or "",
            "delimiter": self.delimiter, "header": self.header, "quoted": self.quoted,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Schema":
        known = {"name", "columns", "label", "numeric", "categorical", "ignore",
                 "hour", "delimiter", "header", "quoted"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"schema: unknown keys {unknown} (known: {sorted(known)})")
        for key in ("columns", "label"):
            if key not in d:
                raise ConfigError(f"schema: missing required key {key!r}")
        kw = dict(d)
        for key in ("columns", "numeric", "categorical", "ignore"):
            if key in kw:
                if not isinstance(kw[key], (list, tuple)) or not all(isinstance(x, str) for x in kw[key]):
                    raise ConfigError(f"schema.{key}: expected a list of column names, got {kw[key]!r}")
                kw[key] = tuple(kw[key])
        for key, want in (("name", "a name"), ("label", "a column name ('' for none)"),
                          ("hour", "a column name ('' for none)"), ("delimiter", "one character")):
            if key in kw and not isinstance(kw[key], str):  # a list or a number reached code that wants text
                raise ConfigError(f"schema.{key}: expected {want}, got {kw[key]!r}")
        for key in ("header", "quoted"):
            if key in kw and not isinstance(kw[key], bool):  # "false" is true to Python
                raise ConfigError(f"schema.{key}: expected true or false, got {kw[key]!r}")
        kw["hour"] = kw.get("hour") or None
        return cls(**kw)


def criteo() -> Schema:
    return Schema(
        name="criteo", columns=("label",) + CRITEO_NUMERIC + CRITEO_CATEGORICAL,
        label="label", numeric=CRITEO_NUMERIC, categorical=CRITEO_CATEGORICAL,
        delimiter="\t", header=False,
    )


def avazu() -> Schema:
    cat = tuple(c for c in AVAZU_COLUMNS if c not in ("id", "click", "hour"))
    return Schema(
        name="avazu", columns=AVAZU_COLUMNS, label="click", categorical=cat,
        ignore=("id",), hour="hour", delimiter=",", header=True,
    )


BUILTIN = {"criteo": criteo, "avazu": avazu}


def builtin(name: str) -> Schema:
    """The built-in schema `name` ('criteo' or 'avazu')."""
    try:
        return BUILTIN[name]()
    except KeyError:
        raise ConfigError(
            f"unknown format {name!r}: use one of {sorted(BUILTIN)} or 'csv' with a [data.schema] "
            f"table in the config") from None
