import re

import pytest

from mariana.sparse.errors import ConfigError
from mariana.sparse.settings import parse_set_option
from mariana.trainer.config import JobConfig, load_config


def test_layers_of_config(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[model]\nkind = "dnn"\nhidden = [16, 8]\n[train]\nepochs = 2\nbatch_size = 100\n')
    env = {"MARIANA_TRAIN__EPOCHS": "3", "MARIANA_DATA": "/ignored/not/config"}
    cfg = load_config(path, env=env, overrides={"train.batch_size": 7})
    assert (cfg.model.kind, cfg.model.hidden, cfg.train.epochs, cfg.train.batch_size) == ("dnn", [16, 8], 3, 7)
    assert cfg.hashing.bits == 22


@pytest.mark.parametrize("tree,message", [
    ({"model.kidn": "lr"}, "unknown key 'model.kidn'"),
    ({"train.epochs": "two"}, "train.epochs must be a number of passes or 'auto', got 'two'"),
    ({"train.epochs": 1.5}, "train.epochs: expected an integer or a string, got 1.5"),
    ({"train.epochs": 0}, "train.epochs"),
    ({"train.batch_size": "big"}, "train.batch_size must be a number of rows or 'auto'"),
    ({"model.init_bias": "zero"}, "model.init_bias must be a logit or 'auto'"),
    ({"train.valid_fraction": 1.0}, r"train.valid_fraction must be in \[0, 1\)"),
    ({"train.patience": 0}, "train.patience and train.max_epochs must be >= 1"),
    ({"hashing.bits": 99}, "hashing.bits must be in 1..32"),
    # a file's buckets (int64) overflowed to one for every large value there, a request's did not
    ({"hashing.bucket_scale": 1e18}, r"hashing.bucket_scale must be a positive number of at most 1e\+12"),
    ({"hashing.bucket_scale": float("nan")}, "hashing.bucket_scale must be a positive number"),
    ({"model.kind": "gbdt"}, "unknown model 'gbdt'"),
    ({"data.format": "parquet"}, "unknown format 'parquet'"),
    ({"data.format": "csv"}, "needs a \\[data.schema\\]"),
    ({"model.hidden": [16, "x"]}, r"model.hidden\[1\]: expected an integer"),
    ({"optim.lr": True}, "optim.lr: expected a number"),
    ({"train.batch_size": 10 ** 18}, "train.batch_size must be at most 16,777,216 rows"),
    ({"train.batch_size": 10 ** 20}, "train.batch_size: expected an integer of 64 bits at most, got a 21-digit"),
    ({"train.ramp_steps": -1}, "train.ramp_steps must be a number of steps >= 0 or 'auto', got -1"),
    ({"train.ramp_steps": "slow"}, "train.ramp_steps must be a number of steps >= 0 or 'auto'"),
    ({"train.ramp_steps": 1.5}, "train.ramp_steps: expected an integer or a string, got 1.5"),
    ({"model.seed": -1}, r"model.seed must be an integer in \[0, 4294967295\], got -1"),
    ({"model.seed": 1 << 32}, "model.seed must be an integer in"),
])
def test_bad_config_names_the_key(tree, message):
    with pytest.raises(ConfigError, match=message):
        load_config(env={}, overrides=tree)


def test_env_unknown_key_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'train.epoch'"):
        load_config(env={"MARIANA_TRAIN__EPOCH": "3"})
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad, env={})
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.toml", env={})


