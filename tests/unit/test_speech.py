"""The speech front-end (featurizer/speech.py), the speech DNN, and the speech CLI's
answers to bad input: the archive read in place, log-mel frames, context windows,
splits, the feature cache, and one clear error line (exit 2) for what a user gets wrong."""
from __future__ import annotations

import io
import json
import re
import struct
import tarfile

import numpy as np
import pytest
import torch

from mariana.featurizer import speech
from mariana.featurizer.speech import BadAudio, FrontEnd, load_features, read_archive, read_wav
from mariana.sparse.errors import DataFormatError, MarianaError
from mariana.trainer.models.speech_dnn import SpeechDNN, SpeechDNNConfig, utterance_scores
from tests.conftest import data_dir, reseal, run_cli, run_cli_cases
from tests.speechdata import tone, wav_bytes, write_archive


@pytest.fixture()
def tones(tmp_path):
    return write_archive(tmp_path / "fsdd_recordings.tar.gz")


@pytest.fixture()
def fsdd():
    path = data_dir() / "fsdd" / "fsdd_recordings.tar.gz"
    if not path.exists():
        pytest.skip(f"FSDD not found at {path} (set MARIANA_DATA to the shared data dir)")
    return path


def test_the_real_archive_reads_in_place_with_the_official_and_speaker_splits(fsdd):
    utts = read_archive(fsdd)
    assert len(utts) == 3000 and {u.speaker for u in utts} == {"george", "jackson", "lucas", "nicolas", "theo",
                                                                "yweweler"}
    train, test = speech.split_utterances(utts, "official")
    assert (len(train), len(test)) == (2700, 300) and all(u.index < 5 for u in test)
    train, test = speech.split_utterances(utts, "speaker:theo")
    assert (len(train), len(test)) == (2500, 500) and {u.speaker for u in test} == {"theo"}


def test_log_mel_frames_are_mean_normalised_and_context_windows_repeat_the_edges():
    fe = FrontEnd(context=2)
    frames = speech.log_mel(tone(3, 0, 0), fe)
    assert frames.shape[1] == 40 and np.abs(frames.mean(0)).max() < 1e-4
    assert len(frames) == 1 + (len(tone(3, 0, 0)) - 200) // 80   # 25 ms windows every 10 ms
    win = speech.context_windows(frames, 2)
    assert win.shape == (len(frames), 200)
    assert np.array_equal(win[0, :40], frames[0]) and np.array_equal(win[0, 80:120], frames[0])
    assert np.array_equal(win[5, 120:160], frames[6])
    short = speech.log_mel(np.zeros(50, np.int16), fe)  # shorter than a window: one frame
    assert short.shape == (1, 40) and np.isfinite(short).all()


def test_the_feature_cache_is_keyed_by_the_archive_and_the_front_end(tmp_path, tones):
    cache = tmp_path / "cache"
    first = load_features(tones, FrontEnd(), cache)
    entries = sorted(p.name for p in cache.iterdir())
    assert len(entries) == 1 and len(first) == 200
    again = load_features(tones, FrontEnd(), cache)
    assert np.array_equal(again.frames, first.frames) and again.names == first.names
    other = load_features(tones, FrontEnd(n_mels=24), cache)
    assert other.frames.shape[1] == 24 and len(list(cache.iterdir())) == 2
    write_archive(tones, indices=range(8))  # the archive changed: a new entry, not the stale one
    assert len(load_features(tones, FrontEnd(), cache)) == 160
    train, test = first.split("official")
    x, y, utt = train.windows()
    assert len(train) == len(test) == 100 and x.shape == (len(y), 440) and utt.max() == 99


