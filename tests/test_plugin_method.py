"""Adding a method is one file: a toy method in a temporary module (outside the package, named in
the run config's ``plugins``) trains through ``commlab launch`` on 2 gloo workers, lands in
MLflow with the bytes its declared pattern predicts, feeds the cost model and a report table,
and nothing else in the project names it."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from commlab.config import ConfigError, load_config

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]

TOY = '''
"""A toy method: average the gradients with one allreduce of all of them (unbucketed SSGD)."""
from commlab.algorithms.base import Algorithm
from commlab.algorithms.tensors import flat_grads, write_grads
from commlab.registry import ALGORITHMS


@ALGORITHMS.register("toy_avg")
class ToyAverage(Algorithm):
    """One flat allreduce of every gradient per step."""

    comm_pattern = "ring_allreduce"

    def after_backward(self, info):
        params = [p for p in self.model.parameters() if p.requires_grad]
        with self.comm.reduction():
            write_grads(params, self.comm.all_reduce(flat_grads(params), op="avg"))
'''


def test_a_method_from_one_file_trains_and_reaches_the_cost_model_and_the_reports(tmp_path):
    plugin = tmp_path / "toy_method.py"
    plugin.write_text(textwrap.dedent(TOY))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = {"paper": "toy", "name": "toy", "method": "toy_avg", "plugins": [str(plugin)], "workers": 2,
              "dataset": "synthetic", "model": "mlp", "seed": 3, "output_dir": str(tmp_path / "run"),
              "train": {"epochs": 1, "train_subset": 512, "test_subset": 256, "log_every": 2},
              "tracking": {"uri": uri}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    done = subprocess.run([sys.executable, "-m", "commlab", "launch", "--config", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    from commlab.bench import costmodel as cm
    from commlab.bench.common import metric_points
    from commlab.core.communicator import ring_allreduce_cost
    from commlab.models import build_model
    from commlab.report.collect import load_runs

    load_config(path)  # imports the plugin here too, as every process that reads the config does
    runs = load_runs("toy", uri=uri)
    assert list(runs.method) == ["toy_avg"] and 0 < runs.test_accuracy.iloc[0] <= 100
    n = sum(p.numel() for p in build_model("mlp", 1, 10, 28).parameters())
    per_step = 4 * ring_allreduce_cost(n, 2, 0)[0]  # rank 0's share of one float32 ring allreduce
    assert runs.bytes_sent.iloc[0] >= 8 * per_step  # 512 samples / (2 workers x 32) = 8 steps
    profile = cm.profile_from_metrics("toy_avg", metric_points(uri, runs.run_id.iloc[0]), 2, 32)
    assert (profile.pattern, profile.pattern_source) == ("ring_allreduce", "declared by the method class")
    assert profile.bytes_per_step == pytest.approx(per_step)
    assert cm.predict(profile, 64, cm.Link("1Gbit", 1.0, 25e-6)).step_s > profile.compute_s


def test_a_bad_plugin_is_named(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ConfigError, match=r"plugins\.0: importing .*broken\.py.* RuntimeError: boom"):
        load_config(None, [f"plugins=[{broken}]"])
    with pytest.raises(ConfigError, match=r"plugins\.0: no file"):
        load_config(None, [f"plugins=[{tmp_path / 'missing.py'}]"])
    with pytest.raises(ConfigError, match=r"plugins\.0: cannot import 'no_such_module_here'"):
        load_config(None, ["plugins=[no_such_module_here]"])
