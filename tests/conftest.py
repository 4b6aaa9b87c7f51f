"""Shared fixtures: tiny models built from config objects (no download), the embedded default."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "PYTEST_XDIST_WORKER" in os.environ:  # one thread per worker: two workers share two cores
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from fisher_select.models import EMBEDDED_DEFAULT, load_model  # noqa: E402
from tests.tiny import TINY_MODELS, tiny_model  # noqa: E402,F401

if "PYTEST_XDIST_WORKER" in os.environ:
    torch.set_num_threads(1)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: end-to-end runs on the embedded default or several processes "
                                       "(`make test-fast` leaves them out; `make test` runs everything else)")
    config.addinivalue_line("markers", "simulation: the GPU machine simulated on this CPU (a fresh venv, minutes; "
                                       "left out by default: `pytest -m simulation`, or bash bench/gpu_simulate.sh)")


SLOW_FIXTURES = {"embedded", "demo_run"}  # the embedded default loaded, or calibrated from the CLI


def pytest_collection_modifyitems(config, items):
    """A test that loads the embedded default's weights, or calibrates it end to end, is slow."""
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def smol_tokenizer():
    """The embedded default's tokenizer alone (no weights loaded), once per test process."""
    from transformers import AutoTokenizer

    from fisher_select.models import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path(EMBEDDED_DEFAULT), local_files_only=True)


@pytest.fixture(scope="session")
def small_llama_dir(tmp_path_factory, smol_tokenizer):
    """A small random Llama (width 32, one layer) with the embedded default's tokenizer, as a model directory.

    Shared read-only by every test that needs a real tokenizer and a model directory the CLI loads."""
    from tests.tiny import save_small_llama

    return save_small_llama(tmp_path_factory.mktemp("small-llama") / "model", smol_tokenizer, hidden=32,
                            intermediate=64, layers=1)


@pytest.fixture(scope="session")
def embedded():
    """(model, tokenizer, path) of the embedded default, loaded once per test process."""
    torch.manual_seed(0)
    return load_model(EMBEDDED_DEFAULT)
