"""Hostile image files an exploratory run found (2026-11-29): names that are not UTF-8, a .npy
header that promises a terabyte, a JPEG of a thousand scans, a gzip-bombed IDX file, phone
JPEGs (MPO) refused, and class entries that are broken symlinks dropped without a word. Each
file is built here, small; each is counted and skipped (or read) with its name, never a crash."""
from __future__ import annotations

import gzip
import io
import json
import os
import time
import tracemalloc
import zlib

import numpy as np
import pytest
from PIL import Image

from mariana.featurizer.idx import BadImage, load_npy
from mariana.featurizer.image import MAX_JPEG_SCANS, decode_encoded
from tests.unit.test_image_faults import _creatives


def _png(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, "PNG")
    return buf.getvalue()


def _folder(root, classes=("a", "b")):
    for cls in classes:
        (root / cls).mkdir(parents=True)
        (root / cls / "1.png").write_bytes(_png(np.full((28, 28), 7, np.uint8)))
    return root


def _write(directory, name: bytes, raw: bytes) -> None:
    with open(os.path.join(os.fsencode(directory), name), "wb") as f:
        f.write(raw)


# ---- 1. names that are not UTF-8 ------------------------------------------------------------------

def test_an_image_folder_with_a_name_that_is_not_utf8_reads_it_and_names_a_bad_one_printably(tmp_path):
    """b'caf\\xe9.png' in a class folder stopped the job with UnicodeEncodeError ('surrogates not
    allowed') where the listing's digest encoded the names."""
    from mariana.featurizer.image_folder import load_image_folder

    root = _folder(tmp_path / "imgs")
    _write(root / "a", b"caf\xe9.png", _png(np.full((28, 28), 200, np.uint8)))
    _write(root / "b", b"bad\xff.png", b"not an image")
    data = load_image_folder(root)
    assert len(data.images) == 3 and data.source["skipped"] == 1
    assert data.source["first_skipped"] == ["b/bad\\xff.png: not an image file Pillow can read"]
    assert sorted(int(img.max()) for img in data.images[:]) == [7, 7, 200]
    json.dumps(data.source, ensure_ascii=False).encode()  # a record written as UTF-8


def test_uploads_named_in_bytes_that_are_not_utf8_are_creatives_and_bad_ones_are_named_printably(tmp_path):
    """b'caf\\xe9.png' in uploads/ stopped the job with UnicodeEncodeError where its id was made with
    `stem.encode()`; a bad upload of such a name could not be shown either."""
    from mariana.trainer.images import load_creative_set

    up = _creatives(tmp_path / "c")
    _write(up, b"caf\xe9.png", _png(np.full((28, 28), 9, np.uint8)))
    _write(up, b"bad\xff.png", b"not an image")
    cset = load_creative_set(str(tmp_path / "c"))
    assert cset.ids == [b"c0", b"c1", b"caf\xe9"] and cset.images[2].max() == 9
    assert cset.corrupt == ["bad\\xff.png: not an image file Pillow can read (PNG, JPEG, GIF, BMP or WebP)"]
    "; ".join(cset.corrupt).encode()


# ---- 2. a .npy whose header promises more than the file holds ---------------------------------------

def _lying_npy(path, shape) -> None:
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "|u1", "fortran_order": False, "shape": shape})
        f.write(bytes(784))


def test_a_npy_upload_whose_header_claims_a_terabyte_is_counted_and_named(tmp_path):
    """A 912-byte .npy whose header said (10**6, 10**6) made np.load raise MemoryError, which
    stopped the whole job with the generic out-of-memory advice, naming no file."""
    from mariana.trainer.images import load_creative_set

    up = _creatives(tmp_path / "c")
    _lying_npy(up / "huge.npy", (10**6, 10**6))
    _lying_npy(up / "short.npy", (2, 28, 28))
    np.save(up / "ok.npy", np.full((28, 28), 5, np.uint8))
    cset = load_creative_set(str(tmp_path / "c"))
    assert cset.ids == [b"c0", b"c1", b"ok"] and cset.images[2].max() == 5
    assert cset.corrupt == [
        "huge.npy: header says (1000000, 1000000) uint8 = 1,000,000,000,000 bytes of data, the file holds 784 "
        "(truncated or corrupt)",
        "short.npy: header says (2, 28, 28) uint8 = 1,568 bytes of data, the file holds 784 (truncated or corrupt)"]


