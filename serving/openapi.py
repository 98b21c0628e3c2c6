"""The OpenAPI 3 document of the pCTR endpoint (served at /openapi.json).

The document describes what the server does, so that a fuzzer reading it (schemathesis,
in tests/integration/test_api_fuzz.py) finds no disagreement: with a model in service,
an instance's known fields get their field's rule (sparse/records.py) and anything else
is allowed, since unknown fields are ignored and counted.

>>> from mariana.sparse.schema import criteo
>>> doc = document(criteo())
>>> inst = doc["paths"]["/v1/predict"]["post"]["requestBody"]["content"]["application/json"]["schema"]
>>> fields = inst["properties"]["instances"]["items"]["properties"]
>>> fields["C1"]["anyOf"][1], fields["I1"]["anyOf"][0]["type"], "label" in fields
({'type': 'integer'}, 'number', True)
"""
from __future__ import annotations

import copy

from mariana.sparse.parse import HOUR_RE, NUMBER_RE
from mariana.sparse.schema import Schema

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}
_ANY = {"description": "Any value: a field the model does not know is ignored and counted "
                       "(mariana_serve_unknown_fields_total)."}
_MAX_DOUBLE = 1.7976931348623157e308
# A field's rule (sparse/records.py). OpenAPI 3.0 has no null type: `nullable` says a
# field may be null (missing, as an empty cell in a file).
_CATEGORICAL = {"anyOf": [{"type": "string"}, {"type": "integer"},
                          {"type": "number", "minimum": -_MAX_DOUBLE, "maximum": _MAX_DOUBLE}, {"type": "boolean"}],
                "nullable": True,
                "description": "Categorical: text, or an integer taken as its decimal text; a boolean or a float as a "
                               "Parquet column of them is read (true, false; a whole float as its integer, any other "
                               "its shortest text); null or \"\" is missing."}
_NUMERIC = {"anyOf": [{"type": "number", "minimum": -_MAX_DOUBLE, "maximum": _MAX_DOUBLE},
                      {"type": "string", "format": "number-text", "pattern": NUMBER_RE},
                      {"type": "string", "maxLength": 0}],
            "nullable": True,
            "description": "Numeric: a finite number, or number text as a file holds it (format number-text: the "
                           "pattern, and finite as a double: \"1e999\" is refused); null or \"\" is missing."}
_HOUR = {"anyOf": [{"type": "string", "pattern": HOUR_RE}, {"type": "integer", "minimum": 10_000_000,
                                                             "maximum": 99_999_999}],
         "description": "Hour YYMMDDHH: 8 digits naming a real date and hour; required."}
_INSTANCE = {"type": "object", "additionalProperties": _ANY,  # no model in service: any fields
             "description": "One row to score: field name -> value, named as in the model's schema "
                            "(GET /v1/model lists them). Unknown fields are ignored and counted."}
_PREDICT_RESP = {"type": "object", "required": ["pctr", "model_version"],
                 "properties": {"pctr": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}},
                                "model_version": {"type": "string"}}}


def instance_schema(schema: Schema | None) -> dict:
    """An instance of the model in service: its fields' rules, anything else allowed.
    Without a model (answers are 503) every field is described loosely."""
    if schema is None:
        return _INSTANCE
    props = {f: _CATEGORICAL for f in schema.categorical}
    props.update({f: _NUMERIC for f in schema.numeric})
    props.update({f: _ANY for f in (*([schema.label] if schema.label else []), *schema.ignore)})
    out = {"type": "object", "properties": props, "additionalProperties": _ANY,
           "description": f"One row to score for the {schema.name} schema: field name -> value. Fields the "
                          "model does not know are ignored and counted; the label and ignored columns are known "
                          "and unused."}
    if schema.hour:
        props[schema.hour] = _HOUR
        out["required"] = [schema.hour]
    return out


def _predict_request(instance: dict) -> dict:
    return {"type": "object", "required": ["instances"],
            "properties": {"instances": {"type": "array", "minItems": 1, "items": instance}},
            "description": "Other keys are ignored and counted."}


def document(schema: Schema | None = None) -> dict:
    """The document for the model in service (its schema's fields), or a loose one without."""
    doc = copy.deepcopy(OPENAPI)
    content = doc["paths"]["/v1/predict"]["post"]["requestBody"]["content"]
    for kind in content:
        content[kind]["schema"] = _predict_request(instance_schema(schema))
    return doc


