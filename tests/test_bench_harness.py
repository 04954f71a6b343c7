"""``python -m bench`` is the benchmark's one entry: ``--list`` names every scenario of
bench.runner.SCENARIOS, ``--only`` refuses a name it does not know and says which it knows, a scenario
that runs alone gets its own options; the READMEs' module tables name exactly the modules there are.
Nothing is measured here: the scenarios' own tests (test_bench_*) run them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import __main__ as bench_main
from bench import runner

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
ALONE = [name for name, s in runner.SCENARIOS.items() if s.module is not None]


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bench", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_list_names_every_scenario_with_one_line_each() -> None:
    done = bench("--list")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for name, scenario in runner.SCENARIOS.items():
        [line] = [line for line in lines if line.split()[:1] == [name]]
        assert scenario.about in line
    # the parts of a server's run come first, in the order they run, then those that run alone
    named = [line.split()[0] for line in lines if line.startswith("  ")]
    assert named == list(runner.SCENARIOS)
    assert set(runner.PER_SERVER) | set(ALONE) == set(runner.SCENARIOS) and ALONE
    assert bench("--only").stdout == done.stdout  # --only with no name lists them too


def test_an_unknown_scenario_is_refused_with_the_choices() -> None:
    done = bench("--only", "no-such-scenario")
    assert done.returncode == 2 and done.stdout == ""
    assert "invalid choice: 'no-such-scenario'" in done.stderr
    for name in runner.SCENARIOS:
        assert f"'{name}'" in done.stderr


def test_a_scenario_that_runs_alone_is_named_alone() -> None:
    done = bench("--only", "wake", "soak")
    assert done.returncode == 2
    assert "soak runs alone" in done.stderr and "--only soak" in done.stderr


@pytest.mark.parametrize("name", ALONE)
def test_a_scenario_that_runs_alone_gets_its_own_options(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        bench_main.main(["--only", name, "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m bench --only {name} ")
    assert (BENCH / f"{runner.SCENARIOS[name].module}.py").is_file()


def _table(readme: Path) -> set[str]:
    """The first column of a README's module table: `name.py` or `folder/`."""
    return set(re.findall(r"^\| `([\w/]+(?:\.py|/))` \|", readme.read_text(), re.MULTILINE))


def test_the_module_tables_name_exactly_the_modules_there_are() -> None:
    modules = {p.name for p in BENCH.glob("*.py") if p.name != "__init__.py"} | {"lab/"}
    assert _table(BENCH / "README.md") == modules
    lab = {p.name for p in (BENCH / "lab").glob("*.py") if p.name != "__init__.py"}
    assert lab and _table(BENCH / "lab" / "README.md") == lab
