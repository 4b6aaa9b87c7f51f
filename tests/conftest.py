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


@pytest.fixture(scope="session")
def embedded():
    """(model, tokenizer, path) of the embedded default, loaded once per test process."""
    torch.manual_seed(0)
    return load_model(EMBEDDED_DEFAULT)