def test_an_unreadable_cache_entry_is_replaced_not_recomputed_every_run(tmp_path, tones):
    """A corrupt entry (meta.json not JSON, or JSON of the wrong shape) was taken for "another
    process cached it first": kept for ever, and every run computed the features again (the
    wrong shape was an AttributeError)."""
    cache = tmp_path / "cache"
    first = load_features(tones, FrontEnd(), cache)
    (entry,) = cache.iterdir()
    for junk in ("x\n", "[1]"):
        (entry / "meta.json").write_text(junk)
        again = load_features(tones, FrontEnd(), cache)
        assert np.array_equal(again.frames, first.frames) and again.names == first.names
        assert json.loads((entry / "meta.json").read_text())["format"] == speech.CACHE_FORMAT
        assert [p.name for p in cache.iterdir()] == [entry.name]  # no temp dir or old entry left
    # frames of another width (a traceback from the model's first layer), one name too few
    np.save(entry / "frames.npy", first.frames[:, :20].copy())
    assert load_features(tones, FrontEnd(), cache).frames.shape[1] == FrontEnd().n_mels
    meta = json.loads((entry / "meta.json").read_text())
    (entry / "meta.json").write_text(json.dumps({**meta, "names": meta["names"][:-1]}))
    assert load_features(tones, FrontEnd(), cache).names == first.names


