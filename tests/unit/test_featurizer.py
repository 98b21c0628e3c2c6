"""The image featurizer (issue 6): IDX reading, image checks, the frozen CNN's
determinism, creative lookups with their fallback, and the ads-with-images data."""
from __future__ import annotations

import gzip
import json
import struct
import zlib

import numpy as np
import pyarrow as pa
import pytest
import torch

from mariana.featurizer.creatives import CreativeFeatures, ImageFeatureEncoder
from mariana.featurizer.idx import IdxFormatError, read_idx, write_idx
from mariana.featurizer.image import BadImage, ImageFeaturizer, decode_image, stack_images
from mariana.sparse.encode import Encoder
from mariana.sparse.errors import ModelDirError
from mariana.sparse.hashing import HashSpec
from mariana.sparse.parse import Chunk
from mariana.sparse.schema import criteo


@pytest.fixture(scope="session")
def mnist(mnist_dir):
    from mariana.featurizer.image import load_mnist

    return load_mnist(mnist_dir)


@pytest.fixture(scope="session")
def featurizer_dir(small_featurizer):
    return small_featurizer


# ---- IDX -------------------------------------------------------------------------------

def test_idx_round_trip_gz_and_plain(tmp_path):
    a = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    for name in ("a.idx", "a.idx.gz"):
        write_idx(tmp_path / name, a)
        assert np.array_equal(read_idx(tmp_path / name, ndim=3), a)


def test_idx_rejects_corrupt_files_naming_them(tmp_path):
    a = np.zeros((3, 28, 28), np.uint8)
    write_idx(tmp_path / "ok.idx", a)
    body = (tmp_path / "ok.idx").read_bytes()
    cases = {
        "short.idx": (body[:-5], "truncated or corrupt"),
        "long.idx": (body + b"\0", "truncated or corrupt"),
        "magic.idx": (b"\x08\x03" + body[2:], "bad magic"),
        "dtype.idx": (body[:2] + b"\x0d" + body[3:], "only uint8"),
        "header.idx": (body[:6], "truncated IDX header"),
        "gz.idx.gz": (gzip.compress(body)[:-20], "corrupt gzip"),
    }
    for name, (raw, why) in cases.items():
        (tmp_path / name).write_bytes(raw)
        with pytest.raises(IdxFormatError, match=why) as e:
            read_idx(tmp_path / name)
        assert name in str(e.value)
    with pytest.raises(IdxFormatError, match="expected 1"):
        read_idx(tmp_path / "ok.idx", ndim=1)


# ---- images ------------------------------------------------------------------------------

def test_bad_images_are_rejected_with_their_name(featurizer_dir):
    f = ImageFeaturizer.load(featurizer_dir)
    with pytest.raises(BadImage, match="images: expected uint8 pixels, got float32"):
        f.embed(np.zeros((2, 28, 28), np.float32))
    with pytest.raises(BadImage, match=r"expected shape \(N, 28, 28\), got \(2, 28, 27\)"):
        f.embed(np.zeros((2, 28, 27), np.uint8))
    good, keep, bad = stack_images([bytes(784), bytes(783), np.zeros((28, 28), np.uint8), np.zeros((3, 3), np.uint8),
                                    np.zeros((3, 28, 28), np.uint8)], ["c1", "c2", "c3", "c4", "c5"])
    assert good.shape == (2, 28, 28) and keep == [0, 2]
    assert bad[0].startswith("c2: 783 bytes")
    assert bad[1] == "c4: expected one 28x28 image (shape (28, 28)), got shape (3, 3)"
    assert bad[2].endswith("got shape (3, 28, 28)")  # three images in one upload: the first was taken, unsaid
    with pytest.raises(BadImage, match="creative 9: expected uint8"):
        decode_image(np.zeros((28, 28), np.int64), "creative 9")


