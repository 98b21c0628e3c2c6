"""A speech version served by `mariana serve` (serving/speech.py), a real process on
loopback spoken to over real HTTP: a wav in, the same digit and posteriors as
`mariana predict` out; what is not such a wav is a 4xx that names it; and a
directory whose CURRENT moves from a speech version to a click version (and back)
is answered by the kind in service, with no restart."""
from __future__ import annotations

import json
import shutil
import struct
import time

import numpy as np
import pytest

from mariana.featurizer.speech import FrontEnd
from tests.conftest import reseal, run_cli
from tests.integration.serving import Server
from tests.speechdata import tone, wav_bytes, write_archive

pytestmark = pytest.mark.slow
WAV = {"Content-Type": "audio/wav"}


@pytest.fixture(scope="module")
def speech_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("speech")
    archive = write_archive(d / "fsdd_recordings.tar.gz")
    run_cli("-q", "train", "speech", "--data", archive, "--epochs", "3", "--batch-size", "128", "--out", d / "m",
            env={"MARIANA_CACHE": str(d / "cache")}, check=True)
    return d / "m"


def post_wav(s: Server, raw: bytes, headers: dict | None = None) -> tuple[int, dict, dict]:
    status, got, body = s.request("POST", "/v1/predict", raw, {**WAV, **(headers or {})})
    return status, got, json.loads(body)


