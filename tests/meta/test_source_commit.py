"""``benchmarks.runner.source_commit``: a results row names the tplogp that ran. The commit of the enclosing git
repository only when that repository tracks the package's files (``+dirty`` only for changes to those files),
else the package's version: a copy vendored untracked into another repository is not that repository's commit.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

import tplogp
from benchmarks import runner

PACKAGE = os.path.dirname(os.path.abspath(tplogp.__file__))

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(repo, *args) -> str:
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t")
    out = subprocess.run(["git", *args], cwd=repo, env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def _monorepo(tmp_path):
    """A git repository with one committed file of its own and an unpacked copy of the package under vendor/."""
    repo = tmp_path / "mono"
    (repo / "app").mkdir(parents=True)
    (repo / "app" / "main.py").write_text("x = 1\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "app")
    _git(repo, "commit", "-q", "-m", "app")
    vendored = repo / "vendor" / "tplogp"
    shutil.copytree(PACKAGE, vendored, ignore=shutil.ignore_patterns("__pycache__"))
    return repo, vendored


def test_untracked_vendored_copy_is_named_by_its_version(tmp_path):
    repo, vendored = _monorepo(tmp_path)
    (repo / "app" / "main.py").write_text("x = 2\n")  # the monorepo is dirty too: still not tplogp's commit
    assert runner.source_commit(str(vendored)) == f"v{tplogp.__version__}"
    assert runner.source_commit(str(vendored), version="9.9") == "v9.9"


def test_tracked_copy_is_named_by_the_commit_dirty_only_for_its_own_files(tmp_path):
    repo, vendored = _monorepo(tmp_path)
    _git(repo, "add", "vendor")
    _git(repo, "commit", "-q", "-m", "vendor tplogp")
    head = _git(repo, "rev-parse", "--short", "HEAD")
    assert runner.source_commit(str(vendored)) == head
    (repo / "app" / "main.py").write_text("x = 3\n")  # a change outside the package
    (repo / "notes.txt").write_text("untracked\n")
    assert runner.source_commit(str(vendored)) == head
    with open(vendored / "__init__.py", "a") as f:  # a change to the package's own file
        f.write("# local edit\n")
    assert runner.source_commit(str(vendored)) == head + "+dirty"


def test_outside_any_repository(tmp_path):
    copy = tmp_path / "site" / "tplogp"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    env_ceiling = os.environ.get("GIT_CEILING_DIRECTORIES")
    os.environ["GIT_CEILING_DIRECTORIES"] = str(tmp_path)  # no repository above tmp_path is consulted
    try:
        assert runner.source_commit(str(copy)) == f"v{tplogp.__version__}"
    finally:
        if env_ceiling is None:
            del os.environ["GIT_CEILING_DIRECTORIES"]
        else:
            os.environ["GIT_CEILING_DIRECTORIES"] = env_ceiling