def test_load_npy_refuses_a_lying_header_and_objects_naming_the_file(tmp_path):
    """What `featurize --images x.npy` needs: the same header that was a MemoryError is one
    BadImage (a MarianaError: one line, exit 2) naming the file."""
    _lying_npy(tmp_path / "x.npy", (10**6, 10**6))
    with pytest.raises(BadImage, match=r"^x.npy: header says \(1000000, 1000000\) uint8 = 1,000,000,000,000 bytes"):
        load_npy(tmp_path / "x.npy")
    np.save(tmp_path / "o.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(BadImage, match="^o.npy: not a readable .npy"):
        load_npy(tmp_path / "o.npy")
    np.save(tmp_path / "ok.npy", np.arange(6, dtype=np.uint8).reshape(2, 3))
    assert load_npy(tmp_path / "ok.npy").tolist() == [[0, 1, 2], [3, 4, 5]]
    # `mariana featurize --images x.npy` and a creatives dir's images.npy read through it: both said
    # "out of memory (a training job: lower hashing.bits ...)" and named no file
    from mariana.featurizer.creatives import IMAGES_FILE, META_FILE, load_creatives
    from mariana.services.images_cli import read_images
    from mariana.sparse.errors import DataFormatError, MarianaError

    with pytest.raises(MarianaError, match=r"x.npy: not a plain .npy array of images \(header says \(1000000, "):
        read_images(str(tmp_path / "x.npy"))
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / META_FILE).write_text('{"ids": ["a"]}')
    _lying_npy(tmp_path / "c" / IMAGES_FILE, (10**6, 28, 28))
    with pytest.raises(DataFormatError, match=r"unreadable creatives: creatives.npy: header says \(1000000, 28, 28\)"):
        load_creatives(tmp_path / "c")


# ---- 3. a progressive JPEG of many scans --------------------------------------------------------------

def _scan_bomb(extra: int) -> bytes:
    """A small progressive JPEG with its last scan repeated `extra` times (each scan is one more
    full pass of the decoder; this is the tester's scanbomb.py, smaller)."""
    buf = io.BytesIO()
    Image.new("L", (64, 64), 90).save(buf, "JPEG", progressive=True, quality=90)
    raw = buf.getvalue()
    last = raw.rindex(b"\xff\xda")
    return raw[:-2] + raw[last:-2] * extra + raw[-2:]  # the scan (its header and data) again, then EOI


def test_a_jpeg_of_more_scans_than_the_bound_is_refused_naming_the_count(tmp_path):
    """A 200 KB progressive JPEG with 1,000 repeated scans took ~40 s a decode, and an image
    folder decoded it again every epoch; it now is refused before it is decoded."""
    from mariana.trainer.images import load_creative_set

    bomb = _scan_bomb(MAX_JPEG_SCANS)
    scans = bomb.count(b"\xff\xda")
    assert decode_encoded(_scan_bomb(1), "ok.jpg").max() > 0  # a normal progressive JPEG still decodes
    t0 = time.perf_counter()
    with pytest.raises(BadImage, match=f"^bomb.jpg: a JPEG of {scans} scans, over the {MAX_JPEG_SCANS} allowed"):
        decode_encoded(bomb, "bomb.jpg")
    assert time.perf_counter() - t0 < 0.5
    up = _creatives(tmp_path / "c")
    (up / "bomb.jpg").write_bytes(bomb)
    cset = load_creative_set(str(tmp_path / "c"))
    assert cset.ids == [b"c0", b"c1"] and cset.corrupt[0].startswith(f"bomb.jpg: a JPEG of {scans} scans")


# ---- 4. a gzip-bombed IDX file ----------------------------------------------------------------------

