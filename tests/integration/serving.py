"""A real model server for tests: `mariana serve --config FILE` as its own OS
process on a free loopback port, spoken to with http.client."""
from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack

from mariana.services.launcher import free_port
from mariana.sparse.host import available_cpus
from tests.conftest import ROOT


class Server:
    def __init__(self, root: Path, model_dir: Path, workers: int = 1, serve: dict | None = None,
                 retrain: dict | None = None, prefix: list[str] | None = None):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = free_port((serve or {}).get("host", "127.0.0.1"))
        self.serve = {"model_dir": str(model_dir), "host": "127.0.0.1", "port": self.port, "workers": workers,
                      "watch_seconds": 0.5, **(serve or {})}
        self.config = self.root / "serve.toml"
        lines = ["[serve]"] + [f"{k} = {json.dumps(v)}" for k, v in self.serve.items()]
        if retrain:
            lines += ["[retrain]"] + [f"{k} = {json.dumps(v)}" for k, v in retrain.items()]
        self.config.write_text("\n".join(lines) + "\n")
        self.log = self.root / "serve.log"
        self.proc: subprocess.Popen | None = None
        self.returncode: int | None = None
        self.prefix = prefix or []  # e.g. a mount namespace to run in

    def __enter__(self) -> "Server":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, ready: bool = False, timeout: float = 90.0) -> None:
        """Start it and return once every worker listens (and, with `ready`, has a model)."""
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([*self.prefix, sys.executable, "-m", "mariana", "serve", "--config",
                                          str(self.config)],
                                         cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            body = self.wait_for("/readyz", timeout, want=200 if ready else None)
            workers = body.get("workers", {})
            if workers.get("listening") == workers.get("of") == (self.serve["workers"] or available_cpus()):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"not every worker listens after {timeout:g}s: {body}\n{self.logs()}")
            time.sleep(0.1)

    def wait_for(self, path: str, timeout: float = 30.0, want: int | None = 200) -> dict:
        """Poll `path` until it answers `want` (None: any answer at all)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with code {self.proc.returncode}:\n{self.logs()}")
            try:
                status, body = self.get(path)
                if status == want or (want is None and (status < 500 or status == 503)):
                    return body
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"{path} did not answer {want} within {timeout:g}s:\n{self.logs()}")
            time.sleep(0.1)

    def stop(self, timeout: float = 40.0) -> int:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.returncode = self.proc.returncode if self.proc else None
        return self.returncode

    def logs(self) -> str:
        return self.log.read_text()[-4000:] if self.log.exists() else "(no log)"

    # ---- HTTP ---------------------------------------------------------------------------

    def connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.serve["host"], self.port, timeout=30)

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
                conn: http.client.HTTPConnection | None = None) -> tuple[int, dict, bytes]:
        own = conn is None
        conn = conn or self.connect()
        try:
            conn.request(method, path, body=body, headers=headers or {})
            r = conn.getresponse()
            return r.status, dict(r.getheaders()), r.read()
        finally:
            if own:
                conn.close()

    def get(self, path: str, headers: dict | None = None) -> tuple[int, dict]:
        status, _, body = self.request("GET", path, headers=headers)
        try:
            return status, json.loads(body)
        except ValueError:
            return status, {"text": body.decode(errors="replace")}

    def post(self, path: str, body, fmt: str = "json", headers: dict | None = None,
             conn: http.client.HTTPConnection | None = None) -> tuple[int, dict]:
        """POST a body (a dict is encoded as `fmt`; bytes go as they are); the decoded answer."""
        ctype = "application/msgpack" if fmt == "msgpack" else "application/json"
        if not isinstance(body, bytes):
            body = msgpack.packb(body) if fmt == "msgpack" else json.dumps(body).encode()
        status, got_headers, raw = self.request("POST", path, body, {"Content-Type": ctype, **(headers or {})}, conn)
        answer_msgpack = got_headers.get("Content-Type", "").startswith("application/msgpack")
        return status, (msgpack.unpackb(raw) if answer_msgpack else json.loads(raw))

    def predict(self, instances: list, fmt: str = "json", conn=None) -> tuple[int, dict]:
        return self.post("/v1/predict", {"instances": instances}, fmt, conn=conn)

    def metric(self, name: str) -> float:
        """The sum of a metric's series in /metrics (histograms: their _count)."""
        status, body = self.get("/metrics")
        total = 0.0
        for line in body["text"].splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total


def tsv_instances(path: Path, n: int, numbers: bool = False) -> list[dict]:
    """The first n rows of a Criteo TSV as instances: field -> the file's text (or, with
    `numbers`, numeric fields as JSON numbers and empty ones left out)."""
    from mariana.sparse.schema import criteo

    cols = criteo().columns[1:]
    out = []
    with open(path) as f:
        for _, line in zip(range(n), f):
            values = line.rstrip("\n").split("\t")[1:]
            row = dict(zip(cols, values))
            if numbers:
                row = {k: (int(v) if k.startswith("I") else v) for k, v in row.items() if v != ""}
            out.append(row)
    return out
