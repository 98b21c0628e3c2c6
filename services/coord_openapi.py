"""The OpenAPI 3 document of the coordinator's HTTP API (served at /openapi.json).

It describes what the server does, so that a fuzzer reading it (schemathesis, in
tests/integration/test_api_fuzz.py) finds no disagreement. A job's `config` is described
from the job config's dataclasses (`json_schema`): its sections and keys, and their types;
the ranges and choices the config checks when it is built are in deploy/config/train.example.toml.
Whether a job's files exist and parse is only known by submitting it (a 400 names what is
wrong).

>>> doc = OPENAPI
>>> sorted(doc["paths"]["/v1/jobs"]), doc["paths"]["/v1/jobs"]["post"]["security"]
(['get', 'post'], [{'bearer': []}])
>>> job = doc["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]["application/json"]["schema"]
>>> job["properties"]["config"]["properties"]["train"]["properties"]["epochs"]["anyOf"]
[{'type': 'integer'}, {'type': 'string'}]
"""
from __future__ import annotations

import copy

from mariana.services.assemble import JOB_KEYS, MODES
from mariana.sparse.settings import json_schema
from mariana.trainer.config import JobConfig

JOBS_PAGE = 100  # GET /v1/jobs without ?limit: the newest this many (and `total`, to page through the rest)

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}
_TEXT = {"description": "Text.", "content": {"text/plain": {"schema": {"type": "string"}}}}
_PATHS = {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "string"}],
          "description": "Absolute paths (files, directories or globs, as the CLI takes them), or one string "
                         "of them separated by commas."}
_JOB = {"type": "object", "required": ["data", "out"], "additionalProperties": False,
        "properties": {
            "data": _PATHS, "test_data": _PATHS, "valid_data": _PATHS,
            "out": {"type": "string", "description": "The model directory to publish into (absolute)."},
            "config": {**json_schema(JobConfig), "description": "The job config (deploy/config/train.example.toml "
                                                                "lists every key with its default and range)."},
            "init_from": {"type": "string", "description": "A warm start: 'DIR' or 'DIR:vNNNNNN' (absolute)."},
            "mode": {"type": "string", "enum": list(MODES)},
            "staleness": {"type": "integer", "minimum": 0},
            "promote": {"type": "boolean"}}}
assert set(_JOB["properties"]) == set(JOB_KEYS), "the document lists every job key the coordinator takes"
_SUMMARY = {"type": "object", "required": ["id", "state"],
            "properties": {"id": {"type": "string"},
                           "state": {"type": "string", "enum": ["queued", "running", "done", "failed", "cancelled"]},
                           "error": {"type": "string", "nullable": True}, "model": {"type": "string", "nullable": True},
                           "progress": {"type": "object"}, "cache": {"type": "object"}, "record": {"type": "object"}}}


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*codes: int) -> dict:
    text = {400: "The job is not a JSON object of known keys, a key has the wrong type or value, or a file it "
                 "names is missing or does not parse.",
            401: "No bearer token, or a wrong one (coordinator.token).",
            404: "No such job.", 409: "The job is writing its version: too late to cancel (it ends done).",
            413: "The body is over 1 MiB.",
            503: "No loader answered to check the job's files (coordinator.data_via_loader): try again."}
    return {str(c): _json(_ERROR, text[c]) if c != 413 else {"description": text[c], **_TEXT}
            for c in codes}


_ID = [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}]


def _count(name: str, text: str) -> dict:
    return {"name": name, "in": "query", "required": False, "description": text,
            "schema": {"type": "integer", "minimum": 0, "maximum": 999999999}}
