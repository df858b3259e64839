"""Test-wide settings: tiny models run fastest on one thread, and the CPU is often shared; the tests
never ask the HF hub (those of datasets stand in for ``datasets.load_dataset``): offline mode, which
the tests of asking the hub (test_hub_source.py) turn off for themselves."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _hub_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def servers(tmp_path_factory):
    """Two real ``vllm serve`` processes for the server-tier tests (tests/vllm_fixtures.py), one session's
    worth: started on first use only (the vLLM environment)."""
    from tests.vllm_fixtures import two_servers

    yield from two_servers(tmp_path_factory.mktemp("vllm-servers"))