def speech_document(sample_rate: int, classes: int) -> dict:
    """The document while a speech version (serving/speech.py) is in service: /v1/predict
    takes a wav file and answers the digit and its posteriors.

    >>> d = speech_document(8000, 10)["paths"]["/v1/predict"]["post"]
    >>> list(d["requestBody"]["content"]), sorted(d["responses"])
    (['audio/wav'], ['200', '400', '413', '415', '503'])
    """
    doc = copy.deepcopy(OPENAPI)
    doc["info"]["description"] = ("The spoken digit of a wav file, from the speech version in service (`mariana "
                                  "train speech`); the other endpoints are those of a click model's server.")
    post = doc["paths"]["/v1/predict"]["post"]
    post["summary"] = "The digit spoken in a wav file, and its posteriors"
    post["requestBody"] = {"required": True, "content": {"audio/wav": {"schema": {
        "type": "string", "format": "binary",
        "description": f"A wav file: mono, 16-bit PCM, {sample_rate} Hz (also as audio/x-wav, audio/wave or "
                       "application/octet-stream)."}}}}
    answer = {"type": "object", "required": ["digit", "posteriors", "model_version"],
              "properties": {"digit": {"type": "integer", "minimum": 0, "maximum": classes - 1},
                             "posteriors": {"type": "array", "minItems": classes, "maxItems": classes,
                                            "items": {"type": "number", "minimum": 0, "maximum": 1}},
                             "model_version": {"type": "string"}}}
    post["responses"] = {"200": _json(answer, "The digit with the largest posterior, and every digit's."),
                         **_errors(400, 413, 415, 503)}
    return doc


def _errors(*codes: int, kinds: tuple[str, ...] = ("application/json",)) -> dict:
    text = {400: "The body is not JSON/msgpack, not {\"instances\": [objects]}, or a value has the wrong type; "
                 "or it cannot be read (not in the Content-Encoding it names).",
            408: "The body did not all arrive in serve.body_seconds (the connection is closed).",
            401: "No bearer token, or a wrong one.",
            403: "The admin endpoints are off (no serve.token), or retrain is not configured on this server.",
            404: "No such retrain.", 409: "A retrain is running already.",
            413: "The body or the instance count is over the limit.",
            415: "A speech version takes a wav file (Content-Type: audio/wav), not instances; a click model "
                 "takes instances, not an audio, image or video body.",
            503: "No model is loaded."}
    return {str(c): {"description": text[c], "content": {kind: {"schema": _ERROR} for kind in kinds}} for c in codes}


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


OPENAPI = {
    "openapi": "3.0.3",
    "info": {"title": "Mariana pCTR", "version": "1",
             "description": "Click probabilities from the model version in service. Bodies are JSON, or msgpack "
                            "with Content-Type: application/msgpack; answers come in the request's encoding."},
    "paths": {
        "/v1/predict": {"post": {
            "summary": "pCTR of each instance",
            "requestBody": {"required": True,
                            "content": {kind: {"schema": _predict_request(_INSTANCE)}
                                        for kind in ("application/json", "application/msgpack")}},
            "responses": {"200": {"description": "One pCTR per instance, in order, and the version that gave them.",
                                  "content": {"application/json": {"schema": _PREDICT_RESP},
                                              "application/msgpack": {"schema": _PREDICT_RESP}}},
                          **_errors(400, 408, 413, 415, 503, kinds=("application/json", "application/msgpack"))}}},
        "/v1/model": {"get": {"summary": "The version in service: when, on what and how well it was trained",
                              "responses": {"200": _json({"type": "object"}, "Model information."),
                                            **_errors(503)}}},
        "/healthz": {"get": {"summary": "The process is up", "responses": {"200": _json({"type": "object"}, "Up.")}}},
        "/readyz": {"get": {"summary": "A model is loaded",
                            "responses": {"200": _json({"type": "object"}, "Ready."), **_errors(503)}}},
        "/metrics": {"get": {"summary": "Prometheus metrics of every worker process, summed",
                             "responses": {"200": {"description": "Text exposition format.",
                                                   "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        "/v1/retrain": {"post": {"summary": "Start a retrain (bearer token)", "security": [{"bearer": []}],
                                 "responses": {"202": _json({"type": "object"}, "Started; poll status_url."),
                                               "400": _json(_ERROR, "A body was sent: a retrain takes none (its "
                                                                    "data windows come from [retrain])."),
                                               **_errors(401, 403, 409, 503)}}},
        "/v1/retrain/{id}": {"get": {
            "summary": "A retrain's state and decision (bearer token)", "security": [{"bearer": []}],
            "parameters": [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {"200": _json({"type": "object"}, "State."), **_errors(401, 403, 404, 503)}}},
    },
    "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
}