def test_processes_repairing_one_cache_entry_at_once_leave_one_whole_entry(tmp_path, tones):
    """Each moves the junk aside and renames its own entry in: whichever comes second finds a
    whole entry and keeps it (real processes, started together)."""
    import subprocess
    import sys

    cache = tmp_path / "cache"
    first = load_features(tones, FrontEnd(), cache)
    (entry,) = cache.iterdir()
    (entry / "meta.json").write_text("x")
    code = ("import sys; from mariana.featurizer.speech import FrontEnd, load_features; "
            "print(len(load_features(sys.argv[1], FrontEnd(), sys.argv[2])))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tones), str(cache)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0] and [o.strip() for o, _ in outs] == ["200"] * 3, outs
    assert [p.name for p in cache.iterdir()] == [entry.name]
    again = speech._read_cache(entry, FrontEnd(), first.archive_sha256)
    assert again is not None and np.array_equal(again.frames, first.frames)


def extensible(samples: np.ndarray, sub_format: int = 1) -> bytes:
    """A mono 16-bit 8 kHz wav written as WAVE_FORMAT_EXTENSIBLE (sub-format 1: PCM, 3: float)."""
    data = samples.astype("<i2").tobytes()
    guid = struct.pack("<IHH", sub_format, 0, 0x10) + bytes([0x80, 0, 0, 0xAA, 0, 0x38, 0x9B, 0x71])
    fmt = struct.pack("<HHIIHH", 0xFFFE, 1, 8000, 16000, 2, 16) + struct.pack("<HHI", 22, 16, 4) + guid
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def test_a_bad_wav_names_the_file_and_what_is_wrong(tmp_path):
    assert read_wav(wav_bytes(tone(1, 0, 0))).dtype == np.int16
    samples = tone(1, 0, 0)  # the same samples, written the extensible way (Python 3.11's wave refuses the tag)
    assert np.array_equal(read_wav(extensible(samples), "x.wav"), read_wav(wav_bytes(samples)))
    raw = extensible(samples)
    junk = raw[:12] + b"JUNK" + struct.pack("<I", 27) + bytes(28) + raw[12:]  # an odd chunk (padded) before fmt
    junk = junk[:4] + struct.pack("<I", len(junk) - 8) + junk[8:]
    assert np.array_equal(read_wav(junk, "x.wav"), read_wav(wav_bytes(samples)))
    plain = wav_bytes(samples)
    short_ext = plain[:20] + b"\xfe\xff" + plain[22:]  # the extensible tag on a plain 16-byte fmt chunk
    for raw, what in ((wav_bytes(tone(1, 0, 0), rate=16000), "sample rate 16000 Hz"),
                      (wav_bytes(tone(1, 0, 0), width=1), "8-bit samples, expected 16-bit PCM (mono, 8000 Hz)"),
                      (wav_bytes(tone(1, 0, 0), channels=2), "2 channels, expected mono (16-bit PCM, 8000 Hz)"),
                      (extensible(samples, sub_format=3), "WAVE_FORMAT_EXTENSIBLE of samples that are not PCM"),
                      (short_ext, "WAVE_FORMAT_EXTENSIBLE with a 16-byte fmt chunk, not 40"),
                      (b"RIFF\x00\x00junk", "not a PCM wav")):
        with pytest.raises(BadAudio, match=re.escape(what)):
            read_wav(raw, "x.wav")
    fe = FrontEnd()
    assert len(read_wav(wav_bytes(tone(1, 0, 0)[:fe.min_samples]), "x.wav", min_samples=fe.min_samples)) == 280
    with pytest.raises(BadAudio, match=r"x.wav: 279 samples \(34.9 ms\), shorter than the front end's two"):
        read_wav(wav_bytes(tone(1, 0, 0)[:fe.min_samples - 1]), "x.wav", min_samples=fe.min_samples)
    short = write_archive(tmp_path / "s.tar.gz", extra={"recordings/3_zed_1.wav": wav_bytes(tone(3, 0, 1)[:100])})
    with pytest.raises(BadAudio, match="s.tar.gz:recordings/3_zed_1.wav: 100 samples"):
        load_features(short, fe, tmp_path / "cache")
    bad = write_archive(tmp_path / "a.tar.gz", extra={"recordings/3_zed_1.wav": wav_bytes(tone(3, 0, 1), 16000)})
    with pytest.raises(BadAudio, match="a.tar.gz:recordings/3_zed_1.wav: sample rate 16000 Hz"):
        read_archive(bad)
    with pytest.raises(DataFormatError, match="/dev/null: not a regular file"):  # it said "no such file"
        speech.fsdd_archive("/dev/null")
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(b"\x1f\x8b" + bytes(100))
    with pytest.raises(DataFormatError, match="not a readable .tar.gz"):
        read_archive(junk)
    empty = tmp_path / "empty.tar.gz"
    with tarfile.open(empty, "w:gz"):
        pass
    with pytest.raises(DataFormatError, match="no recordings"):
        read_archive(empty)
    with pytest.raises(MarianaError, match="no such speaker"):
        speech.split_utterances(read_archive(write_archive(tmp_path / "b.tar.gz")), "speaker:carol")


def test_an_archive_reads_links_once_per_name_and_refuses_silence(tmp_path):
    """A hard or symbolic link to a recording was left out without a word, a name the archive
    held twice was scored twice, and a silent recording was scored by `evaluate` (and trained
    on) where `predict` refuses it."""
    def archive(path, links=(), extra=()):
        with tarfile.open(path, "w:gz") as tar:
            for name, raw in [(f"recordings/{d}_ann_{i}.wav", wav_bytes(tone(d, 0, i))) for d in range(3)
                              for i in range(2)] + list(extra):
                info = tarfile.TarInfo(name)
                info.size = len(raw)
                tar.addfile(info, io.BytesIO(raw))
            for name, kind, target in links:
                info = tarfile.TarInfo(name)
                info.type, info.linkname = kind, target
                tar.addfile(info)
        return path

    links = [("recordings/0_ann_7.wav", tarfile.LNKTYPE, "recordings/0_ann_0.wav"),
             ("recordings/0_ann_8.wav", tarfile.SYMTYPE, "0_ann_1.wav")]
    linked = read_archive(archive(tmp_path / "l.tar.gz", links))
    by_name = {u.name: u for u in linked}
    assert len(linked) == 8 and np.array_equal(by_name["recordings/0_ann_7.wav"].samples,
                                               by_name["recordings/0_ann_0.wav"].samples)
    assert np.array_equal(by_name["recordings/0_ann_8.wav"].samples, by_name["recordings/0_ann_1.wav"].samples)
    with pytest.raises(DataFormatError, match="x.tar.gz:recordings/0_ann_9.wav: a link to gone.wav, which the "
                                              "archive does not hold"):
        read_archive(archive(tmp_path / "x.tar.gz", [("recordings/0_ann_9.wav", tarfile.SYMTYPE, "gone.wav")]))
    twice = read_archive(archive(tmp_path / "t.tar.gz", extra=[("recordings/2_ann_1.wav", wav_bytes(tone(5, 0, 0)))]))
    assert len(twice) == 6 and np.array_equal(twice[-1].samples, tone(5, 0, 0))  # the last copy, as tar extracts
    with pytest.raises(BadAudio, match=r"s.tar.gz:recordings/7_ann_3.wav: silent \(its samples vary by at most 0"):
        read_archive(archive(tmp_path / "s.tar.gz", extra=[("recordings/7_ann_3.wav",
                                                             wav_bytes(np.zeros(8000, np.int16)))]))


def test_a_wav_whose_sizes_are_unset_or_not_the_files_reads_as_the_file_is():
    """An encoder writing to a pipe leaves the data size unset (0xFFFFFFFF, or 0): "truncated
    (2292 of 2147483647 samples)", "not a WAVE file"; a RIFF size short of the file: "ending
    inside the wav header". A data size past the file is still a cut file."""
    samples = tone(4, 0, 1)
    raw = wav_bytes(samples)
    at = raw.index(b"data")
    for riff, data in ((0xFFFFFFFF, 0xFFFFFFFF), (0, 0), (20, len(samples) * 2)):
        odd = raw[:4] + struct.pack("<I", riff) + raw[8:at + 4] + struct.pack("<I", data) + raw[at + 8:]
        assert np.array_equal(read_wav(odd, "x.wav"), samples), (riff, data)
    past = raw[:at + 4] + struct.pack("<I", len(samples) * 2 + 1000) + raw[at + 8:]
    with pytest.raises(BadAudio, match=rf"x.wav: truncated \({len(samples)} of {len(samples) + 500} samples\)"):
        read_wav(past, "x.wav")


def test_the_cli_names_the_default_approximate_exchange():
    from mariana.trainer.strategies.data_parallel import DEFAULT_APPROX
    help_text = " ".join(run_cli("train", "speech", "--help", check=True).stdout.split())
    assert f"approx (the default approximate one: {DEFAULT_APPROX})" in help_text, help_text


def test_utterance_scores_sum_frame_log_posteriors():
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [0.0, 3.0]])
    scores = utterance_scores(logits, torch.tensor([0, 0, 1]), 2)
    expect = torch.log_softmax(logits.double(), 1)
    assert torch.allclose(scores[0], expect[0] + expect[1]) and torch.allclose(scores[1], expect[2])
    m = SpeechDNN(SpeechDNNConfig(input_dim=4, hidden=(3,)))
    m.set_input_stats(torch.tensor([[1.0, 2.0, 3.0, 5.0], [3.0, 2.0, 5.0, 9.0]]))
    assert m.input_std[1] == 1.0 and m.input_mean[0] == 2.0  # a constant dimension keeps std 1