def _encoded(img, fmt: str, **kw) -> bytes:
    import io

    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def test_image_files_decode_to_the_featurizer_s_grey_28x28(mnist):
    from PIL import Image

    from mariana.featurizer.image import decode_encoded
    digit = mnist.images[5]
    assert np.array_equal(decode_encoded(_encoded(Image.fromarray(digit), "PNG"), "d.png"), digit)  # lossless
    big = Image.fromarray(digit).resize((280, 280), Image.Resampling.NEAREST).convert("RGB")
    for fmt in ("PNG", "JPEG", "WEBP", "BMP", "GIF"):  # 10x the size, in colour: scaled back within a few levels
        back = decode_encoded(_encoded(big, fmt), f"d.{fmt.lower()}")
        assert back.shape == (28, 28) and back.dtype == np.uint8
        assert np.abs(back.astype(int) - digit).mean() < 6, fmt
    banner = Image.new("RGB", (300, 100), (200, 30, 30))  # letterboxed: 28 x 9, centred on black
    grey = decode_encoded(_encoded(banner, "PNG"), "banner.png")
    assert grey[:9].max() == 0 and grey[19:].max() == 0 and (grey[10:18] == round(0.299 * 200 + 0.587 * 30
                                                                                   + 0.114 * 30)).all()
    clear = Image.new("RGBA", (28, 28), (255, 255, 255, 0))  # transparent: black
    assert decode_encoded(_encoded(clear, "PNG"), "clear.png").max() == 0
    for w, h, rows in ((728, 90, 3), (5000, 250, 1), (300, 250, 23)):  # big banners keep their proportions
        banner = decode_encoded(_encoded(Image.new("RGB", (w, h), (255, 255, 255)), "PNG"), "banner.png")
        assert (banner.max(1) > 0).sum() == rows and (banner.max(0) > 0).sum() == 28, (w, h)
    half = Image.new("RGBA", (300, 300), (255, 255, 255, 255))  # big (box-averaged first), its top half clear
    half.paste((255, 255, 255, 0), (0, 0, 300, 150))
    grey = decode_encoded(_encoded(half, "PNG"), "half.png")
    assert grey[:11].max() == 0 and grey[17:].min() == 255 and 0 < grey[13].mean() < 255  # Lanczos rings 1 level
    for mode, key, value in [("RGB", (255, 255, 255), (255, 255, 255)), ("L", 200, 200)]:
        keyed = Image.new(mode, (28, 28), value)  # a PNG's transparent colour (tRNS), no alpha channel: black
        assert decode_encoded(_encoded(keyed, "PNG", transparency=key), "keyed.png").max() == 0, mode
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: stored turned 90 degrees; a 60x20 banner is a 20x60 portrait upright
    upright = decode_encoded(_encoded(Image.new("L", (60, 20), 255), "JPEG", exif=exif.tobytes()), "phone.jpg")
    assert upright[:, :8].max() == 0 and upright[:, 11:17].min() > 200 and upright[0, 14] > 200
    deep = np.full((28, 28), 100, np.uint16)  # 16-bit grey: its top 8 bits (convert("L") clips to 255)
    deep[:14] = 40000
    back = decode_encoded(_encoded(Image.fromarray(deep), "PNG"), "deep.png")
    assert (back[:14] == 40000 >> 8).all() and (back[14:] == 0).all()
    deep[14:] = 50000  # ... and its transparent level, given in 16 bits
    back = decode_encoded(_encoded(Image.fromarray(deep), "PNG", transparency=50000), "deep.png")
    assert (back[:14] == 40000 >> 8).all() and (back[14:] == 0).all()
    for bits in (1, 2, 4):  # few-bit grey: Pillow scales the pixels to 0-255, the key stays at the file's depth
        white = png_grey((1 << bits) - 1, bits, transparent=(1 << bits) - 1)
        assert decode_encoded(white, "few.png").max() == 0, bits
    assert decode_encoded(png_grey(3, 2, transparent=0), "x").min() == 255
    rgb16 = np.full((28, 28, 3), 60000, ">u2")  # 16-bit RGB (Pillow reads its top bytes), key in 16 bits
    rgb16[:14] = (30000, 20000, 10000)
    back = decode_encoded(png_rgb16(rgb16, transparent=(60000, 60000, 60000)), "rgb16.png")
    assert back[:14].min() > 0 and back[14:].max() == 0
    whole = _encoded(big, "PNG")
    for raw, says in [(b"", "an empty file"), (b"<svg/>", "not an image file Pillow can read"),
                      (whole[:len(whole) // 2], "truncated or damaged"),
                      (_encoded(Image.new("L", (8, 8)), "TIFF"), "a TIFF image; uploads are PNG"),
                      (png_header(20_000, 10_000), "over the 40,000,000 pixels allowed")]:  # past Pillow's own bound
        with pytest.raises(BadImage, match=says):
            decode_encoded(raw, "x")


def png_rgb16(pixels: np.ndarray, transparent: tuple[int, int, int]) -> bytes:
    """A 16-bit RGB PNG ((H, W, 3) big-endian) with a tRNS colour: Pillow cannot write one."""
    h, w, _ = pixels.shape
    rows = b"".join(b"\0" + pixels[r].tobytes() for r in range(h))
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, 2, 0, 0, 0))
            + _png_chunk(b"tRNS", struct.pack(">HHH", *transparent)) + _png_chunk(b"IDAT", zlib.compress(rows))
            + _png_chunk(b"IEND", b""))


