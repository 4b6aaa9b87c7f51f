"""The README's examples run as written, in order, after `make demo`.

`make demo` is replaced by a smaller calibration of the same recipe into ``runs/demo`` (and its
``select`` into ``runs/demo/mask.safetensors``); every command-line example then runs in a fresh
shell in that folder, in the README's order, and the Python blocks run in one interpreter, in
order (the second uses the first's ``model``). Only the sizes differ from the README: each
``fisher-select calibrate`` line gets the small settings below appended (its own flags stay), so
the suite keeps its time budget; `make demo` runs the full-size form.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every README command, in order, on the embedded default

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# Big enough that some reward varies (S > 0, which `select --threshold` needs): the demo recipe's graded
# reward varies within almost every prompt.
SMALL = "--num-prompts 2 --samples-per-prompt 4 --max-new-tokens 8 --no-progress"


def fenced_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def commands(block: str) -> list[str]:
    return [line.split(" #")[0].strip() for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_readme_has_the_examples_this_test_runs():
    text = README.read_text()
    assert len(fenced_blocks(text, "bash")) == 1 and len(fenced_blocks(text, "python")) == 2
    assert "make demo" in text and "make test" in text


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A folder as `make demo` leaves it (smaller): runs/demo, its mask, and the shipped recipes."""
    work = tmp_path_factory.mktemp("readme")
    (work / "recipes").symlink_to(ROOT / "recipes")
    demo = f"fisher-select calibrate --recipe recipes/rl-arithmetic-graded.yaml --out runs/demo --overwrite {SMALL}"
    shell(f"{demo} && fisher-select select runs/demo --top 0.01 --out runs/demo/mask.safetensors", work)
    return work


def shell(command: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    done = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"README example failed: {command}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done


def test_command_line_examples_run_in_order(workdir):
    (block,) = fenced_blocks(README.read_text(), "bash")
    lines = commands(block)
    assert lines and all(line.startswith("fisher-select ") for line in lines)
    for line in lines:
        shell(f"{line} {SMALL}" if line.startswith("fisher-select calibrate") else line, workdir)
    written = {p.name for p in (workdir / "runs").iterdir()}
    for line in lines:  # each example wrote the file it names
        for out in re.findall(r"--out (\S+)", line):
            assert Path(out).name in written, (line, sorted(written))


def test_python_examples_run_in_order(workdir):
    blocks = fenced_blocks(README.read_text(), "python")
    script = workdir / "readme_examples.py"
    script.write_text("\n".join(blocks))
    shell(f"{Path(sys.executable)} {script.name}", workdir)
    assert (workdir / "runs" / "demo-top1.safetensors").is_file()