OPENAPI = {
    "openapi": "3.0.3",
    "info": {"title": "Mariana coordinator", "version": "1",
             "description": "Jobs, services and models of a Mariana cluster. Reads need no token (the API listens "
                            "on loopback by default); submitting and cancelling jobs need the bearer token."},
    "paths": {
        "/healthz": {"get": {"summary": "The coordinator is up",
                             "responses": {"200": _json({"type": "object"}, "Up.")}}},
        "/v1/status": {"get": {"summary": "Every service with its heartbeat, the jobs, the sample cache's Redis",
                               "parameters": [_count("jobs", "Only the newest N jobs, with every queued or running "
                                                             "one (default: every job)."),
                                              {"name": "job", "in": "query", "required": False,
                                               "schema": {"type": "string"},
                                               "description": "With jobs=N: this job too, however old."},
                                              {"name": "brief", "in": "query", "required": False,
                                               "schema": {"type": "string", "enum": ["0", "1"]},
                                               "description": "1: ended jobs' records (but the newest job's and "
                                                              "job's) keep only their single values, and such a "
                                                              "summary has brief: true."}],
                               "responses": {"200": _json({"type": "object", "required": ["services", "jobs"],
                                                           "properties": {"services": {"type": "object"},
                                                                          "jobs": {"type": "array",
                                                                                   "items": _SUMMARY},
                                                                          "jobs_total": {"type": "integer"}}},
                                                          "Status."), **_errors(400)}}},
        "/v1/jobs": {
            "get": {"summary": "Jobs, newest first (a page: see total)",
                    "parameters": [_count("limit", f"At most N jobs (default {JOBS_PAGE}: a coordinator keeps "
                                                   "every job it ran)."),
                                   _count("offset", "Skip the newest K (default 0).")],
                    "responses": {"200": _json({"type": "object", "required": ["jobs", "total"],
                                                "properties": {"jobs": {"type": "array", "items": _SUMMARY},
                                                               "total": {"type": "integer"}}},
                                               "Jobs."), **_errors(400)}},
            "post": {"summary": "Submit a job (bearer token)", "security": [{"bearer": []}],
                     "requestBody": {"required": True, "content": {"application/json": {"schema": _JOB}}},
                     "responses": {"201": _json({"type": "object", "required": ["job", "state"],
                                                 "properties": {"job": {"type": "string"},
                                                                "state": {"type": "string"}}}, "Queued."),
                                   **_errors(400, 401, 413, 503)}}},
        "/v1/jobs/{id}": {"get": {"summary": "One job", "parameters": _ID,
                                  "responses": {"200": _json(_SUMMARY, "The job."), **_errors(404)}}},
        "/v1/jobs/{id}/history": {"get": {
            "summary": "A job's points over time (loss, AUC, rows/s) and its finished epochs",
            "parameters": _ID + [{"name": "since", "in": "query", "required": False,
                                  "schema": {"type": "number"}, "description": "Only points after this unix time."}],
            "responses": {"200": _json({"type": "object", "required": ["job", "points", "epochs"],
                                        "properties": {"job": {"type": "string"},
                                                       "points": {"type": "array"}, "epochs": {"type": "array"}}},
                                       "History."), **_errors(400, 404)}}},
        "/v1/jobs/{id}/cancel": {"post": {
            "summary": "Cancel a queued or running job (bearer token); an ended job is left as it is, and "
                       "one writing its version refused (409: it ends done)",
            "security": [{"bearer": []}], "parameters": _ID,
            "responses": {"200": _json(_SUMMARY, "The job after the request."), **_errors(401, 404, 409, 503)}}},
        "/v1/models": {"get": {"summary": "The model directories: versions, metrics, the one served, retrains",
                               "responses": {"200": _json({"type": "object", "required": ["models"],
                                                           "properties": {"models": {"type": "array"}}},
                                                          "Models.")}}},
        "/metrics": {"get": {"summary": "Prometheus metrics: the coordinator's counters, services up, jobs",
                             "responses": {"200": _TEXT}}},
    },
    "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
}


def document(token: bool) -> dict:
    """The document as this coordinator runs: without a token (coordinator.token empty, on
    loopback) submit and cancel need none, and the document says so."""
    if token:
        return OPENAPI
    doc = copy.deepcopy(OPENAPI)
    for op in (doc["paths"]["/v1/jobs"]["post"], doc["paths"]["/v1/jobs/{id}/cancel"]["post"]):
        op.pop("security")
        op["summary"] = op["summary"].replace(" (bearer token)", "")
        op["responses"].pop("401")
    return doc
