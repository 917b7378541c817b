"""Paper grids (config/papers/*.yaml) against their schema (src/commlab/schemas/grid.schema.yaml):
every committed grid validates and resolves at its smoke and laptop scales; a bad key is named."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from commlab.config import ConfigError, run_dir
from commlab.grid import check_grid, load_grid_file, resolve_grid

ROOT = Path(__file__).resolve().parents[1]
GRIDS = sorted((ROOT / "config" / "papers").glob("*.yaml"))


@pytest.mark.parametrize("path", GRIDS, ids=[p.stem for p in GRIDS])
def test_every_committed_grid_validates(path):
    grid = load_grid_file(path.stem, path.parent)
    for scale in ("laptop", "smoke"):
        if scale == "laptop" or scale in (grid.get("scales") or {}):
            configs = resolve_grid(path.stem, scale=scale, papers_dir=path.parent)
            assert configs and all(c["scale"] == scale for c in configs.values())


@pytest.mark.parametrize("edit, named", [
    (lambda g: g.update(sede=[0]), "['sede']"),
    (lambda g: g.setdefault("scales", {}).setdefault("smoke", {}).update(bse={}), "['bse'] at scales.smoke"),
    (lambda g: g.update(seeds="0"), "key seeds"),
    (lambda g: g.update(runs={}), "key runs"),
])
def test_a_bad_grid_key_is_named(tmp_path, edit, named):
    grid = yaml.safe_load((ROOT / "config" / "papers" / "baseline.yaml").read_text())
    edit(grid)
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(grid))
    with pytest.raises(ConfigError, match=named.replace("[", r"\[").replace("]", r"\]")) as err:
        load_grid_file("bad", tmp_path)
    assert "bad.yaml" in str(err.value)
    with pytest.raises(ConfigError):
        check_grid(grid, "bad.yaml")


def test_run_dir_holds_the_scale():
    config = {"paper": "kstep", "name": "k16", "method": "kstep", "seed": 2}
    assert run_dir({**config, "scale": "smoke"}) == Path("results/smoke/kstep/k16/seed2")
    assert run_dir({**config, "scale": "paper"}, root="out") == Path("out/paper/kstep/k16/seed2")
    assert run_dir(config) == Path("results/adhoc/kstep/k16/seed2")
    assert run_dir({**config, "output_dir": "x/y"}) == Path("x/y")
