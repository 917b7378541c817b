"""Every command the README and the docs pages in PAGES show parses: the lines of their ```bash
blocks and the inline `commlab ... --option` commands of their prose. Nothing runs; each tool's own
parser reads the arguments (commlab's argparse, each benchmark's own argparse for `commlab bench
NAME ...`, torchrun's, Snakemake's, MLflow's click command, `make -n`), so an option or subcommand
a page names and the code lacks fails here rather than in a reader's shell. Likewise each method
and grid the README's table of papers and methods names exists.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# The pages whose commands are checked: the README and the reference pages beside it.
PAGES = [README, *(ROOT / "docs" / name for name in (
    "running.md", "paper-scale.md", "architecture.md", "reports.md", "performance.md", "cluster.md",
    "tasks.md", "asgd.md", "network.md", "claims.md", "diloco.md", "ssdsgd.md"))]
SHELL_ONLY = {"source", "export", "cd"}  # shell built-ins: nothing of the project's to parse
SLURM_TOOLS = {"sinfo", "squeue", "sacct", "scontrol", "sbatch"}  # SLURM's own commands, not the project's


def readme_commands(text: str) -> list[str]:
    """The commands of a page: bash block lines (comments dropped, continuations joined) and
    inline code spans with options that start with `commlab ` or `python -m commlab`."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                commands.append(line)
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    commands += [c for c in re.findall(r"`([^`\n]+)`", prose)  # a command with options, not a name
                 if c.startswith(("commlab ", "python -m commlab")) and " -" in c.removeprefix("python -m ")]
    return commands


class _Parsed(Exception):
    """A benchmark's own parser has read its arguments: the benchmark stops there, before it runs."""


def _parse_benchmark(name: str, args: list[str]) -> None:
    """Parse ``args`` with benchmark ``name``'s own parser. Each benchmark builds its parser inside
    its entry point and parses first, so the entry point is called with ``parse_args`` stopping it
    right after a successful parse."""
    from commlab.registry import BENCHMARKS

    try:
        bench = BENCHMARKS.get(name)
    except ValueError as err:
        raise AssertionError(f"no benchmark {name!r}: {err}") from err
    parse_args = argparse.ArgumentParser.parse_args

    def parse_then_stop(parser, *a, **k):
        parse_args(parser, *a, **k)
        raise _Parsed

    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop):
        try:
            bench(args, json_path=None)
        except _Parsed:
            return
    raise AssertionError(f"benchmark {name!r} returned without parsing its arguments")


def _parse_commlab(args: list[str]) -> None:
    from commlab.cli import build_parser

    parsed = build_parser().parse_args(args)
    if parsed.command == "bench":  # its arguments after the name go to the benchmark's own parser
        _parse_benchmark(parsed.name, parsed.rest)


def _parse_torchrun(args: list[str]) -> None:
    from torch.distributed.run import parse_args

    parse_args(args)


def _parse_snakemake(args: list[str]) -> None:
    from snakemake.cli import get_argument_parser

    get_argument_parser().parse_args(args)


def _parse_mlflow(args: list[str]) -> None:
    from mlflow.cli import cli

    cli.make_context("mlflow", list(args), resilient_parsing=False)


