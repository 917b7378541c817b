"""Which runs a report reads: the newest finished run per (name, seed) at one scale.

Runs are created in a scratch MLflow store through the project's tracker (commlab.tracking),
with the tags a training job sets, then selected by commlab.report.collect.load_runs.
"""

from __future__ import annotations

import pytest

from commlab.report.claims import Claim, seeds_label


def make_run(uri: str, name: str, seed: int, scale: str | None, accuracy: float, status: str = "FINISHED") -> str:
    from commlab.tracking import RunTracker

    config = {"paper": "toy", "name": name, "method": "ssgd", "seed": seed, "tracking": {"uri": uri}}
    tags = {"paper": "toy", "method": "ssgd", "name": name, "seed": str(seed), "workers": "2"}
    if scale:
        tags["scale"] = scale
    tracker = RunTracker(config, tags)
    tracker.log_metrics({"test_accuracy": accuracy}, step=1)
    tracker.finish(status)
    return tracker.run_id


@pytest.fixture
def uri(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def test_runs_of_one_scale_newest_first(uri):
    from commlab.report.collect import load_runs

    make_run(uri, "a", 0, "smoke", 10.0)
    newest = make_run(uri, "a", 0, "smoke", 11.0)
    make_run(uri, "a", 0, "smoke", 99.0, status="FAILED")
    laptop = make_run(uri, "a", 0, "laptop", 20.0)
    make_run(uri, "b", 1, None, 30.0)  # untagged: not a smoke run once tagged runs exist

    smoke = load_runs("toy", uri=uri, scale="smoke")
    assert list(smoke.run_id) == [newest] and smoke.test_accuracy.iloc[0] == 11.0
    assert list(load_runs("toy", uri=uri, scale="laptop").run_id) == [laptop]
    assert load_runs("toy", uri=uri, scale="paper").empty
    assert sorted(load_runs("toy", uri=uri).name) == ["a", "b"]  # no scale: every newest run


def test_untagged_runs_count_as_the_scale_when_none_is_tagged(uri):
    from commlab.report.collect import load_runs

    old = make_run(uri, "a", 0, None, 10.0)
    assert list(load_runs("toy", uri=uri, scale="laptop").run_id) == [old]


def test_claims_say_how_many_seeds_stand_behind_their_means():
    assert seeds_label([3, 3]) == "n=3" and seeds_label([1, 3, 2]) == "n=1-3" and seeds_label([]) == ""
    assert Claim("c", "p", "a 1.0 ± 0.1 (n=3) vs b 2 ± 0 (n=2)", "reproduced").seeds == "n=2-3"
    assert Claim("c", "p", "no runs", "not measured", seeds="n=3").seeds == ""
    assert Claim("c", "p", "1.0", "reproduced", seeds="n=5").seeds == "n=5"


def test_time_on_the_emulated_link_uses_the_methods_measured_rate(tmp_path):
    import json

    import pandas as pd

    from commlab.report.index import emulated_link_seconds

    (tmp_path / "bench").mkdir()
    summary = [{"network": "loopback", "method": "ssgd", "samples_per_s": 3000.0, "measured_link_mbit": None},
               {"network": "1000Mbit", "method": "ssgd", "samples_per_s": 2000.0, "measured_link_mbit": 950.0},
               {"network": "100Mbit", "method": "ssgd", "samples_per_s": 800.0, "measured_link_mbit": 96.0},
               {"network": "100Mbit", "method": "oktopk", "samples_per_s": 1600.0, "measured_link_mbit": 96.0}]
    (tmp_path / "bench" / "throughput.json").write_text(json.dumps({"model": "cnn", "workers": 4, "summary": summary}))
    runs = pd.DataFrame({"method": ["ssgd", "oktopk", "oktopk", "kstep"], "model": ["cnn", "cnn", "mlp", "cnn"],
                         "workers": [4, 4, 4, 4], "samples": [24000, 24000, 24000, 24000]})
    seconds, link = emulated_link_seconds(runs, tmp_path)
    assert link == "100Mbit"  # the slowest emulated link
    assert seconds.iloc[0] == 30.0 and seconds.iloc[1] == 15.0
    assert seconds.iloc[2:].isna().all()  # another model; a method the benchmark did not measure


def test_cross_paper_charts_set_generated_data_aside_only_beside_real_data():
    import pandas as pd

    from commlab.report.index import real_data_runs

    mixed = pd.DataFrame({"name": ["ssgd", "oktopk_p8"], "dataset": ["fashion_mnist", "synthetic"]})
    kept, generated_only = real_data_runs(mixed)
    assert list(kept.name) == ["ssgd"] and not generated_only
    alone = pd.DataFrame({"name": ["ssgd", "ddp"], "dataset": ["synthetic", "synthetic"]})
    kept, generated_only = real_data_runs(alone)
    assert list(kept.name) == ["ssgd", "ddp"] and generated_only