BAD_SPEECH = [
    (["--data", "{tmp}/missing"], "no such file (the FSDD archive"),
    (["--data", "{junk}"], "not a readable .tar.gz"),
    (["--data", "{bad}"], "sample rate 16000 Hz, expected 8000 Hz"),
    (["--data", "{good}", "--nproc", "999"], "999 ranks: must be between 1 and"),
    (["--data", "{good}", "--nproc", "999", "--device", "cuda"],
     "999 ranks: must be between 1 and" if torch.cuda.is_available() else "--device cuda: this machine has no CUDA"),
    (["--data", "{good}", "--exchange", "gzip"], "--exchange 'gzip': use exact, fp16, powersgd:R"),
    (["--data", "{good}", "--split", "speaker:carol"], "no such speaker (the data has ann, bob)"),
    (["--data", "{good}", "--epochs", "0"], "--epochs must be >= 1"),
]


@pytest.fixture(scope="module")
def bad_speech_runs(tmp_path_factory) -> tuple:
    """Every case of BAD_SPEECH, run in one `mariana` process (run_cli_cases), each with its own --out."""
    tmp = tmp_path_factory.mktemp("bad-speech")
    junk = tmp / "junk.tar.gz"
    junk.write_bytes(b"not gzip at all")
    wrong_rate = {"recordings/3_zed_1.wav": wav_bytes(tone(3, 0, 1), 16000)}
    paths = {"tmp": tmp, "junk": junk, "good": write_archive(tmp / "good.tar.gz"),
             "bad": write_archive(tmp / "bad.tar.gz", extra=wrong_rate)}
    cases = [["train", "speech", *[a.format(**paths) for a in args], "--out", tmp / f"m{i}"]
             for i, (args, _) in enumerate(BAD_SPEECH)]
    return tmp, run_cli_cases(cases, env={"MARIANA_CACHE": str(tmp / "cache")})