def serving(s: Server, version: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while s.get("/readyz")[1].get("model_version") != version:
        assert time.monotonic() < deadline, s.logs()
        time.sleep(0.05)


def test_a_wav_gets_the_digit_and_posteriors_mariana_predict_gives(speech_model, tmp_path):
    wavs = {(d, k): wav_bytes(tone(d, k, i)) for d, k, i in ((4, 1, 3), (7, 0, 8), (0, 1, 1), (9, 0, 5))}
    for (d, k), raw in wavs.items():
        (tmp_path / f"{d}_{k}.wav").write_bytes(raw)
    files = ",".join(str(tmp_path / f"{d}_{k}.wav") for d, k in wavs)
    want = [json.loads(line) for line in run_cli("predict", "--model", speech_model, "--data", files, "--json",
                                                  check=True).stdout.splitlines()]
    with Server(tmp_path / "s", speech_model, workers=1) as s:
        assert s.wait_for("/readyz")["model_version"] == "v000001"
        for (digit, _), raw, expected in zip(wavs, wavs.values(), want):
            status, headers, answer = post_wav(s, raw)
            assert status == 200 and headers["X-Model-Version"] == "v000001"
            assert answer == {"digit": expected["digit"], "posteriors": expected["posteriors"],
                              "model_version": "v000001"}
            assert answer["digit"] == digit and abs(sum(answer["posteriors"]) - 1) < 1e-5
        for kind in ("audio/x-wav", "audio/wave", "application/octet-stream"):
            assert post_wav(s, wavs[4, 1], {"Content-Type": kind})[0] == 200
        assert s.request("POST", "/v1/predict", wavs[4, 1])[0] == 200  # no Content-Type: octet-stream
        info = s.get("/v1/model")[1]
        assert info["kind"] == "speech_dnn" and info["front_end"] == FrontEnd().to_dict()
        assert info["metrics"]["test_accuracy"] >= 0.9 and info["classes"] == list(range(10))
        post = s.get("/openapi.json")[1]["paths"]["/v1/predict"]["post"]
        assert list(post["requestBody"]["content"]) == ["audio/wav"] and "415" in post["responses"]
        assert s.metric("mariana_serve_predictions_total") == len(wavs) + 4


def long_chunk(raw: bytes) -> bytes:
    """A wav with a LIST chunk before its data that claims 500 bytes and holds 4."""
    at = raw.index(b"data")
    out = raw[:at] + b"LIST" + struct.pack("<I", 500) + b"INFO" + raw[at:]
    return out[:4] + struct.pack("<I", len(out) - 8) + out[8:]


MISTAKES = [  # (what, body, content type, status, the answer names)
    ("wrong rate", wav_bytes(tone(3, 0, 0), rate=16000), "audio/wav", 400, "sample rate 16000 Hz, expected 8000"),
    ("8-bit", wav_bytes(tone(3, 0, 0), width=1), "audio/wav", 400, "8-bit samples"),
    ("stereo", wav_bytes(tone(3, 0, 0), channels=2), "audio/wav", 400, "2 channels"),
    ("not a wav", b"hello there", "audio/wav", 400, "not a PCM wav file (file does not start with RIFF"),
    ("a wav header alone", b"RIFF", "audio/wav", 400, "not a PCM wav file (4 bytes, ending inside"),
    ("empty", b"", "audio/wav", 400, "no bytes at all"),
    ("truncated", wav_bytes(tone(3, 0, 0))[:-100], "audio/wav", 400, "truncated"),
    ("6 ms", wav_bytes(tone(3, 0, 0)[:48]), "audio/wav", 400,  # one window: its features all zero, any digit
     "48 samples (6.0 ms), shorter than the front end's two analysis windows (280 samples, 35.0 ms)"),
    ("silence", wav_bytes(np.zeros(8000, np.int16)), "audio/wav", 400,  # a digit with posterior 1.0 before
     "silent (its samples vary by at most 0 of 32767 around their mean): no digit to hear"),
    ("a constant level", wav_bytes(np.full(4000, 1000, np.int16)), "audio/wav", 400, "silent (its samples vary"),
    ("a chunk past the end", long_chunk(wav_bytes(tone(3, 0, 0))), "audio/wav", 400,
     "a chunk says it runs past the RIFF's end"),  # the wave module's bare RuntimeError: a 500 before
    ("instances", b'{"instances": [{"I1": 1}]}', "application/json", 415, "is a speech model: POST a wav file"),
    ("a form", wav_bytes(tone(3, 0, 0)), "application/x-www-form-urlencoded", 415,
     "not application/x-www-form-urlencoded"),  # curl --data-binary's default
    ("too large", b"RIFF" + bytes(300_000), "audio/wav", 413, "serve.max_body_bytes"),
]


def test_what_is_not_a_mono_16_bit_wav_is_a_4xx_that_names_it(speech_model, tmp_path):
    with Server(tmp_path / "s", speech_model, workers=1, serve={"max_body_bytes": 200_000}) as s:
        s.wait_for("/readyz")
        for what, body, ctype, status, says in MISTAKES:
            got, _, raw = s.request("POST", "/v1/predict", body, {"Content-Type": ctype})
            answer = json.loads(raw)
            assert (got, says in answer.get("error", "")) == (status, True), (what, got, answer)
        assert post_wav(s, wav_bytes(tone(2, 1, 4)))[0] == 200  # still answering
        assert s.metric("mariana_serve_predictions_total") == 1
        assert "Traceback" not in s.logs()
    # more than a minute of audio: scored, a recording's frames took ~100x its bytes, and 8 MiB
    # bodies at once took a server to 3 GB
    long = wav_bytes(np.tile(tone(2, 1, 4), 8000 * 61 // len(tone(2, 1, 4)) + 1))
    with Server(tmp_path / "l", speech_model, workers=1, serve={"max_body_bytes": 2_000_000}) as s:
        s.wait_for("/readyz")
        got, _, raw = s.request("POST", "/v1/predict", long, WAV)
        assert got == 413 and "s of 8000 Hz 16-bit audio; at most 60 s a request" in json.loads(raw)["error"], raw
        assert post_wav(s, wav_bytes(tone(2, 1, 4)))[0] == 200


def test_a_directory_moving_between_speech_and_click_versions_is_answered_by_the_kind_in_service(
        speech_model, gen_files, tmp_path):
    d = tmp_path / "models"
    shutil.copytree(speech_model, d)
    run_cli("-q", "train", "--data", gen_files["test"], "--model", "lr", "--out", d, check=True)  # v000002
    (d / "CURRENT").write_text("v000001\n")
    with Server(tmp_path / "s", d, workers=1, serve={"watch_seconds": 0.2}) as s:
        assert s.wait_for("/readyz")["model_version"] == "v000001"
        assert post_wav(s, wav_bytes(tone(6, 0, 2)))[2]["digit"] == 6
        (d / "CURRENT").write_text("v000002\n")
        serving(s, "v000002")
        status, answer = s.predict([{"I1": 3, "C1": "68fd1e64"}])
        assert status == 200 and 0 < answer["pctr"][0] < 1
        status, _, answer = post_wav(s, wav_bytes(tone(6, 0, 2)))
        assert status == 415 and "is a click model: POST instances" in answer["error"], answer  # not "not UTF-8"
        (d / "CURRENT").write_text("v000001\n")  # a rollback: the speech version was kept loaded
        serving(s, "v000001")
        assert "kept loaded since it was swapped out" in s.logs()
        assert post_wav(s, wav_bytes(tone(6, 0, 2)))[2]["digit"] == 6
        assert s.metric("mariana_serve_model_load_failures_total") == 0
        shutil.copytree(d / "v000001", d / "v000003")  # a damaged manifest: a failed load, and the watch goes on
        manifest = json.loads((d / "v000003" / "manifest.json").read_text())
        (d / "v000003" / "manifest.json").write_text(json.dumps({**manifest, "front_end": None}))
        reseal(d / "v000003")  # past the digests, to the front end's own check
        (d / "CURRENT").write_text("v000003\n")
        deadline = time.monotonic() + 10
        while s.metric("mariana_serve_model_load_failures_total") != 1:
            assert time.monotonic() < deadline, s.logs()
            time.sleep(0.05)
        assert "v000003: " in s.logs() and "front_end must be a map" in s.logs()
        shutil.copytree(d / "v000001", d / "v000004")  # not even a JSON object
        (d / "v000004" / "manifest.json").write_text("[1]")
        (d / "CURRENT").write_text("v000004\n")
        while s.metric("mariana_serve_model_load_failures_total") != 2:
            assert time.monotonic() < deadline, s.logs()
            time.sleep(0.05)
        assert "manifest.json: a JSON list, not an object" in s.logs()
        (d / "CURRENT").write_text("v000002\n")
        serving(s, "v000002")
