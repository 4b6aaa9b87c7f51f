"""JSON, safetensors and JSONL samples as every fisher_select file holds them, read and written here.

Reading: a damaged file is the user's input, not a bug (one ``FisherSelectError``: the path, what is
wrong, what to do).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from fisher_select.errors import FisherSelectError
from fisher_select.run.names import REPORT_FILE

def save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> None:
    """safetensors with contiguous CPU tensors and string metadata."""
    flat = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    try:
        save_file(flat, str(path), metadata={k: str(v) for k, v in (metadata or {}).items()})
    except SafetensorError as err:  # safetensors reports I/O failures (disk full, ...) as its own type
        raise OSError(f"could not write {path}: {err}") from err


def write_json(path: Path, obj) -> None:
    """JSON as every fisher_select file holds it: indented, paths and tensors as text and lists."""
    path.write_text(json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def _json_default(obj):
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


REWRITE_ADVICE = ("re-run the command that wrote it (`fisher-select calibrate ... --overwrite`), or "
                  "`fisher-select migrate RUN` for a run of an older release")


def read_json(path: Path):
    """The JSON in ``path``; a truncated, empty or foreign file is a ``FisherSelectError`` naming it."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise FisherSelectError(f"{path} is not text (binary content where JSON was expected); {REWRITE_ADVICE}") from None
    if not text.strip():
        raise FisherSelectError(f"{path} is empty; {REWRITE_ADVICE}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise FisherSelectError(f"{path} is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno}: "
                                f"truncated or edited); {REWRITE_ADVICE}") from None


def read_samples(path: Path) -> list[dict]:
    """The records of a JSONL file (samples.jsonl); a damaged line is a ``FisherSelectError`` naming it."""
    out = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise FisherSelectError(f"{path} is not text (binary content where JSON lines were expected); "
                                f"{REWRITE_ADVICE}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise FisherSelectError(f"{path}, line {number}: not valid JSON ({err.msg} at column {err.colno}: "
                                    f"truncated or edited); {REWRITE_ADVICE}") from None
        if not isinstance(record, dict):
            raise FisherSelectError(f"{path}, line {number}: a JSON {type(record).__name__}, not a sample record; "
                                    f"{REWRITE_ADVICE}")
        out.append(record)
    return out


def read_run_samples(path: Path, expected: int) -> list[dict]:
    """A run's samples.jsonl, which must hold the ``expected`` samples its report counts: an emptied file, or
    one cut at a line end, parses but is not the run's."""
    samples = read_samples(path)
    if len(samples) != expected:
        raise FisherSelectError(f"{path} holds {len(samples)} sample record(s) but {REPORT_FILE} counts {expected} "
                                f"(emptied or truncated); {REWRITE_ADVICE}")
    return samples


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; a truncated, empty or foreign file is a ``FisherSelectError``."""
    path = Path(path)
    size = path.stat().st_size
    if size < 8:
        raise FisherSelectError(f"{path} is {'empty' if size == 0 else 'truncated'} ({size} bytes; a safetensors "
                                f"file starts with an 8-byte header length); {REWRITE_ADVICE}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        what = _safetensors_problem(str(err), path, size)
        raise FisherSelectError(f"{path} is not a readable safetensors file ({what}); {REWRITE_ADVICE}") from None


def _safetensors_problem(message: str, path: Path, size: int) -> str:
    """Which part of the file is damaged: the header's length, the header, or the tensor data after it."""
    raw = path.read_bytes()
    header = int.from_bytes(raw[:8], "little")
    if header > size - 8:
        return f"truncated safetensors header: it announces {header} bytes, the file has {size - 8} after the length"
    try:
        entries = json.loads(raw[8 : 8 + header])
        end = max((e["data_offsets"][1] for k, e in entries.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):  # not the JSON of a safetensors header
        return f"corrupt safetensors header: {message}"
    if 8 + header + end > size:
        return f"truncated tensor data: the header describes {end} bytes of tensors, the file holds {size - 8 - header}"
    return f"corrupt tensor data: {message}"


def read_json_files(run_dir, pattern: str, remedy: str) -> list[tuple[str, dict]]:
    """(folder name, parsed JSON) of every file matching ``pattern`` in ``run_dir`` (None: []);
    an unreadable one is named, with ``remedy`` (what to do)."""
    if run_dir is None:
        return []
    out = []
    for path in sorted(Path(run_dir).glob(pattern)):
        try:
            out.append((path.parent.name, json.loads(path.read_text())))
        except (OSError, ValueError) as err:
            raise FisherSelectError(f"{path} is unreadable ({err}); {remedy}") from None
    return out
