"""The speech front-end: spoken-digit recordings -> log-mel frames in context
windows, and the frozen recognizer that serving and the pipeline run.

    read_archive(fsdd_recordings.tar.gz)     tarfile + wave, no extraction; each wav checked:
                                             mono, 16-bit, 8,000 Hz, at least two windows long
                                             (35 ms), else BadAudio naming it
    log_mel(samples, FrontEnd())             (T, 40): pre-emphasis, 25 ms Hamming windows every
                                             10 ms, |rfft|^2, 40 mel filters, log, minus the
                                             utterance's mean per bin (mean normalisation)
    context_windows(frames, K)               (T, (2K+1) * 40): each frame with K either side
                                             (the edge frames repeated)
    split_utterances(utts, "official")       index 0-4 test (300), 5-49 train (2,700);
                     "speaker:theo"          one speaker's 500 held out
    load_features(archive, fe, cache_dir)    every utterance's frames, cached on disk keyed by
                                             the archive's sha256 and the front-end parameters

    SpeechRecognizer.load(MODEL_DIR)         the frozen model of `mariana train speech`: the
      .posteriors(samples) -> (10,)          front-end parameters from the manifest and the
      .classify(samples)   -> digit          DNN as plain ops (linear, relu) over its weights,
      .embed(samples)      -> (d,)           like the image featurizer; no training code

The front-end is numpy only (no torch), so it gives the same frames wherever it runs.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
import struct
import tarfile
import tempfile
import wave
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from mariana.sparse import finite
from mariana.sparse.errors import DataFormatError, MarianaError, ModelDirError
from mariana.sparse.files import check_digests, file_sha256, loads_json

log = logging.getLogger(__name__)

SAMPLE_RATE = 8000
ARCHIVE = "fsdd_recordings.tar.gz"
DIGITS = 10
NAME_RE = re.compile(r"(?:^|/)(\d)_([A-Za-z]+)_(\d+)\.wav$")
CACHE_FORMAT = "mariana-speech-features/1"
MODEL_KIND = "speech_dnn"  # a version manifest's "kind" for `mariana train speech`
OFFICIAL_TEST_INDEX = 5  # FSDD's README: recordings with index 0-4 are the test set


class BadAudio(DataFormatError):
    """A recording that is not mono 16-bit PCM at the front-end's rate, or not a wav at all."""


