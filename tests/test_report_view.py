"""What a reader sees: a paper's report leads with its verdicts, shows no code and no stderr, and
the index draws every method of every paper on the cross-paper charts.

The report is built from real runs: ssgd and ddp (the baseline paper's methods) train through
``commlab launch`` on 2 gloo workers on synthetic data into a scratch MLflow store; the baseline
notebook is executed against it. A headless Chromium (Debian package ``chromium``) then renders
report.html at 1280x900: a screenshot for the eye, and the claims table's position measured in
the rendered page.
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
WINDOW = (1280, 900)
CHROMIUM = next(filter(None, (shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome"))), None)

# Appended to a copy of the page: writes where the claims table and the first figure start (in
# CSS pixels from the top of the page) into attributes that --dump-dom prints.
PROBE = """<script>
window.addEventListener('load', () => {
  const top = el => el ? String(el.getBoundingClientRect().top + window.scrollY) : 'none';
  document.body.setAttribute('data-claims-top', top(document.querySelector('table.commlab-claims')));
  document.body.setAttribute('data-figure-top', top(document.querySelector('img')));
});
</script>"""


def train(tmp_path: Path, uri: str, method: str) -> None:
    config = {"paper": "baseline", "name": method, "method": method, "workers": 2, "dataset": "synthetic",
              "model": "mlp", "seed": 0, "output_dir": str(tmp_path / "results" / method),
              "train": {"epochs": 2, "train_subset": 256, "test_subset": 256, "log_every": 2},
              "tracking": {"uri": uri}}
    path = tmp_path / f"{method}.yaml"
    path.write_text(yaml.safe_dump(config))
    done = subprocess.run([sys.executable, "-m", "commlab", "launch", "--config", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> Path:
    """reports/ with the baseline paper's report and the index, from two real runs."""
    from commlab.report.build import build_paper
    from commlab.report.index import build_index

    tmp = tmp_path_factory.mktemp("report_view")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    for method in ("ssgd", "ddp"):
        train(tmp, uri, method)
    out = tmp / "reports"
    build_paper("baseline", out, ROOT / "workflow" / "notebooks", uri, cwd=ROOT)
    build_index(out)
    return out


def chromium(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           f"--window-size={WINDOW[0]},{WINDOW[1]}", "--virtual-time-budget=5000", *args],
                          capture_output=True, text=True, timeout=120)


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is no PNG"
    return struct.unpack(">II", data[16:24])


pytestmark = pytest.mark.slow


def test_report_leads_with_verdicts_without_code_or_stderr(reports):
    page = (reports / "baseline" / "report.html").read_text()
    claims = page.find('class="commlab-claims"')
    assert claims > 0, "no claims table in the report"
    assert page.find('class="commlab-scale"') < claims  # what was run, at which scale, comes first
    first_figure = page.find("<img")
    assert first_figure > claims, "a figure comes before the claims table"
    body = page[page.find("<body"):]
    assert "jp-InputArea-editor" not in body and 'class="highlight' not in body, "code is shown"
    assert 'data-mime-type="application/vnd.jupyter.stderr"' not in body, "a stderr block is shown"
    assert "IProgress" not in body and "Warning" not in body
    assert re.search(r"<td>n=1</td>", page), "the accuracy claim does not say how many seeds"
    assert (reports / "baseline" / "report.ipynb").exists()  # the code, beside the HTML


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (Debian package `chromium`, see the Makefile)")
def test_claims_table_is_within_the_first_screen(reports, tmp_path):
    report = reports / "baseline" / "report.html"
    shot = tmp_path / "report.png"
    done = chromium(f"--screenshot={shot}", report.as_uri())
    assert shot.exists(), done.stderr[-2000:]
    assert png_size(shot) == WINDOW

    probe = report.with_name("probe.html")
    probe.write_text(report.read_text().replace("</body>", PROBE + "</body>"))
    dom = chromium("--dump-dom", probe.as_uri()).stdout
    claims_top = re.search(r'data-claims-top="([^"]+)"', dom)
    figure_top = re.search(r'data-figure-top="([^"]+)"', dom)
    assert claims_top and figure_top, "the layout probe did not run"
    assert float(claims_top[1]) < WINDOW[1] - 100, f"the claims table starts at {claims_top[1]} px"
    assert float(figure_top[1]) > float(claims_top[1])


def test_index_draws_every_method_on_the_cross_paper_charts(reports):
    import pandas as pd

    page = (reports / "index.html").read_text()
    assert 'id="cross-paper"' in page
    for chart in ("cross-paper-bytes", "cross-paper-time"):
        assert re.search(rf'<img class="{chart}"[^>]*src="data:image/png;base64,', page), chart
    runs = pd.read_csv(reports / "baseline" / "runs.csv")
    assert sorted(runs.name) == ["ddp", "ssgd"] and runs.test_accuracy.notna().all()
    assert "loopback" in page  # no emulated link: the time axis says what it measured
    assert 'class="generated-data"' in page  # only generated data here: the page says what that means
