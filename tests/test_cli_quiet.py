"""Third-party noise is silenced by the entry points (CLI, bench scripts), never by an import."""

import logging
import subprocess
import sys
from pathlib import Path

from fisher_select.cli import _QUIET_LOGGERS, quiet_third_party_loggers


def test_quiet_drops_warnings_of_the_listed_loggers_only(caplog):
    listed, other = logging.getLogger(_QUIET_LOGGERS[0]), logging.getLogger("bitsandbytes.other")
    before = listed.level
    try:
        listed.setLevel(logging.NOTSET)
        quiet_third_party_loggers()
        with caplog.at_level(logging.WARNING):
            listed.warning("Failed to load CPU gemm_4bit_forward")
            other.warning("kept")
            listed.error("an error still shows")
        messages = [r.getMessage() for r in caplog.records]
        assert messages == ["kept", "an error still shows"]
    finally:
        listed.setLevel(before)


def test_importing_the_package_leaves_other_loggers_alone():
    code = ("import logging, fisher_select, fisher_select.cli; "
            f"print(logging.getLogger({_QUIET_LOGGERS[0]!r}).level)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0"


def test_bench_outcomes_quiets_before_its_imports():
    script = Path(__file__).resolve().parents[1] / "bench" / "outcomes.py"
    code = "\n".join([
        "import logging, runpy",
        f"main = runpy.run_path({str(script)!r}, run_name='bench_outcomes')['main']",
        "try:",
        "    main(['--help'])",
        "except SystemExit:",
        "    pass",
        f"print(logging.getLogger({_QUIET_LOGGERS[0]!r}).level)"])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == str(logging.ERROR)
