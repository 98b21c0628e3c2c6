"""The OpenAPI 3 document of the pCTR endpoint (served at /openapi.json)."""
from __future__ import annotations

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}
_VALUE = {"oneOf": [{"type": "string"}, {"type": "number"}, {"type": "null"}],
          "description": "Categorical fields: text, or an integer taken as its decimal text. Numeric fields: "
                         "a number, or number text. Hour fields (YYMMDDHH): text or an integer. "
                         "Absent, null or empty: the missing value, as in training."}
_INSTANCE = {"type": "object", "additionalProperties": _VALUE,
             "description": "One row to score: field name -> value, named as in the model's schema "
                            "(GET /v1/model lists them). Unknown fields are ignored and counted."}
_PREDICT_REQ = {"type": "object", "required": ["instances"],
                "properties": {"instances": {"type": "array", "minItems": 1, "items": _INSTANCE}}}
_PREDICT_RESP = {"type": "object", "required": ["pctr", "model_version"],
                 "properties": {"pctr": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}},
                                "model_version": {"type": "string"}}}


def _errors(*codes: int) -> dict:
    text = {400: "The body is not JSON/msgpack, not {\"instances\": [objects]}, or a value has the wrong type.",
            401: "Missing or wrong bearer token.", 403: "Admin endpoints are off (no serve.token).",
            404: "No such retrain.", 409: "A retrain is running already.",
            413: "The body or the instance count is over the limit.",
            503: "No model is loaded (or retrain is not configured)."}
    return {str(c): {"description": text[c], "content": {"application/json": {"schema": _ERROR}}} for c in codes}


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
            "requestBody": {"required": True, "content": {"application/json": {"schema": _PREDICT_REQ},
                                                          "application/msgpack": {"schema": _PREDICT_REQ}}},
            "responses": {"200": {"description": "One pCTR per instance, in order, and the version that gave them.",
                                  "content": {"application/json": {"schema": _PREDICT_RESP},
                                              "application/msgpack": {"schema": _PREDICT_RESP}}},
                          **_errors(400, 413, 503)}}},
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
                                               **_errors(401, 403, 409, 503)}}},
        "/v1/retrain/{id}": {"get": {
            "summary": "A retrain's state and decision (bearer token)", "security": [{"bearer": []}],
            "parameters": [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {"200": _json({"type": "object"}, "State."), **_errors(401, 403, 404)}}},
    },
    "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
}