def png_grey(value: int, bits: int, transparent: int, side: int = 28) -> bytes:
    """A square `bits`-deep grey PNG of one `value` with a tRNS level: written here, since
    Pillow before 13 writes its "L" images 8 bits deep whatever `bits` asks."""
    per_byte = 8 // bits
    byte = sum(value << (8 - bits * (k + 1)) for k in range(per_byte))
    rows = (b"\0" + bytes([byte]) * -(-side // per_byte)) * side
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, bits, 0, 0, 0, 0))
            + _png_chunk(b"tRNS", struct.pack(">H", transparent)) + _png_chunk(b"IDAT", zlib.compress(rows))
            + _png_chunk(b"IEND", b""))


def png_header(width: int, height: int) -> bytes:
    """A PNG's signature, IHDR (8-bit grey) saying `width` x `height`, and IEND: no pixels."""
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)) \
        + _png_chunk(b"IEND", b"")


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def test_uploads_of_image_files_join_the_creatives_and_other_files_are_counted(mnist, tmp_path):
    from PIL import Image

    from mariana.sparse.errors import ConfigError
    from mariana.trainer.images import load_creative_set
    d = tmp_path / "creatives"
    (d / "uploads").mkdir(parents=True)
    np.save(d / "creatives.npy", mnist.images[:3])
    (d / "creatives.json").write_text(json.dumps({"ids": ["a", "b", "c"]}))
    up = d / "uploads"
    (up / "p1.png").write_bytes(_encoded(Image.fromarray(mnist.images[7]), "PNG"))
    (up / "j1.JPG").write_bytes(_encoded(Image.new("RGB", (300, 250), (90, 90, 90)), "JPEG"))
    (up / "r1.raw").write_bytes(mnist.images[8].tobytes())
    (up / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(20))
    (up / "notes.txt").write_text("what these ads are")  # no image: counted, not silently passed over
    (up / ".DS_Store").write_bytes(b"x")                  # hidden: left alone
    cset = load_creative_set(str(d))
    assert cset.ids == [b"a", b"b", b"c", b"j1", b"p1", b"r1"]
    assert np.array_equal(cset.images[4], mnist.images[7]) and np.array_equal(cset.images[5], mnist.images[8])
    assert cset.images[3].shape == (28, 28) and cset.images[3][14, 14] == 90 and cset.images[3][0].max() == 0
    assert len(cset.corrupt) == 2 and cset.corrupt[0].startswith("bad.png: not")
    assert cset.corrupt[1].startswith("notes.txt: not an upload kind (.raw, .npy, .png")
    (up / "p1.jpg").write_bytes(_encoded(Image.fromarray(mnist.images[9]), "JPEG"))
    with pytest.raises(ConfigError, match="several uploads name creative p1"):
        load_creative_set(str(d))


