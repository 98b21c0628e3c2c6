"""The search's trials are saved before the refit that follows it: a Ctrl-C, a SIGTERM or an
error during the refit lost every trial (an exploratory run: 8 trials, 20 s of search, gone,
no trials file), though the docs say an interrupted tune keeps its trials."""
from __future__ import annotations

import json

import pytest

from mariana.sparse.errors import MarianaError
from mariana.trainer.config import JobConfig
from mariana.trainer.tune import SearchInterrupted, Trial, TuneResult, trials_kept


def result() -> TuneResult:
    trials = [Trial(0, {"optim.lr": 0.1}, "complete", 0.45, 0.7, 3, 2, 1.0),
              Trial(1, {"optim.lr": 0.2}, "pruned", 0.47, 0.69, 1, 1, 0.5)]
    return TuneResult(trials[0], None, JobConfig(), trials, 1.5)


@pytest.mark.parametrize("raised, caught, says", [
    (KeyboardInterrupt("stopped by SIGTERM"), SearchInterrupted, "stopped by SIGTERM during the refit of trial 0: "),
    (KeyboardInterrupt(), SearchInterrupted, "during the refit of trial 0: "),  # "mariana: interrupted: during"
    (MarianaError("the loss went NaN"), MarianaError, "the refit of trial 0 failed: the loss went NaN; "),
])
def test_the_trials_stay_saved_when_the_refit_is_interrupted_or_fails(tmp_path, raised, caught, says):
    with pytest.raises(caught) as e:
        with trials_kept(str(tmp_path / "m"), result(), {"budget_seconds": 10}):
            raise raised
    [saved] = (tmp_path / "m" / "tune").glob("*.json")
    assert str(e.value) == f"{says}the search's 2 trials are saved in {saved}; nothing published"
    kept = json.loads(saved.read_text())
    assert kept["best_trial"] == 0 and [t["state"] for t in kept["trials"]] == ["complete", "pruned"]


def test_the_file_the_refit_kept_is_the_one_the_publish_completes(tmp_path):
    with trials_kept(str(tmp_path / "m"), result(), {"budget_seconds": 10}) as path:
        pass
    assert list((tmp_path / "m" / "tune").glob("*.json")) == [tmp_path / "m" / "tune" / path.rsplit("/", 1)[1]]


def test_a_train_epochs_tune_does_not_use_is_said(caplog):
    """`tune --set train.epochs=3` ran with no word that every trial stops on validation instead."""
    from mariana.trainer.config import load_config
    from mariana.trainer.tune import check_search

    check_search(load_config(env={}), 10.0)
    assert "is not used" not in caplog.text  # the default, untouched
    check_search(load_config(overrides={"train.epochs": 3}, env={}), 10.0)
    assert "tune: train.epochs = 3 is not used: every trial stops on its validation logloss" in caplog.text


class _StopsAtTrial:
    """A trial runner (the interface LocalTrials and ClusterTrials implement) whose trial
    `stop` is interrupted by Ctrl-C inside its training; the trials before it complete."""

    def __init__(self, stop: int):
        self.stop = stop

    def run(self, trial, config, on_valid, deadline):
        from mariana.trainer.tune import TrialRun

        if trial.number == self.stop:
            raise KeyboardInterrupt
        valid = {"epochs": [{"logloss": 0.5 - trial.number / 100, "auc": 0.7}], "best_epoch": 1, "stopped": ""}
        return TrialRun(valid, None)

    def discard(self, run) -> None:
        pass


@pytest.mark.parametrize("stop", [0, 2])
def test_a_ctrl_c_inside_a_trial_ends_the_search_with_that_trial_interrupted(stop):
    """One handler now ends the search for a Ctrl-C anywhere in a trial (its params picked,
    its training, its bookkeeping); the trial that was running says "interrupted", those
    before it keep their own ends."""
    from mariana.trainer.config import load_config
    from mariana.trainer.tune import tune

    ended = []
    with pytest.raises(SearchInterrupted) as e:
        tune(load_config(overrides={"train.batch_size": 512}, env={}), _StopsAtTrial(stop), 60.0,
             on_trial=lambda t: ended.append((t.number, t.state)))
    trials = e.value.result.trials
    assert [t.state for t in trials] == ["complete"] * stop + ["interrupted"]
    assert ended == [(t.number, t.state) for t in trials]
