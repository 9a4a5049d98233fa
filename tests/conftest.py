import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session", autouse=True)
def _data_cache(tmp_path_factory):
    """The Arrow cache of tokenized data (slidedp/train/arrowdata.py) in a temporary folder, not ~/.cache."""
    before = os.environ.get("SLIDEDP_DATA_CACHE")
    os.environ["SLIDEDP_DATA_CACHE"] = str(tmp_path_factory.mktemp("data-cache"))
    yield
    if before is None:
        os.environ.pop("SLIDEDP_DATA_CACHE", None)
    else:
        os.environ["SLIDEDP_DATA_CACHE"] = before


@pytest.fixture(autouse=True)
def _torch_threads_unchanged():
    """A test that leaves torch's intra-op thread count changed fails (and the count is restored):
    later tests would otherwise sum in another order than when run alone (test_exactness.py)."""
    import torch

    before = torch.get_num_threads()
    yield
    after = torch.get_num_threads()
    if after != before:
        torch.set_num_threads(before)
        pytest.fail(f"the test left torch's thread count at {after} (it was {before})", pytrace=False)
