"""docs/model-format.md's scorer, run as the doc gives it: numpy, safetensors and json only,
it must re-score a trained LR version as `mariana predict` does, and reproduce the
manifest's `calibration` by the doc's definition."""
import json
import re

import numpy as np
import pytest

from tests.conftest import ROOT, run_cli

pytestmark = pytest.mark.slow

DOC = ROOT / "docs" / "model-format.md"


def doc_scorer():
    """The doc's one ```python block, exec'd in a namespace of its own: its `score`."""
    blocks = re.findall(r"^```python\n(.*?)^```$", DOC.read_text(), re.S | re.M)
    assert len(blocks) == 1, f"{DOC} should hold exactly one python block, has {len(blocks)}"
    namespace: dict = {"__name__": "model_format_doc"}
    exec(compile(blocks[0], str(DOC), "exec"), namespace)
    assert not any(name.startswith("mariana") for name in namespace), "the scorer must not import mariana"
    return namespace["score"]


def test_the_doc_names_the_hashing_constants_as_the_code_defines_them():
    from mariana.sparse import hashing

    text = DOC.read_text()
    for name in ("FNV_OFFSET", "FNV_PRIME", "FIELD_SALT", "INT_SALT", "MISSING_SALT", "RARE_SALT", "_M1", "_M2"):
        value = f"0x{int(getattr(hashing, name)):X}"
        assert re.search(rf"`{name}`.*`{value}`|{name}[ ,=].*{value}", text), (name, value)
    score_ns: dict = {}
    exec(re.findall(r"^```python\n(.*?)^```$", text, re.S | re.M)[0], score_ns)
    for field, token in (("C1", b"68fd1e64"), ("C2", b""), ("I1", 5), ("I2", -3), ("I3", None), ("weekday", 6)):
        want = hashing.token_id(field, token, bits=20)
        got = score_ns["feature_id"](field, score_ns["token_hash"](token), 20)
        assert got == want, (field, token)
    assert score_ns["feature_id"]("C1", score_ns["RARE_SALT"], 20) == hashing.token_id("C1", hashing.RARE, bits=20)
    scale = 4.0
    values = [0.0, 1.0, 3.0, 1e6, -3.0, 0.5, -0.25, 123456.0, 1e301]
    assert [score_ns["log_bucket"](v, scale) for v in values] == hashing.log_bucket(np.array(values), scale).tolist()


# (label, extra train args): the default LR (numeric fields bucketed), and one with the numeric
# fields in a dense block too and admission on (ids seen fewer than 3 times read the rare row)
CASES = [("bucket", ()),
         ("both-admission", ("--set", "hashing.numeric=both", "--set", "hashing.min_count=3"))]


@pytest.mark.parametrize("label,extra", CASES, ids=[c[0] for c in CASES])
def test_doc_scorer_matches_mariana_predict(gen_files, tmp_path, label, extra):
    score = doc_scorer()
    out = tmp_path / "m"
    proc = run_cli("train", "--data", gen_files["train"], "--test-data", gen_files["test"], "--model", "lr",
                   "--out", out, "--bits", "16", "--json", "-q", *extra)
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((out / "v000001" / "manifest.json").read_text())
    assert manifest["schema"]["numeric"] and manifest["schema"]["categorical"]  # both kinds of field scored
    assert bool(manifest["dense_fields"]) == (label != "bucket")

    pred = run_cli("predict", "--model", out, "--data", gen_files["test"], check=True)
    want = np.array([float(x) for x in pred.stdout.split()])
    got = np.array(score(str(out), str(gen_files["test"])), np.float64)
    assert got.shape == want.shape == (8_000,)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)

    # the doc's calibration: mean(clip(p, 1e-7, 1 - 1e-7)) / mean(y) over the test rows
    labels = np.array([float(line.split("\t", 1)[0]) for line in gen_files["test"].read_text().splitlines()])
    calibration = np.clip(got, 1e-7, 1 - 1e-7).mean() / labels.mean()
    assert calibration == pytest.approx(manifest["metrics"]["calibration"], abs=1e-9)

    # an unlabeled file (the label column dropped) scores the same
    unlabeled = tmp_path / "u.tsv"
    unlabeled.write_text("".join(line.split("\t", 1)[1] + "\n"
                                 for line in gen_files["test"].read_text().splitlines()[:200]))
    np.testing.assert_allclose(score(str(out), str(unlabeled)), got[:200], rtol=0, atol=1e-9)
