import pytest
import torch

from hub_cache import add_to_hub_cache
from hub_server import HubServer, closed_port_endpoint


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


def _point_huggingface_hub_at(monkeypatch, root, endpoint: str) -> None:
    """A private HF_HOME under ``root`` and ``endpoint`` as the hub, online, for this test.

    huggingface_hub reads HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE once, at import, into
    ``huggingface_hub.constants``, and every call reads those attributes: the test patches both
    the environment (for subprocesses) and the attributes (for this process).
    """
    import huggingface_hub.constants as hub_constants
    from huggingface_hub.utils import close_session

    home = root / "hf_home"
    (home / "hub").mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    for proxy in ("NO_PROXY", "no_proxy"):  # never send 127.0.0.1 through a proxy
        monkeypatch.setenv(proxy, "127.0.0.1,localhost")
    monkeypatch.setattr(hub_constants, "HF_HOME", str(home))
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub_constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(hub_constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(hub_constants, "AGENT_HARNESSES_PATH", str(home / ".agent_harnesses.json"))
    close_session()  # the next request opens a new HTTP client, which reads NO_PROXY


class OnlineHub:
    """A local hub server (tests/hub_server.py) that huggingface_hub talks to, with a private cache."""

    def __init__(self, server: HubServer, home):
        self.server, self.home, self.cache = server, home, home / "hub"
        self.endpoint = server.endpoint

    def env(self):
        """Environment for a subprocess that should see this hub and cache."""
        return {"HF_HOME": str(self.home), "HF_ENDPOINT": self.endpoint, "NO_PROXY": "127.0.0.1,localhost"}


@pytest.fixture
def online_hub(tmp_path, monkeypatch):
    with HubServer(lifetime_s=120) as server:
        _point_huggingface_hub_at(monkeypatch, tmp_path, server.endpoint)
        yield OnlineHub(server, tmp_path / "hf_home")


@pytest.fixture
def unreachable_hub(tmp_path, monkeypatch):
    """The hub's endpoint is a closed port on 127.0.0.1: every connection is refused at once."""
    endpoint = closed_port_endpoint()
    _point_huggingface_hub_at(monkeypatch, tmp_path, endpoint)
    return endpoint
