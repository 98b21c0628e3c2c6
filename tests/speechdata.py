"""A small FSDD-like archive for fast speech tests: each digit two tones one
after the other (its own frequencies: a steady tone would vanish under the
front-end's per-utterance mean normalisation), each speaker a pitch shift, noise
on top; the names and wav format of the real set (mono, 16-bit, 8 kHz), so every
code path is the real one. The real archive is used where accuracy matters."""
from __future__ import annotations

import io
import tarfile
import wave
from pathlib import Path

import numpy as np


def wav_bytes(samples: np.ndarray, rate: int = 8000, width: int = 2, channels: int = 1) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        if width == 2:
            w.writeframes(np.repeat(samples.astype("<i2"), channels).tobytes())
        else:
            w.writeframes(np.repeat((samples // 256 + 128).astype(np.uint8), channels).tobytes())
    return buf.getvalue()


def tone(digit: int, speaker: int, index: int, rate: int = 8000) -> np.ndarray:
    rng = np.random.default_rng(digit * 1000 + speaker * 100 + index)
    n = int(rate * rng.uniform(0.3, 0.5))
    t = np.arange(n) / rate
    shift = 1.0 + 0.04 * speaker
    f1, f2 = (300 + 150 * digit) * shift, (3000 - 220 * digit) * shift
    f = np.where(t < t[-1] / 2, f1, f2)
    x = np.sin(2 * np.pi * np.cumsum(f) / rate) + 0.3 * rng.standard_normal(n)
    return (6000 * x * np.hanning(n)).astype(np.int16)


def write_archive(path: Path, speakers=("ann", "bob"), indices=range(10), extra: dict[str, bytes] | None = None) -> Path:
    """recordings/{digit}_{speaker}_{index}.wav for every digit, speaker and index, as a .tar.gz;
    `extra` adds members by name (e.g. a wav of the wrong rate)."""
    with tarfile.open(path, "w:gz") as tar:
        members = {f"recordings/{d}_{s}_{i}.wav": wav_bytes(tone(d, k, i))
                   for d in range(10) for k, s in enumerate(speakers) for i in indices}
        members.update(extra or {})
        for name, raw in sorted(members.items()):
            info = tarfile.TarInfo(name)
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    return path