def test_an_image_folder_lists_its_classes_in_name_order_and_refuses_what_is_no_set(tmp_path, mnist):
    from PIL import Image

    from mariana.featurizer.image_folder import is_image_folder, load_image_folder
    from mariana.sparse.errors import DataFormatError
    d = tmp_path / "f"
    for cls, names in {"cats": ["b.png", "d.jpg"], "dogs": ["a.png", "c.gif"]}.items():
        (d / cls).mkdir(parents=True)
        for k, name in enumerate(names):
            Image.fromarray(mnist.images[k]).save(d / cls / name)
    data = load_image_folder(d, size=28)
    assert is_image_folder(d) and not is_image_folder(d / "cats")
    assert data.source["classes"] == ["cats", "dogs"] and data.labels.tolist() == [1, 0, 1, 0]  # a, b, c, d
    assert data.images.shape == (4, 28, 28) and np.array_equal(data.images[1], mnist.images[0])
    assert np.array_equal(data.images[[0, 1]], np.stack([mnist.images[0], mnist.images[0]]))
    data.images.size = 14
    assert data.images[2:].shape == (2, 14, 14)
    (d / "cats" / "huge.png").write_bytes(png_header(20_000, 10_000))  # Pillow refuses it at open: skipped, named
    assert load_image_folder(d).source["first_skipped"] == ["cats/huge.png: over the 40,000,000 pixels allowed"]
    sizes = tmp_path / "sizes"
    for cls, name, side in [("a", "z.png", 28), ("b", "a.png", 64)]:
        (sizes / cls).mkdir(parents=True)
        Image.new("L", (side, side)).save(sizes / cls / name)
    assert load_image_folder(sizes).source["first_image_size"] == [64, 64]  # b/a.png: first in the set's order
    with pytest.raises(DataFormatError, match="1 class directories; an image folder needs"):
        load_image_folder(_only(d, "cats"), size=28)
    (tmp_path / "e" / "x").mkdir(parents=True)
    (tmp_path / "e" / "y").mkdir()
    (tmp_path / "e" / "y" / "n.txt").write_text("no")
    with pytest.raises(DataFormatError, match="no readable image in its 2 class directories"):
        load_image_folder(tmp_path / "e")
    with pytest.raises(DataFormatError, match="no such directory"):
        load_image_folder(tmp_path / "nothing")


def _only(d, cls):
    import shutil
    one = d.parent / f"only-{cls}"
    shutil.copytree(d / cls, one / cls)
    return one


