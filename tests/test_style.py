"""The repo's one code style (pyproject.toml: ruff format, 2-space indent) holds for every Python file."""

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _ruff():
  exe = shutil.which("ruff") or str(pathlib.Path(sys.executable).with_name("ruff"))
  if not pathlib.Path(exe).exists():
    pytest.fail(
      "ruff is not installed: `pip install -e '.[test]'` installs it (the formatter is part of the test extra)"
    )
  return exe


def test_every_python_file_is_formatted():
  out = subprocess.run([_ruff(), "format", "--check", "."], cwd=ROOT, capture_output=True, text=True)
  assert out.returncode == 0, f"run `ruff format .` from the repo root:\n{out.stdout}{out.stderr}"
