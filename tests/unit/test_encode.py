import numpy as np
import pytest

from mariana.sparse.encode import Encoder
from mariana.sparse.hashing import HashSpec, token_id
from mariana.sparse.parse import Reader
from mariana.sparse.schema import avazu, criteo

ROW = "1\t5\t\t-3\t" + "\t".join(["7"] * 10) + "\t" + "\t".join(f"{i:08x}" for i in range(25)) + "\t"


def encode(path, schema, spec):
    chunks = list(Reader([str(path)], schema))
    return Encoder(schema, spec), Encoder(schema, spec).encode(chunks[0])


@pytest.mark.parametrize("mode,fields,dense", [("bucket", 39, 0), ("dense", 26, 13), ("both", 39, 13)])
def test_numeric_modes(tmp_path, mode, fields, dense):
    path = tmp_path / "r.tsv"
    path.write_text(ROW + "\n")
    enc, b = encode(path, criteo(), HashSpec(bits=20, numeric=mode))
    assert (enc.num_fields, enc.dense_dim) == (fields, dense)
    assert b.ids.shape == (fields,) and b.dense.shape == (1, dense) and b.fixed_width
    if dense:
        assert b.dense[0, :3] == pytest.approx([np.log1p(5), 0.0, -np.log1p(3)], rel=1e-6)
    ids = dict(zip(enc.sparse_fields, b.ids.tolist()))
    assert ids["C1"] == token_id("C1", b"00000000", 20)
    assert ids["C26"] == token_id("C26", None, 20)        # empty -> missing
    if mode != "dense":
        assert ids["I1"] == token_id("I1", 7, 20)          # floor(log1p(5) * 4) = 7
        assert ids["I2"] == token_id("I2", None, 20)
        assert ids["I3"] == token_id("I3", -5, 20)         # -floor(log1p(3) * 4)
    uniq, inverse = b.unique()
    assert (uniq[inverse] == b.ids).all()


def test_avazu_fields(tmp_path):
    header = ",".join(avazu().columns)
    row = ",".join(["10", "0", "14102123"] + [f"v{j}" for j in range(21)])
    path = tmp_path / "a.csv"
    path.write_text(header + "\n" + row + "\n")
    enc, b = encode(path, avazu(), HashSpec(bits=20))
    assert enc.sparse_fields[-2:] == ("hour_of_day", "weekday") and "id" not in enc.sparse_fields
    ids = dict(zip(enc.sparse_fields, b.ids.tolist()))
    assert ids["hour_of_day"] == token_id("hour_of_day", 23, 20)
    assert ids["weekday"] == token_id("weekday", 1, 20)     # 2014-10-21 was a Tuesday
    assert ids["site_id"] == token_id("site_id", b"v2", 20)  # C1=v0, banner_pos=v1, site_id=v2
