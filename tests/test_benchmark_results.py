"""benchmarks/results: every results file records the conditions of its run (benchmark, command,
commit, device, library versions; benchmarks/conditions.py), and the index in
benchmarks/results/README.md is the one printed from those records."""
from __future__ import annotations

import subprocess

import pytest
import torch

from benchmarks import conditions
from tests.checks import ROOT

FILES = conditions.results_files()


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_each_results_file_records_its_conditions(path):
    c = conditions.read_conditions(path)
    assert tuple(c) == conditions.KEYS, c
    assert all(c[k] for k in conditions.KEYS), c
    assert (ROOT / c["benchmark"]).is_file(), c["benchmark"]
    assert c["benchmark"].split("/")[-1] in c["command"]
    assert c["commit"] != "unknown" and "torch" in c["versions"]
    assert c["recorded"] == "by the run" or c["recorded"].startswith("afterwards (not by the run)")


def test_the_index_is_printed_from_the_files():
    assert conditions.index_markdown() in (ROOT / "benchmarks" / "results" / "README.md").read_text(), \
        "regenerate it: python benchmarks/conditions.py --index"


def test_a_run_records_this_checkouts_commit_its_command_and_versions(monkeypatch):
    head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], capture_output=True,
                          text=True, cwd=ROOT).stdout.strip()
    monkeypatch.setattr("sys.argv", ["benchmarks/x.py", "--json", "a b.json"])
    c = conditions.run_conditions("cpu")
    assert c["commit"].split("+")[0] == head
    assert c["command"] == "python benchmarks/x.py --json 'a b.json'"
    assert c["device"].startswith("CPU: ") and c["recorded"] == "by the run"
    assert c["versions"]["torch"] == torch.__version__


def test_without_git_history_the_commit_comes_from_the_environment(monkeypatch):
    monkeypatch.setattr(conditions, "_git", lambda *args: None)
    monkeypatch.setenv(conditions.COMMIT_ENV, "abc1234")
    assert conditions.current_commit() == "abc1234"
    monkeypatch.delenv(conditions.COMMIT_ENV)
    assert conditions.current_commit() == "unknown"


def test_a_named_commit_wins_over_a_copys_git_metadata(monkeypatch):
    """A tree copied to a GPU host may carry git metadata of another commit than its files
    (seen: an older HEAD, so "<old>+uncommitted"): the commit named by whoever copied it wins."""
    monkeypatch.setattr(conditions, "_git", lambda *args: "b29462d" if "rev-parse" in args
                        else " M moe_plugins/x.py")
    monkeypatch.delenv(conditions.COMMIT_ENV, raising=False)
    assert conditions.current_commit() == "b29462d+uncommitted"
    monkeypatch.setenv(conditions.COMMIT_ENV, "1eb3b0d")
    assert conditions.current_commit() == "1eb3b0d"


def test_a_stand_in_is_named_as_one(monkeypatch):
    import sys
    import types

    fake = types.ModuleType("deep_ep")
    fake.__file__ = str(ROOT / "benchmarks" / "zero_cost_deep_ep.py")
    monkeypatch.setitem(sys.modules, "deep_ep", fake)
    assert conditions.run_conditions("cpu", ["deep_ep"])["versions"]["deep_ep"] == \
        "stand-in benchmarks/zero_cost_deep_ep.py"


def test_a_tree_with_changes_is_named_as_uncommitted(tmp_path, monkeypatch):
    """In a git checkout (a fresh one here), the commit is HEAD's; a tracked file changed makes
    it ``<head>+uncommitted``; a file git does not track changes nothing."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                              cwd=tmp_path, check=True, capture_output=True,
                              text=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("commit", "-q", "-m", "one")
    head = git("rev-parse", "--short=7", "HEAD")
    monkeypatch.setattr(conditions, "ROOT", tmp_path)
    assert conditions.current_commit() == head
    (tmp_path / "new.py").write_text("y = 2\n")
    assert conditions.current_commit() == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert conditions.current_commit() == f"{head}+uncommitted"