def _parse_make(args: list[str]) -> None:
    out = subprocess.run(["make", "-n", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def parse(command: str) -> None:
    """Parse ``command`` with its tool's parser; argparse's SystemExit becomes an assertion."""
    argv = shlex.split(command)
    while argv and re.match(r"^[A-Z_]+=", argv[0]):  # VAR=value prefixes set the environment
        argv = argv[1:]
    if argv[-1] == "&":
        argv = argv[:-1]
    tool = Path(argv[0]).name
    if argv[:3] == ["python", "-m", "commlab"]:
        tool, argv = "commlab", ["commlab", *argv[3:]]
    elif argv[:3] == ["python", "-m", "commlab.testing.localslurm"]:
        tool, argv = "commlab.testing.localslurm", argv[2:]
    parsers = {"commlab": _parse_commlab, "torchrun": _parse_torchrun, "snakemake": _parse_snakemake,
               "mlflow": _parse_mlflow, "make": _parse_make}
    if tool in SHELL_ONLY | SLURM_TOOLS:
        return
    if tool == "commlab.testing.localslurm":
        from commlab.testing.localslurm import build_parser

        return build_parser().parse_args(argv[1:]) and None
    assert tool in parsers, f"command with no parser in this test: {command!r} (add one)"
    try:
        parsers[tool](argv[1:])
    except SystemExit as err:
        raise AssertionError(f"command does not parse: {command!r}") from err


def page_commands() -> list[tuple[str, str]]:
    """(page, command) for every command of every page in PAGES."""
    return [(page.relative_to(ROOT).as_posix(), command) for page in PAGES
            for command in readme_commands(page.read_text())]


def test_readme_commands_are_found():
    readme = readme_commands(README.read_text())
    assert "make" in readme and "make test" in readme  # the set-up's two commands
    commands = [command for _, command in page_commands()]
    assert any(c.startswith("commlab launch --config run.yaml --network-mbit") for c in commands)
    assert any(c.startswith("snakemake --workflow-profile workflow/profiles/slurm") for c in commands)
    assert any(c.startswith("commlab bench syncs") for c in commands)


COMMANDS = page_commands()


@pytest.mark.parametrize("page,command", COMMANDS, ids=[f"{page}: {command}" for page, command in COMMANDS])
def test_readme_command_parses(page, command, monkeypatch):
    monkeypatch.chdir(ROOT)
    parse(command)


def test_a_wrong_option_is_caught():
    with pytest.raises(AssertionError, match="does not parse"):
        parse("commlab launch --config run.yaml --network-gbit 1")
    with pytest.raises(AssertionError, match="does not parse"):
        parse("commlab bench wire --from")  # --from needs its files
    with pytest.raises(AssertionError, match="does not parse"):
        parse("commlab bench throughput --networks loopback --no-such-option")
    with pytest.raises(AssertionError, match="no benchmark"):
        parse("commlab bench no_such_benchmark")
    with pytest.raises(AssertionError, match="does not parse"):
        parse("snakemake --workflow-profile workflow/profiles/slurm --no-such-option")


def test_launch_network_options_reach_the_launcher(monkeypatch):
    """`commlab launch --network-mbit/--latency-ms` (README, docs/network.md) are the launcher's own."""
    import commlab.launch.command
    from commlab.cli import main
    from commlab.launch.client import SERVER_ENV

    calls = []
    monkeypatch.delenv(SERVER_ENV, raising=False)  # no warm launcher: the launch runs here
    monkeypatch.setattr(commlab.launch.command, "launch", lambda *args, **marks: calls.append(args) or 0)
    assert main(["launch", "--config", "run.yaml", "--network-mbit", "1000", "--latency-ms", "0.5"]) == 0
    assert calls == [("run.yaml", None, 1000.0, 0.5)]


def papers_table(text: str) -> tuple[set[str], set[str]]:
    """The method names and the grid names of the README's table of papers and methods: the
    `code` spans of its methods column and of its grid column."""
    assert "## Papers and methods" in text
    section = text[text.index("## Papers and methods"):].split("\n## ", 1)[0]
    rows = [line.split("|")[1:-1] for line in section.splitlines() if line.startswith("|")][2:]  # past the head
    assert rows and all(len(cells) == 3 for cells in rows), "a row of paper | methods | grid"
    methods = {name for cells in rows for name in re.findall(r"`([a-z0-9_]+)`", cells[1])}
    grids = {name for cells in rows for name in re.findall(r"`([a-z0-9_]+)`", cells[2])}
    return methods, grids


def test_what_the_readme_table_names_exists():
    """Each method the README's table of papers and methods names is registered, and each grid it
    names is a grid file. The table is not the full list (a new method need not be added to it):
    `commlab list` is, and tests/test_method_traits.py checks that it lists every method."""
    import commlab.algorithms  # noqa: F401 - registers the package's methods
    from commlab.registry import ALGORITHMS

    methods, grids = papers_table(README.read_text())
    assert {"ssgd", "kstep", "oktopk", "redsync", "ssdsgd", "adpsgd"} <= methods  # the table was read
    assert sorted(methods - set(ALGORITHMS.package_names())) == []
    assert sorted(g for g in grids if not (ROOT / "config" / "papers" / f"{g}.yaml").is_file()) == []
