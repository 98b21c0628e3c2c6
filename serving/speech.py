"""A speech version in service (issue 17: "frozen and exported ... so serving can run
it"): the model directory of `mariana train speech` served by the same server, watcher
and swaps as a click model.

    POST /v1/predict   a wav file (Content-Type: audio/wav; mono 16-bit PCM at the
                       version's sample rate) -> {"digit": 7, "posteriors": [...10],
                       "model_version": "v000002"}

The version runs as `featurizer.speech.SpeechRecognizer` (plain ops over the version's
safetensors weights, no training code, no pickle). A body that is not such a wav is a
400 naming what it is (its sample rate, width, channels, or that it is no wav at all);
JSON or msgpack instances sent to a speech version are a 415 that says what to send.
A directory may hold click and speech versions alike: each request is answered by
the kind of the version in service.
"""
from __future__ import annotations

import os
import time

from mariana.featurizer.speech import MODEL_KIND, BadAudio, SpeechRecognizer
from mariana.serving.errors import ServeError
from mariana.trainer import checkpoint

# A request's audio at most (a spoken digit is about a second): a recording's frames take ~100x
# its bytes while scored, and 8 MiB bodies (8.7 minutes) at once took a server to 3 GB.
MAX_AUDIO_SECONDS = 60
AUDIO_TYPES = frozenset({"audio/wav", "audio/x-wav", "audio/wave", "audio/vnd.wave",
                         "application/octet-stream"})  # aiohttp's name for a body without a Content-Type


class SpeechPredictor:
    """One loaded speech version: wav bytes -> the digit and its posteriors."""

    audio = True  # answers wav bodies; a click Predictor says False

    def __init__(self, recognizer: SpeechRecognizer, model_dir: str, version: str):
        self.recognizer, self.model_dir, self.version = recognizer, os.path.abspath(model_dir), version
        self.schema = None
        self.loaded_at = time.time()

    @classmethod
    def load(cls, model_dir: str, version: str | None = None, torch_threads: int | None = None) -> "SpeechPredictor":
        """The version (default: CURRENT), warmed up on a second of silence; `torch_threads`
        as `Predictor.load` takes it (one per server worker process)."""
        import numpy as np
        import torch

        version = version or checkpoint.current_version(model_dir)
        p = cls(SpeechRecognizer.load(model_dir, version), model_dir, version)
        if torch_threads:
            torch.set_num_threads(torch_threads)
        p.recognizer.posteriors(np.zeros(p.recognizer.front_end.sample_rate, np.int16))
        return p

    def share_ids(self, other) -> bool:
        """A speech version hashes no values: nothing to take over (`Predictor.share_ids`)."""
        return False

    def answer(self, body: bytes, content_type: str) -> dict:
        """A request's body -> the answer's object; ServeError 415 / 400 for a client's mistake."""
        if content_type.lower() not in AUDIO_TYPES:
            raise ServeError(415, f"{self.version} is a speech model: POST a wav file (Content-Type: audio/wav; "
                                  f"mono 16-bit PCM at {self.recognizer.front_end.sample_rate} Hz), "
                                  f"not {content_type}")
        rate = self.recognizer.front_end.sample_rate
        if len(body) > 2 * rate * MAX_AUDIO_SECONDS + 4096:  # 16-bit mono samples, and room for any header
            raise ServeError(413, f"the body holds {len(body):,} bytes, about {len(body) / (2 * rate):,.0f} s of "
                                  f"{rate} Hz 16-bit audio; at most {MAX_AUDIO_SECONDS} s a request (a spoken digit is "
                                  "about one): cut the recording")
        try:
            out = self.recognizer.predict_wav(body, "the body")
        except BadAudio as e:
            raise ServeError(400, str(e)) from None
        return {**out, "model_version": self.version}

    def creative_key(self) -> None:
        return None  # no image table to grow

    def info(self) -> dict:
        """What /v1/model says of a speech version."""
        m = self.recognizer.manifest
        train = m.get("train") or {}
        return {"model_dir": self.model_dir, "model_version": self.version, "kind": MODEL_KIND,
                "trained_at": m.get("created_at"),
                "loaded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.loaded_at)),
                "trained_on": {"split": train.get("split"), "archive_sha256": train.get("archive_sha256"),
                               "nproc": train.get("nproc"), "exchange": train.get("exchange")},
                "metrics": m.get("metrics") or {}, "front_end": m.get("front_end"), "classes": m.get("classes"),
                "accepts": sorted(AUDIO_TYPES)}


def load_version(model_dir: str, version: str | None = None, torch_threads: int | None = None,
                 tables: str = "auto"):
    """The version as what serves it: a `SpeechPredictor` for a speech version, else the
    click `Predictor` (its tables as `serve.tables` says). ModelDirError when it cannot be read."""
    from mariana.serving.predictor import Predictor

    version = version or checkpoint.current_version(model_dir)
    if checkpoint.read_manifest(model_dir, version).get("kind") == MODEL_KIND:
        return SpeechPredictor.load(model_dir, version, torch_threads)
    return Predictor.load(model_dir, version, torch_threads, tables)
