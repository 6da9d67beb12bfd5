import pytest
import torch

from hub_cache import add_to_hub_cache


def pytest_collection_modifyitems(config, items):
    """Skip CUDA tests where there is no GPU or no CuPy (CI); run them on the device with `pytest -m cuda`."""
    has_cuda = torch.cuda.is_available()
    try:
        import cupy  # noqa: F401  (import only to see whether it works)

        has_cupy = True
    except Exception:
        has_cupy = False
    if has_cuda and has_cupy:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device and CuPy")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def single_intra_op_thread():
    """One intra-op thread for a module of tests on tiny tensors (restored afterwards)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class OfflineHub:
    """A private, offline Hugging Face cache for one test (huggingface_hub's own constants patched)."""

    def __init__(self, root):
        self.home = root / "hf_home"
        self.cache = self.home / "hub"
        self.cache.mkdir(parents=True)

    def add(self, repo_id, files, revision="main"):
        return add_to_hub_cache(self.cache, repo_id, files, revision=revision)

    def env(self):
        """Environment for a subprocess that should see this cache, offline."""
        return {"HF_HOME": str(self.home), "HF_HUB_OFFLINE": "1"}


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub_constants

    hub = OfflineHub(tmp_path)
    monkeypatch.setenv("HF_HOME", str(hub.home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(hub.cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    return hub
