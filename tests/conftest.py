from __future__ import annotations

import os

import pytest

from tests.checkpoints import ARCHS, build_checkpoint, build_gpt2_tokenized_checkpoint

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny test models gain nothing from intra-op threads, and on a loaded 2-core machine every parallel
# region waits for the busiest core. Servers started by tests inherit this.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """arch name -> (model dir, transformers model) for every supported architecture."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {arch: (root / arch, build_checkpoint(root / arch, arch)) for arch in ARCHS}


@pytest.fixture(scope="session")
def llama_dir(checkpoints):
    return checkpoints["llama"][0]


@pytest.fixture(scope="session")
def gpt2_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2-llama")
    build_gpt2_tokenized_checkpoint(path)
    return path
