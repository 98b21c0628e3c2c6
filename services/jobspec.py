"""`JobSpec`: what every service needs to know of a job, decoded in one place.

The coordinator builds it from a submitted job (services/assemble.py `check_request`)
and sends it as a map, in `StartJob{job, spec}` and in the `JobSpec{job, spec}` reply
to `GetJob`:

    {"config": {job config}, "schema": {schema},
     "init_from": {"model_dir", "version", "rows_trained", "steps"},   (a warm start)
     "images": {"redis_key", "dim", "set", "field", "info"}}           (image features, set
                                                                        by the coordinator)

`JobSpec.from_dict` checks it and raises `BadMessage("spec", ...)` naming what is wrong;
a parameter server answers that with an Error reply, preprocess and workers count it and
drop the job's work. `to_dict` is its inverse.
"""
from __future__ import annotations

from dataclasses import dataclass

from mariana.services.protocol import BadMessage
from mariana.sparse.errors import MarianaError
from mariana.sparse.schema import Schema
from mariana.sparse.settings import from_dict
from mariana.trainer.config import JobConfig

IMAGES_KEYS = {"redis_key": str, "dim": int, "set": str}      # what preprocess and the model read
INIT_FROM_KEYS = {"model_dir": str, "version": str}          # the version a warm start goes on from


@dataclass(frozen=True)
class JobSpec:
    config: JobConfig
    schema: Schema
    images: dict | None = None     # the creative features cache of a job with image features
    init_from: dict | None = None  # a warm start's parent version

    @classmethod
    def from_dict(cls, d) -> "JobSpec":
        """The spec a service was sent; BadMessage("spec", ...) naming what is wrong.

        >>> JobSpec.from_dict({"config": {}})
        Traceback (most recent call last):
        ...
        mariana.services.protocol.BadMessage: spec: job spec lacks 'schema'
        """
        if not isinstance(d, dict):
            raise BadMessage("spec", f"a job spec must be a map, got {type(d).__name__}")
        for key in ("config", "schema"):
            if key not in d:
                raise BadMessage("spec", f"job spec lacks {key!r}")
        if not isinstance(d["schema"], dict):
            raise BadMessage("spec", f"schema must be a map, got {type(d['schema']).__name__}")
        try:
            config = from_dict(JobConfig, d["config"], "config")
            schema = Schema.from_dict(d["schema"])
        except (MarianaError, TypeError, ValueError) as e:  # an unknown key, a wrong type, a bad schema
            raise BadMessage("spec", f"bad job spec: {e}") from None
        return cls(config, schema, _record(d, "images", IMAGES_KEYS), _record(d, "init_from", INIT_FROM_KEYS))

    def to_dict(self) -> dict:
        """The map the coordinator sends (keys absent rather than None)."""
        return {"config": self.config.to_dict(), "schema": self.schema.to_dict(),
                **({"init_from": self.init_from} if self.init_from is not None else {}),
                **({"images": self.images} if self.images is not None else {})}

    @property
    def image_width(self) -> int:
        """Dense columns the job's image features add (d features + the unknown flag; 0 without images)."""
        return self.images["dim"] + 1 if self.images is not None else 0


def _record(d: dict, key: str, fields: dict[str, type]) -> dict | None:
    """d[key]: None when absent, else a map with `fields` of their types."""
    value = d.get(key)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise BadMessage("spec", f"{key} must be a map, got {type(value).__name__}")
    for name, tp in fields.items():
        if not isinstance(value.get(name), tp) or isinstance(value.get(name), bool):
            raise BadMessage("spec", f"{key}.{name} is missing or not {'a string' if tp is str else 'an integer'}")
    return value
