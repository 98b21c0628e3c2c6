"""`JobSpec`: the job spec every service decodes the same way; `to_dict` gives back
exactly the map the coordinator sends, and each bad spec is one `BadMessage("spec")`
whose message names what is wrong."""
from __future__ import annotations

import pytest

from mariana.services.assemble import check_request
from mariana.services.jobspec import JobSpec
from mariana.services.protocol import BadMessage
from mariana.sparse.schema import criteo
from mariana.sparse.synth import generate_criteo
from mariana.sparse.settings import from_dict
from mariana.trainer.config import JobConfig

CONFIG = from_dict(JobConfig, {"hashing": {"bits": 12}, "train": {"batch_size": 64}}).to_dict()
SCHEMA = criteo().to_dict()
IMAGES = {"redis_key": "mariana:creatives:0123456789abcdef", "dim": 16, "field": "C1", "set": "d1",
          "info": {"featurizer_sha256": "0123456789abcdef", "embedded": 3}}
INIT_FROM = {"model_dir": "/models/ctr", "version": "v000003", "rows_trained": 1000, "steps": 16}


@pytest.mark.parametrize("extra", [{}, {"images": IMAGES}, {"init_from": INIT_FROM}],
                         ids=["plain", "images", "warm_start"])
def test_a_spec_round_trips(extra):
    d = {"config": CONFIG, "schema": SCHEMA, **extra}
    spec = JobSpec.from_dict(d)
    assert spec.to_dict() == d
    assert spec.config.hashing.bits == 12 and spec.schema.name == "criteo"
    assert (spec.images, spec.init_from) == (extra.get("images"), extra.get("init_from"))


def test_image_width_is_the_features_and_the_unknown_flag():
    assert JobSpec.from_dict({"config": CONFIG, "schema": SCHEMA}).image_width == 0
    assert JobSpec.from_dict({"config": CONFIG, "schema": SCHEMA, "images": IMAGES}).image_width == 17


def test_the_spec_of_a_submitted_job_round_trips(tmp_path):
    """What the coordinator sends is `check_request`'s spec: decoded and encoded again, it is unchanged."""
    data = tmp_path / "train.tsv"
    generate_criteo(data, 200, seed=3)
    _, spec = check_request({"data": [str(data)], "out": str(tmp_path / "m"), "config": {"hashing": {"bits": 12}}})
    d = spec.to_dict()
    assert set(d) == {"config", "schema"} and spec.config.hashing.bits == 12
    assert JobSpec.from_dict(d) == spec and JobSpec.from_dict(d).to_dict() == d


BAD = [
    ("not_a_map", ["config", "schema"], "a job spec must be a map, got list"),
    ("no_config", {"schema": SCHEMA}, "job spec lacks 'config'"),
    ("no_schema", {"config": CONFIG}, "job spec lacks 'schema'"),
    ("unknown_config_key", {"config": {**CONFIG, "color": "red"}, "schema": SCHEMA}, "unknown key 'config.color'"),
    ("config_not_a_map", {"config": "lr", "schema": SCHEMA}, "config: expected a table, got str"),
    ("config_wrong_type", {"config": {"train": {"epochs": [2]}}, "schema": SCHEMA}, "config.train.epochs"),
    ("schema_not_a_map", {"config": CONFIG, "schema": "criteo"}, "schema must be a map, got str"),
    ("schema_lacks_columns", {"config": CONFIG, "schema": {"name": "x", "label": "y"}},
     "schema: missing required key 'columns'"),
    ("schema_unknown_key", {"config": CONFIG, "schema": {**SCHEMA, "colour": 1}}, "schema: unknown keys ['colour']"),
    ("images_not_a_map", {"config": CONFIG, "schema": SCHEMA, "images": "mariana:creatives"},
     "images must be a map, got str"),
    ("images_no_dim", {"config": CONFIG, "schema": SCHEMA, "images": {**IMAGES, "dim": None}},
     "images.dim is missing or not an integer"),
    ("images_dim_text", {"config": CONFIG, "schema": SCHEMA, "images": {**IMAGES, "dim": "16"}},
     "images.dim is missing or not an integer"),
    ("images_no_key", {"config": CONFIG, "schema": SCHEMA, "images": {"dim": 16, "set": "d1"}},
     "images.redis_key is missing or not a string"),
    ("init_from_text", {"config": CONFIG, "schema": SCHEMA, "init_from": "/models/ctr:v000003"},
     "init_from must be a map, got str"),
    ("init_from_no_version", {"config": CONFIG, "schema": SCHEMA, "init_from": {"model_dir": "/models/ctr"}},
     "init_from.version is missing or not a string"),
]


@pytest.mark.parametrize("d, says", [pytest.param(d, says, id=case) for case, d, says in BAD])
def test_a_bad_spec_is_one_error_naming_what_is_wrong(d, says):
    with pytest.raises(BadMessage) as e:
        JobSpec.from_dict(d)
    assert e.value.code == "spec"
    assert says in e.value.detail, e.value.detail
