"""A built wheel carries the recipes and their data, and works outside the checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # builds a wheel and calibrates with it in a new environment

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_ships_recipes_and_calibrates_outside_the_checkout(tmp_path):
    source = tmp_path / "source"  # a copy: the build leaves build/ and egg-info behind
    shutil.copytree(ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(
        ".venv", ".git", "build", "runs", "*.egg-info", "__pycache__", ".pytest_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "dist"), str(source)], check=True, capture_output=True)
    wheel = next((tmp_path / "dist").glob("fisher_select-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"fisher_select/recipes/rl-arithmetic.yaml", "fisher_select/recipes/data/arithmetic.jsonl"} <= names
    assert {"fisher_select/studies/data/general_english.txt", "fisher_select/run/outcomes.py"} <= names
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1"}
    work = tmp_path / "elsewhere"  # no recipes/ folder here: everything must come from the wheel
    work.mkdir()

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "fisher_select", *args], cwd=work, env=env,
                              capture_output=True, text=True)

    where = subprocess.run([sys.executable, "-c", "import fisher_select; print(fisher_select.__file__)"],
                           cwd=work, env=env, capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(site))
    listed = cli("recipes")
    assert listed.returncode == 0 and "rl-arithmetic" in listed.stdout and str(site) in listed.stdout
    run = cli("calibrate", "--out", "run", "--num-prompts", "1", "--samples-per-prompt", "2",
              "--max-new-tokens", "2", "--no-progress")
    assert run.returncode == 0, run.stderr
    assert (work / "run" / "fisher.safetensors").is_file()