@pytest.mark.parametrize("case", range(len(BAD_SPEECH)), ids=[m for _, m in BAD_SPEECH])
def test_bad_input_to_train_speech_is_one_error_line_and_exit_2(bad_speech_runs, case):
    tmp, runs = bad_speech_runs
    (code, stderr), message = runs[case], BAD_SPEECH[case][1]
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert lines[-1].startswith("mariana: error: ") and message in lines[-1], stderr
    assert "Traceback" not in stderr
    assert not (tmp / f"m{case}" / "CURRENT").exists()


def test_bad_input_to_train_speech_from_its_own_process(tmp_path):
    """One case as the installed command runs it: its own process, exit code 2, one line."""
    proc = run_cli("train", "speech", "--data", tmp_path / "missing", "--out", tmp_path / "m")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("mariana: error: "), proc.stderr
    assert "no such file (the FSDD archive" in proc.stderr and "Traceback" not in proc.stderr


def test_train_speech_in_one_process_publishes_a_version_the_recognizer_runs(tmp_path, tones):
    proc = run_cli("train", "speech", "--data", tones, "--epochs", "3", "--batch-size", "128", "--out",
                   tmp_path / "m", "--json", env={"MARIANA_CACHE": str(tmp_path / "cache")}, check=True)
    result = json.loads(proc.stdout)
    assert result["nproc"] == 1 and result["bytes_per_step"] == 0 and len(result["per_epoch"]) == 3
    manifest = json.loads((tmp_path / "m" / "v000001" / "manifest.json").read_text())
    assert manifest["kind"] == "speech_dnn" and manifest["front_end"] == FrontEnd().to_dict()
    assert manifest["metrics"]["test_accuracy"] == result["test_accuracy"] >= 0.9
    assert (tmp_path / "m" / "v000001" / "optimizer.safetensors").exists()
    rec = speech.SpeechRecognizer.load(tmp_path / "m")
    assert rec.classify(tone(4, 1, 3)) == 4
    assert speech.is_speech_model(tmp_path / "m") and not speech.is_speech_model(tmp_path)
    from mariana.sparse.errors import ModelDirError
    from mariana.trainer.bundle import ModelBundle
    with pytest.raises(ModelDirError, match="v000001 is a speech model .* not a click model"):
        ModelBundle.load(str(tmp_path / "m"))  # what serving loads: a clear refusal, not a KeyError
    listed = run_cli("model", "list", "--model-dir", tmp_path / "m", check=True).stdout
    assert "v000001  speech_dnn" in listed
    # a click version beside it: DIR:vN is scored by vN's own kind, not by CURRENT's (each was refused)
    rows = tmp_path / "rows.tsv"
    rows.write_text("".join(f"{i % 2}\t{i}" + "\t" * 12 + f"\tc{i % 3}" + "\t" * 25 + "\n" for i in range(200)))
    run_cli("-q", "train", "--data", rows, "--out", tmp_path / "m", "--bits", "10", check=True)  # v000002: CURRENT
    wav = tmp_path / "four.wav"
    wav.write_bytes(wav_bytes(tone(4, 1, 3)))
    said = run_cli("predict", "--model", f"{tmp_path / 'm'}:v000001", "--data", wav, check=True).stdout
    assert said.split()[1] == "4", said
    run_cli("model", "promote", "v000001", "--model-dir", tmp_path / "m", check=True)  # CURRENT: speech
    pctrs = run_cli("predict", "--model", f"{tmp_path / 'm'}:v000002", "--data", rows, check=True).stdout.split()
    assert len(pctrs) == 200
    swapped = [*manifest["ops"][:-1], {**manifest["ops"][-1], "weight": "hidden.0.weight"}]  # a wrong shape
    (tmp_path / "m" / "v000001" / "manifest.json").write_text(json.dumps({**manifest, "ops": manifest["ops"][:-1]}))
    with pytest.raises(ModelDirError, match="v000001/manifest.json: changed since the version was written"):
        speech.SpeechRecognizer.load(tmp_path / "m")  # an edited manifest, not sealed again: its digest says so
    for bad, says in [([1], "manifest.json: a JSON list, not an object"),
                      ({**manifest, "ops": [{"op": ["linear"]}]}, "ops a list of maps naming their op"),
                      ({**manifest, "ops": swapped}, "its ops do not run on a frame of 440 inputs")]:
        (tmp_path / "m" / "v000001" / "manifest.json").write_text(json.dumps(bad))
        reseal(tmp_path / "m" / "v000001")  # past the digests, to the ops' own checks
        with pytest.raises(ModelDirError, match=says):
            speech.SpeechRecognizer.load(tmp_path / "m")
        wav = tmp_path / "x.wav"
        wav.write_bytes(wav_bytes(tone(4, 1, 3)))
        proc = run_cli("predict", "--model", tmp_path / "m", "--data", wav)  # a traceback before
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr


