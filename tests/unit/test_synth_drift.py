import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv

from mariana.sparse.hashing import log_bucket
from mariana.sparse.metrics import BinaryMetrics
from mariana.sparse.parse import Reader
from mariana.sparse.schema import CRITEO_CATEGORICAL, CRITEO_NUMERIC, criteo
from mariana.sparse.synth_drift import generate_drift, planted_probabilities

ROWS = 60_000
C = {name: 13 + i for i, name in enumerate(CRITEO_CATEGORICAL)}  # column of Ck in `codes`


def read_codes(path):
    """(labels, raw integer columns, (rows, 39) integer code per field value)."""
    types = {"label": pa.float64(), **{n: pa.float64() for n in CRITEO_NUMERIC},
             **{n: pa.string() for n in CRITEO_CATEGORICAL}}
    t = pa_csv.read_csv(path, read_options=pa_csv.ReadOptions(column_names=list(types)),
                        parse_options=pa_csv.ParseOptions(delimiter="\t"),
                        convert_options=pa_csv.ConvertOptions(column_types=types))
    ints = {n: t[n].to_numpy() for n in CRITEO_NUMERIC}
    codes = [np.where(np.isnan(x), 10_000, log_bucket(x, 4.0)) for x in ints.values()]
    for n in CRITEO_CATEGORICAL:
        codes.append(pc.dictionary_encode(t[n]).combine_chunks().indices.fill_null(-1).to_numpy(zero_copy_only=False))
    return t["label"].to_numpy(), ints, np.stack(codes, axis=1)


def per_id_auc(codes, labels, train, test):
    """AUC on `test` of smoothed per-value click rates fitted on `train`, summed as
    log-odds shifts over the fields (naive Bayes-like): a model of per-id weights."""
    prior = labels[train].mean()
    score = np.zeros(test.sum())
    for f in range(codes.shape[1]):
        k = codes[:, f] - codes[:, f].min()
        pos = np.bincount(k[train], labels[train], minlength=k.max() + 1)
        rate = (pos + 20 * prior) / (np.bincount(k[train], minlength=k.max() + 1) + 20)
        score += np.log(rate[k[test]] / prior)
    m = BinaryMetrics()
    m.update(labels[test], score)
    return m.auc()


def test_deterministic_and_parses_with_the_criteo_reader(tmp_path):
    a, b, c = tmp_path / "a.tsv", tmp_path / "b.tsv", tmp_path / "c.tsv.gz"
    ra = generate_drift(a, 20_000, seed=3)
    rb = generate_drift(b, 20_000, seed=3)
    generate_drift(c, 500, seed=3)
    assert a.read_bytes() == b.read_bytes()  # same (rows, seed, model_seed), same bytes
    assert {k: v for k, v in ra.items() if k != "seconds"} | {"path": ""} == \
           {k: v for k, v in rb.items() if k != "seconds"} | {"path": ""}
    assert generate_drift(tmp_path / "d.tsv", 20_000, seed=4)["positives"] != ra["positives"]
    reader = Reader([str(a), str(c)], criteo())
    assert sum(ch.num_rows for ch in reader) == 20_500
    assert reader.stats.rows_ok == 20_500 and reader.stats.rows_bad == 0
    first = a.read_text().split("\n", 1)[0].split("\t")
    assert len(first) == 40 and all(len(v) in (0, 8) for v in first[14:])


def test_click_rate_value_distributions_and_planted_score(tmp_path):
    r = generate_drift(tmp_path / "a.tsv", ROWS, seed=1)
    assert 0.03 <= r["ctr"] <= 0.05                              # documented: about 4%
    assert r["ctr_by_fifth"][-1] > 1.15 * r["ctr_by_fifth"][0]   # and rising over time
    assert 0.85 <= r["true_auc"] <= 0.95 and r["true_logloss"] < 0.13
    labels, ints, codes = read_codes(tmp_path / "a.tsv")
    assert labels.sum() == r["positives"]
    assert np.nanmax(ints["I2"]) >= 1e5 and np.nanmedian(ints["I2"]) < 10  # bot bursts
    assert (ints["I4"] < 0).mean() > 0.3 and np.nanmax(np.abs(ints["I4"])) >= 1e6
    assert np.isnan(ints["I11"]).mean() > 0.85 and not np.isnan(ints["I1"]).any()
    assert set(np.unique(ints["I1"])) == set(range(24))         # hour of day
    assert np.unique(codes[:, C["C8"]]).size > 0.5 * ROWS       # most user ids are rare
    # planted_probabilities redraws the same rows without writing them
    y, p = planted_probabilities(ROWS, seed=1, start=ROWS - 1_000)
    assert np.array_equal(y, labels[-1_000:].astype(np.int8)) and p.shape == (1_000,)
    m = BinaryMetrics()
    m.update(*planted_probabilities(ROWS, seed=1))
    assert m.result()["auc"] == r["true_auc"]


def test_a_time_split_is_harder_than_a_random_split(tmp_path):
    cut = ROWS * 8 // 10
    late = np.arange(ROWS) >= cut
    gaps = []
    for seed in (1, 2, 3):
        generate_drift(tmp_path / "a.tsv", ROWS, seed=seed)
        labels, _, codes = read_codes(tmp_path / "a.tsv")
        shuffled = np.random.default_rng(seed).permutation(ROWS) >= cut
        gaps.append(per_id_auc(codes, labels, ~shuffled, shuffled) - per_id_auc(codes, labels, ~late, late))
    assert min(gaps) > 0 and np.mean(gaps) > 0.01, gaps
    # new ids: late C3 (a conveyor) values never seen before the cut, against a random split
    c3 = codes[:, C["C3"]]
    unseen_late = np.isin(c3[late], c3[~late], invert=True).mean()
    unseen_random = np.isin(c3[shuffled], c3[~shuffled], invert=True).mean()
    assert unseen_late > 0.3 and unseen_late > 10 * unseen_random, (unseen_late, unseen_random)


def test_cli_gen_criteo_drift_writes_the_same_file(tmp_path, capsys):
    from mariana.services.cli import build_parser

    out = tmp_path / "cli.tsv"
    args = build_parser().parse_args(["gen", "criteo-drift", "--rows", "3000", "--seed", "7", "--out", str(out)])
    assert args.func(args) == 0
    record = json.loads(capsys.readouterr().out)
    generate_drift(tmp_path / "api.tsv", 3_000, seed=7)
    assert out.read_bytes() == (tmp_path / "api.tsv").read_bytes()
    assert record["rows"] == 3_000 and record["true_auc"] > 0.5