def test_a_gzip_bombed_idx_file_is_refused_without_inflating_it(tmp_path):
    """A 1 MB .gz holding 1 GiB behind a (1, 28, 28) header was inflated whole (2.4 GB peak)
    before its size was found wrong; now at most the header's bytes and one more are read."""
    from mariana.featurizer.idx import IdxFormatError, read_idx

    path = tmp_path / "bomb-images-idx3-ubyte.gz"
    z = zlib.compressobj(1, zlib.DEFLATED, 31)  # 31: a gzip stream
    with open(path, "wb") as f:
        f.write(z.compress(bytes([0, 0, 8, 3]) + np.array([1, 28, 28], ">u4").tobytes() + bytes(784)))
        zeros = bytes(1 << 20)
        for _ in range(64):  # 64 MiB more than the header says
            f.write(z.compress(zeros))
        f.write(z.flush())
    tracemalloc.start()  # bytes objects are traced: the whole stream read at once was 64 MiB of them
    try:
        with pytest.raises(IdxFormatError) as e:
            read_idx(path, ndim=3)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak / 2**20:.0f} MiB held to refuse a (1, 28, 28) IDX file"
    assert str(e.value) == (f"{path}: header says (1, 28, 28) = 784 bytes of data, the file holds more than 784 "
                            "(truncated or corrupt)")
    ok = tmp_path / "ok.gz"
    ok.write_bytes(gzip.compress(bytes([0, 0, 8, 1]) + np.array([3], ">u4").tobytes() + b"\1\2\3"))
    assert read_idx(ok).tolist() == [1, 2, 3]


# ---- 5. phone JPEGs (MPO) -------------------------------------------------------------------------

def _mpo() -> bytes:
    im = Image.new("RGB", (60, 40), (10, 200, 30))
    buf = io.BytesIO()
    im.save(buf, "MPO", save_all=True, append_images=[Image.new("RGB", (60, 40), (0, 0, 0))])
    return buf.getvalue()


def test_a_jpeg_with_a_multi_picture_block_is_read_as_the_jpeg_it_is(tmp_path):
    """A phone's JPEG with an MPF block (Pillow: format "MPO") was refused as "a MPO image" in
    uploads and left out of image folders; its first frame is the photo."""
    from mariana.featurizer.image_folder import load_image_folder
    from mariana.trainer.images import load_creative_set

    raw = _mpo()
    assert Image.open(io.BytesIO(raw)).format == "MPO"
    img = decode_encoded(raw, "phone.jpg")
    assert abs(int(img[14, 14]) - 124) <= 2  # the green frame's luma (0.299*10 + 0.587*200 + 0.114*30), not black
    up = _creatives(tmp_path / "c")
    (up / "phone.jpg").write_bytes(raw)
    cset = load_creative_set(str(tmp_path / "c"))
    assert cset.ids == [b"c0", b"c1", b"phone"] and cset.corrupt == []
    root = _folder(tmp_path / "imgs")
    (root / "a" / "phone.jpg").write_bytes(raw)
    data = load_image_folder(root)
    assert len(data.images) == 3 and data.source["skipped"] == 0


# ---- 6. class entries that are broken symlinks -------------------------------------------------------

def test_a_class_entry_that_is_a_broken_symlink_or_a_loop_keeps_its_label_and_is_named(tmp_path):
    """`ln -s /nonexistent DIR/1-ring` (or a symlink loop) was dropped without a word: exit 0,
    `skipped: 0`, and every later class's label one lower than its folder's position."""
    from mariana.featurizer.image_folder import load_image_folder

    root = _folder(tmp_path / "imgs", ("0-disc", "3-square"))
    os.symlink(tmp_path / "nonexistent", root / "1-ring")
    os.symlink("2-loop", root / "2-loop")
    data = load_image_folder(root)
    src = data.source
    assert src["classes"] == ["0-disc", "1-ring", "2-loop", "3-square"] and src["per_class"] == [1, 0, 0, 1]
    assert data.labels.tolist() == [0, 3]
    assert src["skipped"] == 2, src["first_skipped"]
    ring, loop = src["first_skipped"]
    assert ring == (f"1-ring/: a symlink to {tmp_path / 'nonexistent'} that leads to no directory (No such file or "
                    "directory); kept as a class with no images, so the classes after it keep their labels")
    assert loop.startswith("2-loop/: a symlink to 2-loop that leads to no directory (Too many levels of symbolic")