def test_powersgd_on_the_cpu_skips_the_cuda_sync_torch_s_hook_asks_for():
    """torch's PowerSGD hook syncs CUDA with the bucket's device whenever CUDA is available,
    also for a CPU job, and that raised on a GPU host (torch 2.11, H200). After the shim a
    sync of a device that is not CUDA returns at once; a CUDA device still reaches torch's
    (here, without CUDA, its error). In a subprocess: the shim lasts for the process."""
    import subprocess
    import sys

    code = """
import torch
from mariana.trainer.strategies.data_parallel import cuda_sync_skips_other_devices
def raises(device):
    try:
        torch.cuda.synchronize(device)
        return None
    except Exception as e:
        return type(e).__name__
before = raises(torch.device("cpu"))
cuda_sync_skips_other_devices(); cuda_sync_skips_other_devices()  # twice: wrapped once
print(before, raises(torch.device("cpu")), raises("cpu"), torch.cuda.is_available() or raises("cuda:0") is not None)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] != "None" and out[1:] == ["None", "None", "True"], out


def test_a_speech_timeout_past_what_a_timedelta_holds_is_refused():
    """--timeout inf or 1e300 passed the check and failed in datetime.timedelta on every rank
    (image mode refused them already; both now use data_parallel.MAX_TIMEOUT_S)."""
    from mariana.sparse.errors import ConfigError
    from mariana.trainer.speech import SpeechConfig

    for t in (float("inf"), 1e300):
        with pytest.raises(ConfigError, match="must be a number of seconds > 0"):
            SpeechConfig(timeout_s=t)


def test_a_stopped_rank_is_named_as_the_cause_not_the_first_rank_to_time_out():
    """A rank frozen by SIGSTOP: the job failed naming a rank whose collective timed out
    waiting for it ("rank 2 of 4 exited ..."), and the frozen rank 3 was never named."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from types import SimpleNamespace

    from mariana.trainer.strategies.data_parallel import _is_stopped, _rank_failure

    frozen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not _is_stopped(frozen.pid)
        os.kill(frozen.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not _is_stopped(frozen.pid):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        frozen.kill()
        frozen.wait()
    timed_out = SimpleNamespace(collective_failed=True, error="rank 2 of 4: gloo: Timed out waiting")
    relays = [SimpleNamespace(collective_failed=False, error=None)] * 2 + [timed_out, timed_out]
    said = str(_rank_failure({2: (1.0, 1)}, relays, 4, [3]))
    assert said.startswith("rank 3 of 4 was stopped (SIGSTOP, or a debugger held it)"), said
    assert str(_rank_failure({2: (1.0, 1)}, relays, 4)).startswith("rank 2 of 4 exited with status 1")