def test_every_unknown_key_is_named_with_where_it_came_from(tmp_path):
    """The first unknown key alone, and not its source, was said: a client read a key from a
    newer install's cluster file and the user looked for it in their own (an upgrade run)."""
    path = tmp_path / "job.toml"
    path.write_text("[train]\nepoch = 2\nrate = 0.1\n[model]\nkind = 'lr'\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, env={"MARIANA_MODEL__KIDN": "dnn"}, overrides={"optim.lrr": 0.1})
    said = str(e.value).split("; ")
    assert [s.split(" (known")[0] for s in said] == [
        "train: unknown key 'train.epoch'", "train: unknown key 'train.rate'", "model: unknown key 'model.kidn'",
        "optim: unknown key 'optim.lrr'"], said
    assert [s.rsplit(") ", 1)[1] for s in said] == [f"in {path}", f"in {path}", "from MARIANA_MODEL__KIDN",
                                                     "from an override (--set)"], said


def test_a_bad_value_from_the_environment_names_its_variable(tmp_path):
    """An unknown key named its variable; a bad value ("train.epochs must be ...") did not, and
    with a config file and the environment in play the user could not tell which was wrong."""
    for env, says in ((("MARIANA_TRAIN__EPOCHS", "abc"), "train.epochs must be a number of passes or 'auto', got 'abc' "
                                                       "(from MARIANA_TRAIN__EPOCHS)"),
                      (("MARIANA_OPTIM__LR", "-1"), "optim.lr must be >= 0, got -1.0 (from MARIANA_OPTIM__LR)"),
                      (("MARIANA_HASHING__BITS", "nan"), "(from MARIANA_HASHING__BITS)")):
        with pytest.raises(ConfigError) as e:
            load_config(env=dict([env]))
        assert str(e.value).endswith(says), str(e.value)
    with pytest.raises(ConfigError) as e:  # the override's value, not the variable's, is the bad one
        load_config(env={"MARIANA_OPTIM__LR": "0.1"}, overrides={"optim.lr": -1})
    assert "MARIANA" not in str(e.value), str(e.value)


def test_set_option_parsing():
    assert parse_set_option("train.epochs=3") == ("train.epochs", 3)
    assert parse_set_option("model.hidden=[4, 2]") == ("model.hidden", [4, 2])
    assert parse_set_option("model.kind=dnn") == ("model.kind", "dnn")
    with pytest.raises(ConfigError):
        parse_set_option("no-equals")
    with pytest.raises(ConfigError, match=r"--set expects key=value, got '=3' \(no key before the '='\)"):
        parse_set_option("=3")  # was "config: unknown key ''"


def test_csv_schema_from_config():
    cfg = load_config(env={}, overrides={"data.format": "csv", "data.schema": {
        "columns": ["y", "a", "b"], "label": "y", "numeric": ["a"], "categorical": ["b"]}})
    assert cfg.data.resolve_schema().fields == ("a", "b")
    cfg = load_config(env={}, overrides={"data.format": "csv", "data.schema": {
        "columns": ["y", "a", "b"], "label": "y", "numeric": ["a"]}})
    with pytest.raises(ConfigError, match="columns without a role"):
        cfg.data.resolve_schema()
    for sep in ("\n", "\r", '"', ",,"):  # a line break or a quote cannot part fields
        cfg = load_config(env={}, overrides={"data.format": "csv", "data.schema": {
            "columns": ["y", "a"], "label": "y", "categorical": ["a"], "delimiter": sep}})
        with pytest.raises(ConfigError, match="delimiter must be one character other than a line break"):
            cfg.data.resolve_schema()
    assert JobConfig().to_dict()["train"]["epochs"] == 1


@pytest.mark.parametrize("key, value, says", [
    ("label", ["y"], "schema.label: expected a column name ('' for none), got ['y']"),  # a TypeError traceback
    ("hour", ["a"], "schema.hour: expected a column name ('' for none), got ['a']"),
    ("delimiter", 9, "schema.delimiter: expected one character, got 9"),
    ("name", 5, "schema.name: expected a name, got 5"),
    ("header", "false", "schema.header: expected true or false, got 'false'"),  # was read as true
    ("quoted", 0, "schema.quoted: expected true or false, got 0"),
])
def test_a_csv_schema_of_the_wrong_types_is_one_error(key, value, says):
    schema = {"columns": ["y", "a"], "label": "y", "categorical": ["a"], key: value}
    cfg = load_config(env={}, overrides={"data.format": "csv", "data.schema": schema})
    with pytest.raises(ConfigError) as e:
        cfg.data.resolve_schema()
    assert str(e.value) == says


def test_a_schema_with_a_built_in_format_is_an_error():
    with pytest.raises(ConfigError, match="data.schema is for data.format = 'csv', but data.format is 'criteo'"):
        load_config(env={}, overrides={"data.schema": {"columns": ["y", "a"], "label": "y", "categorical": ["a"]}})


def test_cluster_example_config_lists_every_key_with_its_default():
    from pathlib import Path

    from mariana.services.runtime.config import ClusterConfig, load_cluster_config

    path = Path(__file__).resolve().parents[2] / "deploy/config/cluster.example.toml"
    assert load_cluster_config(path, env={}) == ClusterConfig()
    text = path.read_text()
    for section, values in ClusterConfig().to_dict().items():
        assert f"[{section}]" in text
        for key in values:
            assert f"\n{key} = " in text, f"{section}.{key} missing from {path.name}"


def test_job_example_config_lists_every_key_with_its_default():
    """deploy/config/train.example.toml says it shows every key: a key added to a config
    dataclass and not to the example fails here (data.schema, a table, is shown commented)."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "deploy/config/train.example.toml"
    assert load_config(path, env={}) == JobConfig()
    text = path.read_text()
    for section, values in JobConfig().to_dict().items():
        assert f"\n[{section}]" in text, f"[{section}] missing from {path.name}"
        for key in values:
            shown = f"\n{key} = " in text or (key == "schema" and "\n# [data.schema]" in text)
            assert shown, f"{section}.{key} missing from {path.name}"


def test_job_paths_resolve_against_a_base_dir():
    cfg = load_config(env={}, overrides={"images.creatives": "ads", "images.mnist": "/data/mnist"})
    assert cfg.paths() == {"images.creatives": "ads", "images.mnist": "/data/mnist"}
    assert cfg.resolve_paths("/work").paths() == {"images.creatives": "/work/ads", "images.mnist": "/data/mnist"}
    assert JobConfig().resolve_paths("/work").paths() == {}  # unset paths stay unset


def test_cluster_and_job_configs_take_only_their_own_environment_sections():
    from mariana.services.runtime.config import load_cluster_config

    env = {"MARIANA_WORKER__COUNT": "3", "MARIANA_TRAIN__EPOCHS": "4"}
    assert load_cluster_config(env=env).worker.count == 3
    assert load_config(env=env).train.epochs == 4


@pytest.mark.parametrize("key,value,says", [
    ("coordinator.lease_seconds", -1, "coordinator.lease_seconds must be a number of seconds > 0"),
    ("coordinator.heartbeat_seconds", 0, "coordinator.heartbeat_seconds must be a number of seconds > 0"),
    ("worker.rpc_seconds", float("inf"), "worker.rpc_seconds must be a number of seconds > 0, got inf"),
    ("ps.checkpoint_seconds", -1, "ps.checkpoint_seconds must be a number of seconds >= 0"),
    ("coordinator.http_port", 99999, "coordinator.http_port must be in 0..65535, got 99999"),
    ("worker.metrics_ports", [9100, 70000], "worker.metrics_ports must be in 0..65535, got 70000"),
    ("cache.max_bytes", -1, "cache.max_bytes must be >= 0, got -1"),
    ("worker.threads", 5000, "worker.threads must be in 0..1024 (0: the job's train.threads), got 5,000"),
    ("coordinator.token", " s3cret ", "coordinator.token has white space around it"),
    ("coordinator.token", "   ", "coordinator.token has white space around it"),
    ("coordinator.token", "s3\ncret", "coordinator.token holds a control character"),
    ("ps.count", 100_000, "ps.count must be in 1..4,096, got 100,000"),  # was "too many open files" from `up`
    # each service exited at its start, blaming a key never set ("preprocess.metrics_ports must be in 0..65535")
    ("cluster.base_port", 65400, "cluster.base_port 65400 derives worker.metrics_ports[1] at port 65801, past "
                                 "65535: at most 65134 for these counts"),
])
def test_cluster_times_ports_and_sizes_out_of_range_name_the_key(key, value, says):
    """A negative lease had every batch lapse at once and trained nothing; a port past 65535
    was a traceback from bind(); a zero heartbeat made `up` wait and fail with no cause named."""
    from mariana.services.runtime.config import load_cluster_config

    with pytest.raises(ConfigError, match=re.escape(says)):
        load_cluster_config(overrides={key: value, "worker.count": 2}, env={})
    assert load_cluster_config(overrides={"ps.checkpoint_seconds": 0}, env={}).ps.checkpoint_seconds == 0
    if key == "coordinator.token":  # the model server's admin token alike
        from mariana.serving.config import load_serve_config

        with pytest.raises(ConfigError, match=re.escape(says.replace("coordinator.", "serve."))):
            load_serve_config(None, {"serve.token": value}, env={})


@pytest.mark.parametrize("tree,says", [
    ({"data.block_bytes": 10 ** 18}, "data.block_bytes must be in [1024, 2^30]"),
    ({"train.epochs": 10 ** 26}, "train.epochs: expected an integer of 64 bits at most, got a 27-digit integer"),
    ({"train.patience": 10 ** 18}, "train.patience must be at most 1,000,000, got 1,000,000,000,000,000,000"),
    ({"hashing.bits": 10 ** 5000}, "hashing.bits: expected an integer of 64 bits at most, got an integer of more"),
    ({"optim.lr": 10 ** 400}, "optim.lr: expected a number within a float's range (1.8e308), got a 401-digit"),
    ({"data.parse_workers": 10 ** 9}, "data.parse_workers must be in 1..1024, got 1000000000"),
    ({"images.tower": 10 ** 9}, "images.tower must be in 1..16,384, got 1000000000"),
    ({"train.threads": 2000}, "train.threads must be at most 1024 (0: every CPU), got 2,000"),
    ({"train.prefetch": 0}, "train.prefetch must be >= 1, got 0"),
    ({"model.init_bias": 1e300}, "model.init_bias must be a logit in [-69, 69]"),  # a job diverged, blaming the lr
    ({"train.batch_size": 0}, "train.batch_size must be >= 1, got 0"),
    ({"train.max_epochs": 10 ** 7}, "train.max_epochs must be at most 1,000,000"),
    ({"model.embed_dim": 10 ** 8}, "model.embed_dim, model.hidden and model.slots must be at most 16,384"),
    ({"optim.lr": float("inf")}, "optim.lr must be a finite number, got inf"),
    ({"optim.ftrl_alpha": float("inf")}, "optim.ftrl_alpha must be a finite number"),
])
def test_numbers_no_run_could_use_are_refused_before_it_starts(tree, says):
    """Each of these was accepted and failed later inside a job: an OverflowError in a
    cluster job, a 763 TiB allocation on a shard, lr inf kept in a manifest."""
    with pytest.raises(ConfigError, match=re.escape(says)):
        load_config(env={}, overrides=tree)


def test_metrics_ports_follow_base_port_and_are_checked_against_counts():
    from mariana.services.launcher import resolve
    from mariana.services.runtime.config import load_cluster_config

    cfg = load_cluster_config(overrides={"cluster.base_port": 5700, "worker.count": 3, "ps.count": 2}, env={})
    assert [cfg.metrics_port("worker", i) for i in range(3)] == [6100, 6101, 6102]
    assert (cfg.metrics_port("loader", 0), cfg.ps.metrics_ports, cfg.preprocess.metrics_ports) == (5703, [5900, 5901],
                                                                                                  [6000])
    assert cfg.metrics_port("coordinator", 0) is None  # its HTTP API answers /metrics
    unset = load_cluster_config(env={})
    assert unset.metrics_port("worker", 0) == unset.metrics_port("loader", 0) == 0
    with pytest.raises(ConfigError, match="worker.metrics_ports lists 1 metrics ports for worker.count = 2"):
        load_cluster_config(overrides={"worker.count": 2, "worker.metrics_ports": [9100]}, env={})
    filled = resolve(load_cluster_config(overrides={"worker.count": 2}, env={}))  # `mariana up`: free ports
    ports = [filled.metrics_port(r, i) for r in ("loader", "ps", "preprocess", "worker") for i in range(filled.count(r))]
    assert len(set(ports)) == len(ports) == 5 and all(ports), ports


def test_a_lone_worker_overlaps_lr_steps_only_unless_told():
    """Two steps in flight keep one worker busy, but cost a DNN AUC (docs/pipeline.md)."""
    from mariana.services.runtime.config import WorkerConfig

    assert WorkerConfig().steps_in_flight("lr") == 2 and WorkerConfig().steps_in_flight("dnn") == 1
    assert WorkerConfig(count=2).steps_in_flight("lr") == 1
    assert WorkerConfig(pipeline=3).steps_in_flight("dnn") == 3


def test_env_merges_into_a_section_key_by_key_but_replaces_a_free_form_table(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[data]\nformat = "csv"\nblock_bytes = 4096\n'
                    '[data.schema]\ncolumns = ["y", "a"]\nlabel = "y"\nnumeric = ["a"]\n')
    env = {"MARIANA_DATA__BLOCK_BYTES": "8192", "MARIANA_DATA__SCHEMA__COLUMNS": '["y", "b"]'}
    cfg = load_config(path, env=env)
    assert (cfg.data.format, cfg.data.block_bytes) == ("csv", 8192)
    assert cfg.data.schema == {"columns": ["y", "b"]}  # the environment's table, not mixed with the file's



def test_the_environment_overriding_a_config_files_key_is_said(tmp_path, caplog):
    """The documented order (file <- environment <- flags) let MARIANA_CLUSTER__DIR steer
    `mariana down --config FILE` at another cluster than FILE's, in silence."""
    from mariana.services.runtime.config import load_cluster_config

    path = tmp_path / "cl.toml"
    path.write_text(f'[cluster]\ndir = "{tmp_path / "a"}"\n[worker]\ncount = 2\n')
    with caplog.at_level("WARNING"):
        env = {"MARIANA_CLUSTER__DIR": str(tmp_path / "b"), "MARIANA_WORKER__COUNT": "2"}
        cfg = load_cluster_config(path, env=env)
    assert cfg.cluster.dir == str(tmp_path / "b")
    assert f"cluster.dir = '{tmp_path / 'b'}' from MARIANA_CLUSTER__DIR overrides '{tmp_path / 'a'}' of {path}" \
        in caplog.text
    assert "worker.count" not in caplog.text  # the same value: nothing to say