@dataclass(frozen=True)
class FrontEnd:
    """The front-end's parameters; a version's manifest records them (`to_dict`), and the
    feature cache is keyed by them.

    >>> fe = FrontEnd()
    >>> fe.win, fe.hop, fe.n_fft, fe.input_dim, fe.min_samples
    (200, 80, 256, 440, 280)
    """

    sample_rate: int = SAMPLE_RATE
    n_mels: int = 40
    win_ms: float = 25.0
    hop_ms: float = 10.0
    context: int = 5             # K: frames either side of the centre one
    preemphasis: float = 0.97
    fmin: float = 0.0
    fmax: float = 4000.0         # at most sample_rate / 2

    def __post_init__(self) -> None:
        if self.n_mels < 1 or self.context < 0 or self.win_ms <= 0 or self.hop_ms <= 0:
            raise MarianaError(f"speech front-end: n_mels >= 1, context >= 0, win_ms and hop_ms > 0; got {self}")
        if not 0 <= self.fmin < self.fmax <= self.sample_rate / 2:
            raise MarianaError(f"speech front-end: need 0 <= fmin < fmax <= sample_rate/2, got {self.fmin}, "
                               f"{self.fmax}")

    @property
    def win(self) -> int:
        return int(round(self.sample_rate * self.win_ms / 1000))

    @property
    def hop(self) -> int:
        return int(round(self.sample_rate * self.hop_ms / 1000))

    @property
    def n_fft(self) -> int:
        return 1 << (self.win - 1).bit_length()

    @property
    def min_samples(self) -> int:
        """The shortest recording the front end takes: two windows. One window's log-mel frame
        minus the utterance's mean is all zeros, whatever was said."""
        return self.win + self.hop

    @property
    def input_dim(self) -> int:
        return (2 * self.context + 1) * self.n_mels

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "FrontEnd":
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        return cls(**known)

    def key(self) -> str:
        """A short hash of the parameters (the cache's key)."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:12]


@dataclass
class Utterance:
    name: str          # recordings/{digit}_{speaker}_{index}.wav
    digit: int
    speaker: str
    index: int
    samples: np.ndarray  # int16 (n,)


# ---- reading -----------------------------------------------------------------------

def fsdd_archive(root: str | os.PathLike | None = None) -> Path:
    """The FSDD archive: `root` (the archive, or a dir holding it), else
    $MARIANA_DATA/fsdd, else ../shared/data/fsdd beside the checkout."""
    if root is None:
        data = os.environ.get("MARIANA_DATA") or Path(__file__).resolve().parents[2] / "shared" / "data"
        root = Path(data) / "fsdd"
    p = Path(root)
    if p.is_dir():
        p = p / ARCHIVE
    if not p.is_file():  # /dev/zero was "no such file"
        what = "not a regular file" if p.exists() else "no such file"
        raise DataFormatError(f"{p}: {what} (the FSDD archive {ARCHIVE}; set MARIANA_DATA or pass its path)")
    return p


def read_wav(raw: bytes, name: str = "wav", sample_rate: int = SAMPLE_RATE, min_samples: int = 1) -> np.ndarray:
    """The int16 samples of a mono 16-bit PCM wav at `sample_rate` with at least `min_samples`
    samples, or BadAudio saying what it is.

    >>> buf = io.BytesIO()
    >>> with wave.open(buf, "wb") as w:
    ...     w.setnchannels(1); w.setsampwidth(2); w.setframerate(16000); w.writeframes(b"\\0\\0" * 400)
    >>> read_wav(buf.getvalue(), "x.wav")
    Traceback (most recent call last):
    ...
    mariana.featurizer.speech.BadAudio: x.wav: sample rate 16000 Hz, expected 8000 Hz (mono, 16-bit PCM)
    """
    try:
        with wave.open(io.BytesIO(_plain_pcm(_file_sizes(raw))), "rb") as w:
            channels, width, rate, n = w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()
            frames = w.readframes(n)
    except (wave.Error, EOFError, RuntimeError, struct.error) as e:
        why = ("no bytes at all" if not raw
               else str(e) or (f"a chunk says it runs past the RIFF's end, in {len(raw)} bytes"
                               if isinstance(e, RuntimeError) else f"{len(raw)} bytes, ending inside the wav header"))
        raise BadAudio(f"{name}: not a PCM wav file ({why})") from None
    if rate != sample_rate:
        raise BadAudio(f"{name}: sample rate {rate} Hz, expected {sample_rate} Hz (mono, 16-bit PCM)")
    if width != 2:
        raise BadAudio(f"{name}: {8 * width}-bit samples, expected 16-bit PCM (mono, {sample_rate} Hz)")
    if channels != 1:
        raise BadAudio(f"{name}: {channels} channels, expected mono (16-bit PCM, {sample_rate} Hz)")
    if len(frames) != 2 * n:
        raise BadAudio(f"{name}: truncated ({len(frames) // 2} of {n} samples)")
    if n == 0:
        raise BadAudio(f"{name}: no samples")
    if n < min_samples:
        raise BadAudio(f"{name}: {n} samples ({1000 * n / rate:.1f} ms), shorter than the front end's two "
                       f"analysis windows ({min_samples} samples, {1000 * min_samples / rate:.1f} ms)")
    return np.frombuffer(frames, dtype="<i2").astype(np.int16)


UNSET_SIZES = (0, 0xFFFFFFFF)  # a data size an encoder writing to a pipe leaves (it cannot seek back)


def _file_sizes(raw: bytes) -> bytes:
    r"""A wav whose sizes are not its file's, as the file is: the RIFF size the file's length,
    and an unset data size (0 or 0xFFFFFFFF, as `ffmpeg ... -f wav -` writes) the bytes after
    it. Such wavs were "truncated (2292 of 2147483647 samples)", "not a WAVE file" or "ending
    inside the wav header". A data size that is set stays: a cut file is still found.

    >>> head = b"RIFF" + bytes(4) + b"WAVEfmt " + (16).to_bytes(4, "little") + bytes(16) + b"data"
    >>> fixed = _file_sizes(head + b"\xff" * 4 + b"\x01\x00\x02\x00")
    >>> int.from_bytes(fixed[4:8], "little"), int.from_bytes(fixed[40:44], "little")
    (40, 4)
    """
    if raw[:4] != b"RIFF" or raw[8:12] != b"WAVE" or len(raw) - 8 > 0xFFFFFFFF:
        return raw
    at = 12
    while at + 8 <= len(raw) and raw[at:at + 4] != b"data":
        size = int.from_bytes(raw[at + 4:at + 8], "little")
        at += 8 + size + (size & 1)
    unset = at + 8 <= len(raw) and int.from_bytes(raw[at + 4:at + 8], "little") in UNSET_SIZES
    if not unset and int.from_bytes(raw[4:8], "little") == len(raw) - 8:
        return raw  # (every request's wav, as a rule: no copy)
    out = bytearray(raw)
    out[4:8] = (len(raw) - 8).to_bytes(4, "little")
    if unset:
        out[at + 4:at + 8] = ((len(raw) - at - 8) & ~1).to_bytes(4, "little")  # whole samples
    return bytes(out)


PCM_GUID_TAIL = bytes.fromhex("000000001000800000aa00389b71")  # KSDATAFORMAT_SUBTYPE_PCM after its first 2 bytes


def _plain_pcm(raw: bytes) -> bytes:
    """A WAVE_FORMAT_EXTENSIBLE wav whose sub-format is PCM (some tools write mono 16-bit so)
    as the plain PCM wav it is (format tag 1), which Python 3.11's wave module reads; any
    other bytes as they are. The chunks before `fmt ` (e.g. JUNK) are stepped over. Another
    sub-format is a wave.Error saying so here, in the same words on every Python (3.12's wave
    reads the tag itself and words its refusal otherwise)."""
    at = 12
    while raw[:4] == b"RIFF" and raw[8:12] == b"WAVE" and at + 8 <= len(raw):
        size = int.from_bytes(raw[at + 4:at + 8], "little")
        if raw[at:at + 4] == b"fmt ":
            tag = at + 8
            if raw[tag:tag + 2] != b"\xfe\xff":
                return raw
            if len(raw) < tag + size:
                raise EOFError  # read_wav: "N bytes, ending inside the wav header"
            if size >= 40 and raw[tag + 24:tag + 26] == b"\x01\x00" and raw[tag + 26:tag + 40] == PCM_GUID_TAIL:
                return raw[:tag] + b"\x01\x00" + raw[tag + 2:]
            raise wave.Error("WAVE_FORMAT_EXTENSIBLE of samples that are not PCM" if size >= 40 else
                             f"WAVE_FORMAT_EXTENSIBLE with a {size}-byte fmt chunk, not 40")
        at += 8 + size + (size & 1)
    return raw


SILENT_PEAK = 8  # of 32767 (-72 dBFS); FSDD's quietest recording peaks at 343 around its mean


def check_audible(samples: np.ndarray, name: str = "wav") -> None:
    """BadAudio for a recording with nothing to hear: samples within SILENT_PEAK of their mean
    (silence, a constant level, the faintest hiss). Its frames are all but equal after the
    mean normalisation, and it came back as a digit with posterior 1.0.

    >>> check_audible(np.full(800, 1000, np.int16), "dc.wav")
    Traceback (most recent call last):
    ...
    mariana.featurizer.speech.BadAudio: dc.wav: silent (its samples vary by at most 0 of 32767 around their ...
    """
    peak = int(np.abs(samples.astype(np.int64) - int(round(float(samples.mean())))).max()) if len(samples) else 0
    if peak <= SILENT_PEAK:
        raise BadAudio(f"{name}: silent (its samples vary by at most {peak} of 32767 around their mean): no digit "
                       "to hear")


def read_archive(path: str | os.PathLike, sample_rate: int = SAMPLE_RATE, min_samples: int = 1) -> list[Utterance]:
    """Every `{digit}_{speaker}_{index}.wav` in a .tar.gz, read in place, sorted by name.
    A damaged archive, or a wav that is not mono 16-bit at `sample_rate`, has fewer than
    `min_samples` samples or is silent (`check_audible`: `predict` refuses it, and `evaluate`
    scored it), is a DataFormatError naming the file; other members are ignored. A hard or
    symbolic link to a recording in the archive is read as it (they were left out without a
    word), and a name the archive holds twice is its last copy, as tar extracts it (it was
    scored twice)."""
    path = Path(path)
    found: dict[str, Utterance] = {}
    try:
        with tarfile.open(path, "r:*") as tar:
            for member in tar:
                m = NAME_RE.search(member.name)
                if not m or not (member.isfile() or member.islnk() or member.issym()):
                    continue
                where = f"{path.name}:{member.name}"
                try:
                    f = tar.extractfile(member)
                except KeyError:
                    f = None
                if f is None:
                    raise DataFormatError(f"{where}: a link to {member.linkname}, which the archive does not hold")
                samples = read_wav(f.read(), where, sample_rate, min_samples)
                check_audible(samples, where)
                found[member.name] = Utterance(member.name, int(m.group(1)), m.group(2), int(m.group(3)), samples)
    except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
        if isinstance(e, FileNotFoundError):
            raise DataFormatError(f"{path}: no such file (the FSDD archive {ARCHIVE})") from None
        why = " ".join(str(e).split())  # tarfile's message may span lines: one line here
        raise DataFormatError(f"{path}: not a readable .tar.gz of wav files ({why})") from None
    if not found:
        raise DataFormatError(f"{path}: no recordings named {{digit}}_{{speaker}}_{{index}}.wav in the archive")
    return sorted(found.values(), key=lambda u: u.name)


def split_utterances(utts: list[Utterance], split: str = "official") -> tuple[list[Utterance], list[Utterance]]:
    """(train, test): "official" holds out recording indices 0-4; "speaker:NAME" one speaker.

    >>> u = [Utterance(f"{d}_{s}_{i}.wav", d, s, i, None) for d in (0, 1) for s in ("a", "b") for i in (0, 7)]
    >>> [len(p) for p in split_utterances(u)], [len(p) for p in split_utterances(u, "speaker:b")]
    ([4, 4], [4, 4])
    >>> split_utterances(u, "speaker:zed")
    Traceback (most recent call last):
    ...
    mariana.sparse.errors.MarianaError: --split speaker:zed: no such speaker (the data has a, b)
    """
    if split == "official":
        test = [u.index < OFFICIAL_TEST_INDEX for u in utts]
    elif split.startswith("speaker:"):
        who = split.split(":", 1)[1]
        speakers = sorted({u.speaker for u in utts})
        if who not in speakers:
            raise MarianaError(f"--split {split}: no such speaker (the data has {', '.join(speakers)})")
        test = [u.speaker == who for u in utts]
    else:
        raise MarianaError(f"--split {split!r}: use 'official' or 'speaker:NAME'")
    return [u for u, t in zip(utts, test) if not t], [u for u, t in zip(utts, test) if t]


# ---- the front-end -------------------------------------------------------------------

def mel_filters(fe: FrontEnd) -> np.ndarray:
    """(n_fft // 2 + 1, n_mels) triangular filters on the HTK mel scale, float64."""
    def mel(f):
        return 2595.0 * np.log10(1.0 + np.asarray(f) / 700.0)

    def hz(m):
        return 700.0 * (10.0 ** (np.asarray(m) / 2595.0) - 1.0)
    edges = hz(np.linspace(mel(fe.fmin), mel(fe.fmax), fe.n_mels + 2))
    freqs = np.arange(fe.n_fft // 2 + 1) * fe.sample_rate / fe.n_fft
    lo, mid, hi = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    up = (freqs[None, :] - lo) / (mid - lo)
    down = (hi - freqs[None, :]) / (hi - mid)
    return np.maximum(0.0, np.minimum(up, down)).T


def log_mel(samples: np.ndarray, fe: FrontEnd = FrontEnd()) -> np.ndarray:
    """(T, n_mels) float32 log-mel energies minus their mean over the utterance; T >= 1
    (a recording shorter than a window is zero-padded to one; the readers refuse recordings
    shorter than `fe.min_samples`, whose frames carry nothing).

    >>> t = np.arange(8000) / 8000
    >>> f = log_mel((8000 * np.sin(2 * np.pi * 440 * t)).astype(np.int16))
    >>> f.shape, f.dtype, bool(abs(f.mean(0)).max() < 1e-4)
    ((98, 40), dtype('float32'), True)
    """
    x = np.asarray(samples, dtype=np.float64) / 32768.0
    if fe.preemphasis:
        x = np.append(x[:1], x[1:] - fe.preemphasis * x[:-1])
    if len(x) < fe.win:
        x = np.pad(x, (0, fe.win - len(x)))
    n = 1 + (len(x) - fe.win) // fe.hop
    idx = np.arange(fe.win)[None, :] + fe.hop * np.arange(n)[:, None]
    frames = x[idx] * np.hamming(fe.win)[None, :]
    power = np.abs(np.fft.rfft(frames, fe.n_fft, axis=1)) ** 2
    feats = np.log(np.maximum(power @ mel_filters(fe), 1e-10))
    return (feats - feats.mean(0, keepdims=True)).astype(np.float32)


def context_windows(frames: np.ndarray, k: int) -> np.ndarray:
    """(T, D) -> (T, (2k+1) D): row t is frames t-k .. t+k, the first and last frames
    repeated past the edges.

    >>> context_windows(np.arange(3, dtype=np.float32)[:, None], 1).tolist()
    [[0.0, 0.0, 1.0], [0.0, 1.0, 2.0], [1.0, 2.0, 2.0]]
    """
    if k == 0:
        return frames
    t = len(frames)
    idx = np.clip(np.arange(t)[:, None] + np.arange(-k, k + 1)[None, :], 0, t - 1)
    return frames[idx].reshape(t, -1)


# ---- the feature set and its cache ---------------------------------------------------

@dataclass
class SpeechFeatures:
    """Every utterance's log-mel frames, concatenated: utterance i is
    frames[offsets[i]:offsets[i+1]] (context windows are cut from them when a batch needs
    them, so the cache holds each frame once)."""

    frames: np.ndarray     # (total T, n_mels) float32
    offsets: np.ndarray    # (U + 1,) int64
    names: list[str]
    digits: np.ndarray     # (U,) int64
    speakers: list[str]
    indices: np.ndarray    # (U,) int64: the recording index in its name
    front_end: FrontEnd
    archive_sha256: str

    def __len__(self) -> int:
        return len(self.names)

    def utterance(self, i: int) -> np.ndarray:
        return self.frames[self.offsets[i]:self.offsets[i + 1]]

    def select(self, which: list[int]) -> "SpeechFeatures":
        parts = [self.utterance(i) for i in which]
        offsets = np.zeros(len(which) + 1, np.int64)
        offsets[1:] = np.cumsum([len(p) for p in parts])
        return SpeechFeatures(np.concatenate(parts) if parts else self.frames[:0], offsets,
                              [self.names[i] for i in which], self.digits[which], [self.speakers[i] for i in which],
                              self.indices[which], self.front_end, self.archive_sha256)

    def split(self, split: str = "official") -> tuple["SpeechFeatures", "SpeechFeatures"]:
        """(train, test) as `split_utterances` cuts them."""
        utts = [Utterance(n, int(d), s, int(i), None)
                for n, d, s, i in zip(self.names, self.digits, self.speakers, self.indices)]
        train, test = split_utterances(utts, split)
        pos = {n: i for i, n in enumerate(self.names)}
        return self.select([pos[u.name] for u in train]), self.select([pos[u.name] for u in test])

    def windows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(inputs (total T, input_dim) float32, frame labels (total T,) int64, the utterance of
        each frame (total T,) int64)."""
        k = self.front_end.context
        x = np.concatenate([context_windows(self.utterance(i), k) for i in range(len(self))]) if len(self) \
            else np.zeros((0, self.front_end.input_dim), np.float32)
        counts = np.diff(self.offsets)
        utt = np.repeat(np.arange(len(self)), counts)
        return x, self.digits[utt], utt


def cache_root() -> Path:
    """$MARIANA_CACHE/speech, else ~/.cache/mariana/speech."""
    base = os.environ.get("MARIANA_CACHE") or Path.home() / ".cache" / "mariana"
    return Path(base) / "speech"


def load_features(archive: str | os.PathLike | None = None, fe: FrontEnd = FrontEnd(),
                  cache_dir: str | os.PathLike | None = None) -> SpeechFeatures:
    """The front-end's frames for every recording of the archive: from the cache when it has
    them (keyed by the archive's sha256 and `fe.key()`), else computed and cached (.npy and
    JSON, written to a temp dir and renamed, so a reader never sees half a cache entry)."""
    path = fsdd_archive(archive)
    sha = file_sha256(path)
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    entry = root / f"{sha[:16]}-{fe.key()}"
    cached = _read_cache(entry, fe, sha)
    if cached is not None:
        return cached
    utts = read_archive(path, fe.sample_rate, fe.min_samples)
    parts = [log_mel(u.samples, fe) for u in utts]
    offsets = np.zeros(len(parts) + 1, np.int64)
    offsets[1:] = np.cumsum([len(p) for p in parts])
    feats = SpeechFeatures(np.concatenate(parts), offsets, [u.name for u in utts],
                           np.array([u.digit for u in utts], np.int64), [u.speaker for u in utts],
                           np.array([u.index for u in utts], np.int64), fe, sha)
    log.info("speech: %d recordings -> %s frames of %d log-mel bins (%s)", len(utts), f"{offsets[-1]:,}",
             fe.n_mels, path.name)
    try:
        _write_cache(entry, feats)
    except OSError as e:  # a read-only home: go on without the cache
        log.warning("speech: cannot cache features in %s: %s", entry, e)
    return feats


def _write_cache(entry: Path, f: SpeechFeatures) -> None:
    """The entry written to a temp dir and renamed into place. An entry already there that reads
    back is another process's, written first: kept. One that does not (junk, half a copy, an
    older format) is moved aside and replaced; left alone, every run recomputed the features
    and left it there. Moving it aside is a rename too, so a reader sees the old entry, none, or
    a whole new one, and a second writer doing the same at once finds a whole entry either way."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=entry.parent))
    try:
        np.save(tmp / "frames.npy", f.frames)
        np.save(tmp / "offsets.npy", f.offsets)
        meta = {"format": CACHE_FORMAT, "archive_sha256": f.archive_sha256, "front_end": f.front_end.to_dict(),
                "names": f.names, "digits": f.digits.tolist(), "speakers": f.speakers,
                "indices": f.indices.tolist()}
        (tmp / "meta.json").write_text(json.dumps(meta))
        try:
            os.rename(tmp, entry)
        except OSError:
            if not entry.exists():
                raise
            if _read_cache(entry, f.front_end, f.archive_sha256) is not None:
                return  # another process cached it first
            _discard_entry(entry)
            try:
                os.rename(tmp, entry)
            except OSError:
                if _read_cache(entry, f.front_end, f.archive_sha256) is None:
                    raise
                # else another writer replaced it first, with a whole entry
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _discard_entry(entry: Path) -> None:
    """Move an unreadable cache entry aside (atomically) and delete it. Another writer may have
    moved it, or replaced it with a good one, in the meantime: then there is nothing to do here."""
    trash = Path(tempfile.mkdtemp(prefix=".old-", dir=entry.parent))
    try:
        os.rename(entry, trash / "entry")
        log.warning("speech: the feature cache entry %s was unreadable: replacing it", entry)
    except FileNotFoundError:
        pass
    finally:
        shutil.rmtree(trash, ignore_errors=True)


def _read_cache(entry: Path, fe: FrontEnd, sha: str) -> SpeechFeatures | None:
    try:
        meta = loads_json((entry / "meta.json").read_text())
        frames = np.load(entry / "frames.npy", allow_pickle=False)
        offsets = np.load(entry / "offsets.npy", allow_pickle=False)
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("format") != CACHE_FORMAT or meta.get("archive_sha256") != sha or \
            meta.get("front_end") != fe.to_dict() or not len(offsets) or offsets[-1] != len(frames):
        return None
    if frames.ndim != 2 or frames.shape[1] != fe.n_mels or frames.dtype.kind != "f" or offsets.ndim != 1 or \
            offsets.dtype.kind not in "iu" or np.any(np.diff(offsets) < 0) or offsets[0] != 0:
        return None  # frames of another width: a traceback from the model's first layer
    try:
        feats = SpeechFeatures(frames, offsets, meta["names"], np.array(meta["digits"], np.int64), meta["speakers"],
                               np.array(meta["indices"], np.int64), fe, sha)
    except (KeyError, TypeError, ValueError):
        return None
    counts = {len(feats.names), len(feats.digits), len(feats.speakers), len(feats.indices), len(offsets) - 1}
    return feats if len(counts) == 1 else None


# ---- the frozen recognizer -------------------------------------------------------------

def is_speech_model(model_dir: str | os.PathLike, version: str | None = None) -> bool:
    """Whether a model directory's `version` (default: CURRENT's) is a speech model (False
    when unreadable)."""
    try:
        return _version_manifest(Path(model_dir), version)[1].get("kind") == MODEL_KIND
    except (MarianaError, OSError, ValueError):  # ValueError: bytes not UTF-8, NUL bytes in CURRENT
        return False


def _version_manifest(model_dir: Path, version: str | None = None) -> tuple[Path, dict]:
    if version is None:
        try:
            version = (model_dir / "CURRENT").read_bytes().decode("utf-8", "replace").strip()
        except OSError:
            raise ModelDirError(f"{model_dir}: not a model directory (no CURRENT)") from None
    vdir = model_dir / version
    try:
        manifest = loads_json((vdir / "manifest.json").read_bytes())
    except (OSError, ValueError) as e:  # ValueError: not JSON, not UTF-8, a NUL in the version name
        raise ModelDirError(f"{vdir}: no readable manifest.json ({e})") from None
    if not isinstance(manifest, dict):
        raise ModelDirError(f"{vdir}/manifest.json: a JSON {type(manifest).__name__}, not an object")
    return vdir, manifest


class SpeechRecognizer:
    """A version of `mariana train speech`, frozen: int16 samples -> digit posteriors.

    The front-end's parameters come from the manifest and its DNN runs as the plain ops
    (standardise, linear, relu) that trainer/models/speech_dnn.frozen_ops wrote, over the
    version's weights: serving and the pipeline need no training code and load no pickle.
    """

    def __init__(self, manifest: dict, weights: dict, where: str = "speech model"):
        import torch
        if manifest.get("kind") != MODEL_KIND:
            raise ModelDirError(f"{where}: not a speech model (kind {manifest.get('kind')!r})")
        self.manifest = manifest
        front_end, ops = manifest.get("front_end"), manifest.get("ops")
        if not isinstance(front_end, dict) or not isinstance(ops, list) or not all(
                isinstance(op, dict) and all(isinstance(v, str) for v in op.values()) for op in ops):
            raise ModelDirError(f"{where}: the manifest's front_end must be a map and its ops a list of maps "
                                "naming their op and weights")
        try:
            self.front_end = FrontEnd.from_dict(front_end)
        except TypeError as e:
            raise ModelDirError(f"{where}: the manifest's front_end: {e}") from None
        self.ops = ops
        self.weights = weights
        known = {"standardise", "linear", "relu"}
        unknown = sorted({op.get("op") for op in self.ops} - known, key=str)
        named = {op[k] for op in self.ops for k in ("weight", "bias", "mean", "std") if k in op}
        missing = sorted(named - set(weights))
        if unknown or missing:
            raise ModelDirError(f"{where}: unknown ops {unknown} or missing weights {missing}")
        bad = finite.nonfinite(weights)
        if bad:
            raise ModelDirError(f"{where}: its weights hold {finite.describe(bad)}: a corrupt or diverged model, "
                                "not loaded")
        self._torch = torch
        dim, classes = self.front_end.input_dim, manifest.get("classes")
        try:  # one frame through the ops: weights of the wrong shapes fail here, not in every request
            out = self.logits(np.zeros((1, dim), np.float32))
        except (RuntimeError, TypeError, ValueError) as e:
            raise ModelDirError(f"{where}: its ops do not run on a frame of {dim} inputs: {e}") from None
        if out.ndim != 2 or (isinstance(classes, list) and out.shape[1] != len(classes)):
            raise ModelDirError(f"{where}: its ops give {tuple(out.shape)} for one frame, not (1, classes)")

    @classmethod
    def load(cls, model_dir: str | os.PathLike, version: str | None = None) -> "SpeechRecognizer":
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        vdir, manifest = _version_manifest(Path(model_dir), version)
        check_digests(vdir, manifest, ("weights.safetensors",))
        try:
            weights = load_file(str(vdir / "weights.safetensors"))
        except (OSError, SafetensorError) as e:
            raise ModelDirError(f"{vdir}: cannot read weights.safetensors: {e}") from None
        return cls(manifest, weights, str(vdir))

    def frames(self, samples: np.ndarray) -> np.ndarray:
        """(T, input_dim): the front-end's context windows of one recording."""
        return context_windows(log_mel(samples, self.front_end), self.front_end.context)

    def logits(self, frames: np.ndarray):
        torch, F = self._torch, self._torch.nn.functional
        x = torch.from_numpy(np.ascontiguousarray(frames, dtype=np.float32))
        w = self.weights
        with torch.inference_mode():
            for op in self.ops:
                if op["op"] == "standardise":
                    x = (x - w[op["mean"]]) / w[op["std"]]
                elif op["op"] == "linear":
                    x = F.linear(x, w[op["weight"]], w[op["bias"]])
                else:
                    x = F.relu(x)
        return x

    def posteriors(self, samples: np.ndarray) -> np.ndarray:
        """(classes,) float64: softmax over the digits of the summed frame log-posteriors."""
        torch = self._torch
        score = torch.log_softmax(self.logits(self.frames(samples)).double(), 1).sum(0)
        return torch.softmax(score, 0).numpy()

    def classify(self, samples: np.ndarray) -> int:
        return int(np.argmax(self.posteriors(samples)))

    def predict_wav(self, raw: bytes, name: str = "wav") -> dict:
        """A wav file's bytes -> {"digit", "posteriors"}; BadAudio when it is not mono 16-bit
        at the model's sample rate, shorter than the front end's two windows, or silent."""
        samples = read_wav(raw, name, self.front_end.sample_rate, self.front_end.min_samples)
        check_audible(samples, name)
        p = self.posteriors(samples)
        return {"digit": int(np.argmax(p)), "posteriors": [round(float(v), 6) for v in p]}
