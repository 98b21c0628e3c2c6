import numpy as np
import pytest

from mariana.sparse.batch import SparseBatch, concat
from mariana.sparse.errors import DataFormatError


def make(rows=5, fields=3, num_ids=50, seed=0) -> SparseBatch:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, num_ids, size=(rows, fields))
    return SparseBatch.from_fixed(ids, num_ids=num_ids, labels=rng.integers(0, 2, rows).astype(np.float32),
                                  dense=rng.random((rows, 2)).astype(np.float32), batch_id="t")


def test_fixed_layout_and_scipy():
    b = SparseBatch.from_fixed(np.array([[3, 7], [3, 3]]), num_ids=10, labels=np.array([1, 0], np.float32))
    assert b.fixed_width and b.num_rows == 2 and b.nnz == 4
    m = b.to_scipy().toarray()
    assert m[0, 3] == 1 and m[0, 7] == 1 and m[1, 3] == 2  # duplicates summed
    assert b.row_index().tolist() == [0, 0, 1, 1]
    assert b.validate() is b


def test_slices_split_and_concat_round_trip():
    b = make(rows=10)
    parts = b.split(4)
    assert [p.num_rows for p in parts] == [4, 4, 2]
    again = concat(parts)
    assert (again.ids == b.ids).all() and (again.indptr == b.indptr).all()
    assert (again.labels == b.labels).all() and (again.dense == b.dense).all()
    assert all(p.fixed_width for p in parts)


def test_variable_rows_are_not_fixed_width():
    b = SparseBatch(ids=np.array([1, 2, 3], np.int64), indptr=np.array([0, 1, 3], np.int64),
                    fields=np.array([0, 0, 1], np.int32), num_fields=2, num_ids=8)
    assert not b.fixed_width
    assert b.validate().to_scipy().shape == (2, 8)


@pytest.mark.parametrize("source", ["torch", "parent"])
def test_unique_ids_and_inverse(source):
    b = make(rows=200, fields=4, num_ids=30, seed=3)
    if source == "parent":
        uniq, inv = np.unique(b.ids, return_inverse=True)
        b.set_unique(uniq, inv)
    for part in b.split(64):
        uniq, inverse = part.unique()
        assert len(np.unique(uniq)) == len(uniq)                 # no duplicates
        assert (uniq[inverse] == part.ids).all()                # each entry finds its id
        assert set(uniq.tolist()) == set(part.ids.tolist())     # and no extra ids


def test_validate_names_the_problem():
    b = make()
    b.ids[0] = 999
    with pytest.raises(DataFormatError, match=r"ids must lie in \[0, 50\)"):
        b.validate()
    b = make()
    b.indptr = b.indptr[:-1]
    with pytest.raises(DataFormatError, match="indptr must span ids"):
        b.validate()
    b = make()
    b.labels = b.labels.astype(np.float64)
    with pytest.raises(DataFormatError, match="labels"):
        b.validate()


def test_to_torch_shares_memory():
    b = make()
    t = b.to_torch()
    t["ids"][0] = 42
    assert b.ids[0] == 42
