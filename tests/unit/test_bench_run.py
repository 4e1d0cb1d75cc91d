"""bench/run.py, the runner of the goals table's benches: every bench it names exists and
accepts the options it is given (each appears in the script's argument parser)."""

from __future__ import annotations

import importlib.util
import re
import sys

from tests.support.paths import ROOT


def _runner():
    spec = importlib.util.spec_from_file_location("bench_run", ROOT / "bench" / "run.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_every_bench_exists_and_takes_its_options() -> None:
    runner = _runner()
    assert len({b.name for b in runner.BENCHES}) == len(runner.BENCHES)
    for bench in runner.BENCHES:
        script = ROOT / "bench" / bench.args[0]
        assert script.is_file(), script
        source = script.read_text()
        for option in (a for a in bench.args[1:] if a.startswith("--")):
            assert re.search(rf"[\"']{re.escape(option)}[\"']", source), (bench.name, option)


def test_the_list_names_every_command(capsys) -> None:
    runner = _runner()
    assert runner.main(["--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listed] == [b.name for b in runner.BENCHES]