def test_featurizer_load_errors_name_the_dir(tmp_path, featurizer_dir):
    with pytest.raises(ModelDirError, match="no featurizer here"):
        ImageFeaturizer.load(tmp_path)
    clicks = tmp_path / "clicks"  # a click model's dir: the hint said to train a featurizer into it (refused)
    (clicks / "v000001").mkdir(parents=True)
    (clicks / "CURRENT").write_text("v000001\n")
    with pytest.raises(ModelDirError, match="clicks: a model directory \\(versions of a click or speech model\\), "
                                            "not a featurizer"):
        ImageFeaturizer.load(clicks)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "manifest.json").write_text((featurizer_dir / "manifest.json").read_text())
    (broken / "weights.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ModelDirError, match="cannot read weights.safetensors"):
        ImageFeaturizer.load(broken)


def test_embed_is_deterministic_across_calls_and_batch_sizes(featurizer_dir, mnist):
    f = ImageFeaturizer.load(featurizer_dir)
    images = mnist.images[:120]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the promise is per thread count (16 threads split a batch's work otherwise)
    try:
        full = f.embed(images)
        assert full.shape == (120, f.dim) and full.dtype == np.float32
        assert np.array_equal(f.embed(images), full)
        for bs in (1, 7, 64):
            parts = np.concatenate([f.embed(images[i:i + bs], batch_size=bs) for i in range(0, len(images), bs)])
            assert np.array_equal(parts, full), bs
        assert np.array_equal(ImageFeaturizer.load(featurizer_dir).embed(images[5:6]), full[5:6])  # a fresh load
        torch.set_num_threads(1)  # another thread count: float32 rounding apart at most
        assert np.allclose(f.embed(images), full, rtol=0, atol=1e-5)
    finally:
        torch.set_num_threads(threads)


def test_frozen_ops_compute_what_the_module_computes(featurizer_dir, mnist):
    """The exported op list and trainer/models/image_cnn.py are the same network."""
    from mariana.featurizer.image import to_input
    from mariana.trainer.models.image_cnn import ImageCNN, ImageCNNConfig

    f = ImageFeaturizer.load(featurizer_dir)
    model = ImageCNN(ImageCNNConfig.from_dict(f.manifest["cnn"])).eval()
    model.load_state_dict({k: v for k, v in f.weights.items() if not k.startswith("output.")})
    x = to_input(mnist.images[:64], f.pixel_mean, f.pixel_std)
    with torch.inference_mode():
        want = ((model.embed_features(x) - f.out_mean) / f.out_std).numpy()
        assert np.array_equal(f.classify(mnist.images[:64]), model(x).argmax(1).numpy())
    assert np.array_equal(f.embed(mnist.images[:64]), want)


# ---- creatives -----------------------------------------------------------------------------

def test_unknown_creative_gets_the_fallback_and_is_counted():
    feats = np.array([[1, 2], [3, 4]], np.float32)
    table = CreativeFeatures([b"0000000a", b"0000000b"], feats)
    col = pa.array([b"0000000b", b"ffffffff", None, b"0000000a"], pa.binary())
    out = table.lookup(col)
    assert out.tolist() == [[3, 4, 0], [0, 0, 1], [0, 0, 1], [1, 2, 0]]
    assert table.counts() == {"lookups": 4, "unknown": 2}
    again = CreativeFeatures.from_arrays(table.to_arrays())
    assert again.ids == table.ids and np.array_equal(again.table, table.table)


def test_encoder_puts_creative_features_in_the_dense_block():
    """The file path (pyarrow columns) and the request path (lists of bytes) get the same dense block."""
    schema, spec = criteo(), HashSpec(bits=16, numeric="both")
    table = CreativeFeatures([b"c1", b"c2"], np.array([[0.5], [-0.5]], np.float32))
    enc = ImageFeatureEncoder(Encoder(schema, spec), table, "C26")
    rows = 3
    cols = {f"I{i}": np.array([1.0, np.nan, 3.0]) for i in range(1, 14)}
    cats = {f"C{i}": [b"x", b"y", b""] for i in range(1, 26)} | {"C26": [b"c2", b"zz", b"c1"]}
    chunk = Chunk({**cols, **{k: pa.array(v, pa.binary()) for k, v in cats.items()}}, None, rows)
    batch = enc.encode(chunk)
    assert batch.dense.shape == (rows, 13 + 2) and enc.dense_dim == 15
    assert batch.dense[:, 13:].tolist() == [[-0.5, 0.0], [0.0, 1.0], [0.5, 0.0]]
    by_rows = enc.encode_rows(Chunk({**cols, **cats}, None, rows))
    assert np.array_equal(by_rows.dense, batch.dense) and np.array_equal(by_rows.ids, batch.ids)
    assert table.counts() == {"lookups": 6, "unknown": 2}


# ---- ads-with-images data ---------------------------------------------------------------------

def test_gen_ads_with_images_is_deterministic_for_a_seed(mnist, tmp_path):
    from mariana.featurizer.ads import AdsSpec, generate_ads_with_images
    from mariana.featurizer.creatives import load_creatives

    spec = AdsSpec(rows=3000, seed=4, creatives=300)
    a = generate_ads_with_images(tmp_path / "a", spec, mnist.source["dir"])
    generate_ads_with_images(tmp_path / "b", spec, mnist.source["dir"])
    generate_ads_with_images(tmp_path / "c", AdsSpec(rows=3000, seed=5, creatives=300), mnist.source["dir"])
    for name in ("train.tsv", "test.tsv", "creatives/creatives.npy", "creatives/creatives.json", "planted.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert (tmp_path / "a" / "train.tsv").read_bytes() != (tmp_path / "c" / "train.tsv").read_bytes()
    ids, images, meta = load_creatives(tmp_path / "a" / "creatives")
    assert images.shape == (300, 28, 28) and len(ids) == 300 and meta["field"] == "C26"
    lines = (tmp_path / "a" / "train.tsv").read_text().splitlines()
    assert len(lines) == 3000 and all(len(line.split("\t")) == 40 for line in lines[:50])
    assert {line.split("\t")[-1].encode() for line in lines} <= set(ids)
    new = {i for i, n in zip(ids, meta["new"]) if n}
    assert not new & {line.split("\t")[-1].encode() for line in lines}   # new creatives: test rows only
    assert a["test"]["rows_with_new_creative"] > 0 and 0.15 < a["train"]["ctr"] < 0.3


def test_gen_ads_with_images_refuses_images_it_cannot_use_naming_why(tmp_path):
    """64x64 images were written as creatives every reader refused; 10 images said "test split
    of 2000 images out of 10"."""
    from mariana.featurizer.ads import AdsSpec, generate_ads_with_images
    from mariana.featurizer.idx import write_idx

    for name, n, size, says in (("big", 2100, 32, "32x32 images; ads' creatives are 28x28"),
                                ("few", 10, 28, "10 images; the creatives are drawn from the 2,000 held out")):
        (tmp_path / name).mkdir()
        write_idx(tmp_path / name / "t10k-images-idx3-ubyte.gz", np.zeros((n, size, size), np.uint8))
        write_idx(tmp_path / name / "t10k-labels-idx1-ubyte.gz", np.zeros(n, np.uint8))
        with pytest.raises(ValueError, match=says):
            generate_ads_with_images(tmp_path / "out", AdsSpec(rows=100), tmp_path / name)
        assert not (tmp_path / "out").exists()


# ---- export -----------------------------------------------------------------------------------

def test_write_featurizer_replaces_the_dir_whole_and_leaves_nothing_beside_it(tmp_path):
    from mariana.trainer.featurizer_train import write_featurizer

    out = tmp_path / "f"
    write_featurizer(out, {"dim": 1}, {"w": torch.zeros(2)})
    write_featurizer(out, {"dim": 2}, {"w": torch.ones(3)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]  # no temp dir, no old one set aside
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "weights.safetensors"]
    assert '"dim": 2' in (out / "manifest.json").read_text()


def test_publish_dir_leaves_a_dir_that_another_writer_put_there_first(tmp_path):
    from mariana.trainer.checkpoint import publish_dir

    mine, theirs = tmp_path / ".tmp-mine", tmp_path / "v1"
    for d, text in ((mine, "mine"), (theirs, "theirs")):
        d.mkdir()
        (d / "a").write_text(text)
    assert not publish_dir(mine, theirs)
    assert (theirs / "a").read_text() == "theirs" and (mine / "a").read_text() == "mine"
    assert publish_dir(mine, tmp_path / "v2") and (tmp_path / "v2" / "a").read_text() == "mine"
    assert publish_dir(tmp_path / "v2", theirs, replace=True) and (theirs / "a").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1"]


def test_the_cnn_takes_any_number_of_blocks_and_keeps_the_featurizers_names():
    from mariana.trainer.models.image_cnn import ImageCNN, ImageCNNConfig, frozen_ops

    # the MNIST featurizer's layout, pinned: exported featurizers name these weights and ops
    default = ImageCNN(ImageCNNConfig())
    assert {k: tuple(v.shape) for k, v in default.state_dict().items()} == {
        "conv1.0.weight": (16, 1, 3, 3), "conv1.0.bias": (16,), "conv2.0.weight": (32, 16, 3, 3),
        "conv2.0.bias": (32,), "embed.1.weight": (32, 1568), "embed.1.bias": (32,), "head.weight": (10, 32),
        "head.bias": (10,)}
    assert frozen_ops(default)[0] == {"op": "conv2d", "weight": "conv1.0.weight", "bias": "conv1.0.bias",
                                      "stride": [1, 1], "padding": [1, 1]}
    wide = ImageCNNConfig.wide()
    assert ImageCNNConfig.from_dict(wide.to_dict()) == wide and wide.side == 1
    model = ImageCNN(wide)
    assert [n for n, _ in model.stages()] == [f"conv{i}" for i in range(1, 7)] + ["embed", "head"]
    assert sum(p.numel() for p in model.parameters()) > 1_000_000
    with pytest.raises(ValueError, match="multiple of 64"):
        ImageCNNConfig(size=48, channels=wide.channels)


def test_gen_images_is_deterministic_balanced_and_reads_as_mnist(tmp_path):
    from mariana.featurizer.image import load_mnist
    from tests.conftest import run_cli

    first = json.loads(run_cli("gen", "images", "--rows", "300", "--seed", "3", "--out", tmp_path / "a",
                               check=True).stdout)
    again = json.loads(run_cli("gen", "images", "--rows", "300", "--seed", "3", "--out", tmp_path / "b",
                               check=True).stdout)
    other = json.loads(run_cli("gen", "images", "--rows", "300", "--seed", "4", "--out", tmp_path / "c",
                               check=True).stdout)
    assert first["content_sha256"] == again["content_sha256"] != other["content_sha256"]
    assert min(first["per_class"]) > 15 and sum(first["per_class"]) == 300
    data = load_mnist(tmp_path / "a")
    assert data.images.shape == (300, 64, 64) and data.images.dtype == np.uint8
    small = load_mnist(tmp_path / "a").images[:100]
    from mariana.featurizer.shapes import generate_images
    generate_images(tmp_path / "d", 100, 3)  # image i depends only on (seed, i)
    assert np.array_equal(load_mnist(tmp_path / "d").images, small)
    bad = run_cli("gen", "images", "--rows", "0", "--out", tmp_path / "e")
    assert bad.returncode == 2 and "--rows >= 1" in bad.stderr
    # a second set into the first one's directory: the first stayed and was read with it (100 images for 10)
    again = run_cli("gen", "images", "--rows", "10", "--format", "png", "--out", tmp_path / "d")
    assert again.returncode == 2 and "holds files already" in again.stderr, again.stderr
    assert len(load_mnist(tmp_path / "d").images) == 100  # left as it was
    (tmp_path / "f").mkdir()  # an empty one is taken, and nothing is left beside it
    generate_images(tmp_path / "f", 10, 3, fmt="png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c", "d", "f"]
    assert sum(1 for p in (tmp_path / "f").rglob("*.png")) == 10



def test_gen_images_help_states_the_jpeg_quality_it_uses(capsys):
    """The CLI leaves the default to generate_images (it wrote its own 90 beside it); its help,
    built without importing the generator, states the same value."""
    from mariana.cli import build_parser
    from mariana.featurizer.shapes import JPEG_QUALITY

    with pytest.raises(SystemExit):
        build_parser().parse_args(["gen", "images", "--help"])
    assert f"default {JPEG_QUALITY})" in " ".join(capsys.readouterr().out.split())
