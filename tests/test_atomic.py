"""Atomic outputs: complete or absent, under errors, SIGTERM and SIGINT; orphans of killed writers removed."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fisher_select.atomic import remove_stale_temporaries, write_dir, write_file
from fisher_select.errors import FisherSelectError

_WRITER = """
import sys, time
from pathlib import Path
from fisher_select.atomic import raise_on_sigterm, write_dir, Terminated
raise_on_sigterm()
out = Path(sys.argv[1])
def slow(tmp):
    (tmp / "fisher.safetensors").write_bytes(b"x" * 1000)
    (out.parent / "started").touch()
    time.sleep(60)
try:
    write_dir(out, slow, overwrite=False)
except (Terminated, KeyboardInterrupt) as exc:
    sys.exit(143 if isinstance(exc, Terminated) else 130)
"""


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_while_writing_leaves_nothing_behind(tmp_path, sig, code):
    out = tmp_path / "run"
    # As from a terminal: a job started in the background of a non-interactive shell inherits SIGINT
    # ignored, and Python then never raises KeyboardInterrupt; restore the default for the writer.
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(out)], cwd=Path(__file__).resolve().parent.parent,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 60
    while not (tmp_path / "started").exists():
        assert proc.poll() is None and time.time() < deadline, "writer did not start"
        time.sleep(0.05)
    proc.send_signal(sig)
    assert proc.wait(timeout=30) == code
    assert sorted(p.name for p in tmp_path.iterdir()) == ["started"]  # no run, no temporary


def test_orphans_of_a_killed_writer_are_removed_and_live_ones_kept(tmp_path):
    host = socket.gethostname()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan_dir = tmp_path / f".run.tmp-{host}-{dead.pid}-abc123"
    orphan_file = tmp_path / f".mask.safetensors.tmp-{host}-{dead.pid}-0f0f0f0f"
    live = tmp_path / f".run.tmp-{host}-{os.getpid()}-live_1"
    other_host = tmp_path / f".run.tmp-elsewhere-{dead.pid}-x1"
    for d in (orphan_dir, live, other_host):
        d.mkdir()
    orphan_file.write_text("half")
    assert remove_stale_temporaries(tmp_path / "run") == [orphan_dir]
    write_file(tmp_path / "mask.safetensors", lambda p: p.write_text("ok"), overwrite=False)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted([live.name, other_host.name, "mask.safetensors"])


def test_write_file_refuses_an_existing_file_without_overwrite(tmp_path):
    target = tmp_path / "a.json"
    write_file(target, lambda p: p.write_text("1"), overwrite=False)
    with pytest.raises(FisherSelectError, match="already exists; pass overwrite=True"):
        write_file(target, lambda p: p.write_text("2"), overwrite=False)
    write_dir(tmp_path / "d", lambda p: (p / "x").write_text("1"), overwrite=False)
    assert target.read_text() == "1" and (tmp_path / "d" / "x").read_text() == "1"


def test_unusable_output_paths_are_refused_before_any_work(tmp_path):
    from fisher_select.atomic import check_dir_target

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(FisherSelectError, match="is a file, not a directory"):
        check_dir_target(blocker / "run", overwrite=False)
    with pytest.raises(FisherSelectError, match="exists and is not a directory"):
        check_dir_target(blocker, overwrite=True)
    with pytest.raises(FisherSelectError, match="GiB free but the outputs need"):
        check_dir_target(tmp_path / "new" / "run", overwrite=False, need_bytes=1 << 62)
    check_dir_target(tmp_path / "new" / "run", overwrite=False, need_bytes=1)
    assert not (tmp_path / "new").exists()  # a check creates nothing


def test_a_full_disk_while_writing_tensors_is_an_os_error_and_leaves_nothing(tmp_path, monkeypatch):
    import torch
    from safetensors import SafetensorError

    import fisher_select.run.io as run_io

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(run_io, "save_file", full)
    with pytest.raises(OSError, match="No space left"):
        write_file(tmp_path / "m.safetensors", lambda p: run_io.save_tensors(p, {"a": torch.zeros(2)}), overwrite=False)
    assert list(tmp_path.iterdir()) == []
