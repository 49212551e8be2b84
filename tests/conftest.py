import pytest
import torch

import minibatch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def random_llama():
    return minibatch.load_model("random-llama", device="cpu")


@pytest.fixture(scope="session")
def tiny():
    return minibatch.load_model("tiny", device="cpu")
