"""MoE routes from the vLLM engines, without vLLM (the main environment): vLLM's flag asked for where the run
replays routes (in-process ``LLM`` arguments, ``nanogrpo vllm-serve`` command lines), the route arrays read
as vLLM 0.32 lays them out, the in-process engine over a stand-in ``vllm.LLM`` and the server engine over
small HTTP servers that answer the token route as ``vllm serve`` does, and the one-line refusals.

vLLM 0.32's layout (site-packages/vllm), which the stand-ins reproduce:

- ``model_executor/layers/fused_moe/routed_experts_capturer.py:30-41,67-68,185-187``: one row per token of
  (``get_total_num_hidden_layers()``, ``num_experts_per_tok``), every decoder layer (a dense layer's
  column is left as the zeroed capture buffer holds it), uint8 for <= 256 experts, else uint16;
- ``distributed/aux_output_connector/connector.py:103-126`` (``take_output``): rows up to
  ``request.num_tokens - 1``: every token but the last (never forwarded), from
  ``routed_experts_prompt_start`` (default 0: the whole prompt);
- ``v1/engine/output_processor.py:466-474``: the rows of a finished request concatenated
  (``np.concatenate``) into ``CompletionOutput.routed_experts`` (``outputs.py:84``);
- ``entrypoints/scale_out/token_in_token_out/serving.py:439-455`` and ``protocol.py:408-416``: on
  ``/inference/v1/generate`` each choice's ``routed_experts`` is ``numpy2base64`` of that array
  (``utils/serial_utils.py:67-71``: ``np.save(allow_pickle=False)``, then base64), None when the server
  was started without ``--enable-return-routed-experts``.

tests/test_vllm.py checks the same against the installed vLLM's own classes and encoder, and the CPU
build's refusal of the flag.
"""

from __future__ import annotations

import base64
import io
import json
import sys
import threading
import types
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers as tf

from nanogrpo.config import Config
from nanogrpo.engines.base import SamplingParams
from nanogrpo.engines.vllm_inprocess.process import build_cause
from nanogrpo.engines.vllm_inprocess.routes import LLM_FLAG, SERVE_FLAG, route_refusal
from nanogrpo.errors import ConfigError
from nanogrpo.moe import RouteError, batch_routes, from_vllm, moe_spec
from nanogrpo.moe.routes import NO_ROUTE, from_completion_output, from_server_choice, unpack
from nanogrpo.rollout.collect import pad_batch
from tests.moe_models import COMMON, MOE, PAD, TOK
from tests.test_server_tier import engine_over, stop, url

PROMPTS = [[5, 6, 7, 8], [20, 21]]


def qwen3_moe(seed: int = 0, **kw) -> tf.Qwen3MoeForCausalLM:
    """A tiny Qwen3-MoE whose head size vLLM's CPU attention takes (32), 6 experts, top 2."""
    cfg = tf.Qwen3MoeConfig(**{**COMMON, "head_dim": 32, "num_experts": 6, "norm_topk_prob": True, **MOE,
                               **kw})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return tf.Qwen3MoeForCausalLM(cfg).eval()


def vllm_routes(n_tokens: int, layers: int, k: int, experts: int, moe_layers=None) -> np.ndarray:
    """Routes as vLLM returns them for a sample of ``n_tokens`` tokens: (n_tokens - 1, every decoder layer,
    k), uint8 (<= 256 experts) or uint16; expert ``(3 t + l + 2 j) % experts`` (distinct over j for k <= 3
    and experts >= 6); the columns of layers not in ``moe_layers`` zero, as vLLM's capture buffer leaves
    them."""
    t, layer, j = np.meshgrid(np.arange(n_tokens - 1), np.arange(layers), np.arange(k), indexing="ij")
    arr = (3 * t + layer + 2 * j) % experts
    if moe_layers is not None:
        arr[:, [i for i in range(layers) if i not in moe_layers]] = 0
    return np.ascontiguousarray(arr.astype(np.uint8 if experts <= 256 else np.uint16))


def npy_base64(arr: np.ndarray) -> str:
    """vLLM's ``numpy2base64``."""
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return base64.b64encode(buf.getbuffer()).decode("ascii")


# ----------------------------------------------------------------------------- the parsers, vLLM's layout


def test_vllm_route_arrays_become_records_every_token_but_the_last():
    spec = moe_spec(qwen3_moe())
    arr = vllm_routes(4 + 3, spec.num_layers, spec.top_k, spec.num_experts)
    out = SimpleNamespace(token_ids=[9, 10, 11], routed_experts=arr)
    rec = from_completion_output(out, 4, spec)
    assert rec.dtype == torch.uint8 and tuple(rec.shape) == (7, 2, 2)
    assert torch.equal(unpack(rec[:6]), torch.from_numpy(arr.astype(np.int64)))
    assert (unpack(rec[6]) == NO_ROUTE).all()                                 # the last token: none
    choice = {"index": 0, "token_ids": [9, 10, 11], "routed_experts": npy_base64(arr)}
    assert torch.equal(from_server_choice(choice, 4, spec), rec)
    assert from_server_choice({"index": 0, "token_ids": [9], "routed_experts": None}, 4, spec) is None
    assert from_completion_output(SimpleNamespace(token_ids=[9], routed_experts=None), 4, spec) is None


def test_a_dense_layer_s_column_is_left_out_and_uint16_ids_are_read():
    model = qwen3_moe(num_hidden_layers=3, mlp_only_layers=[1])              # layers 0 and 2 route
    spec = moe_spec(model)
    assert (spec.num_layers, spec.layer_ids) == (3, (0, 2))
    arr = vllm_routes(5, 3, 2, 6, moe_layers=(0, 2))
    rec = from_vllm(arr, 5, spec)
    assert torch.equal(unpack(rec[:4]), torch.from_numpy(arr[:, [0, 2]].astype(np.int64)))
    big = replace(spec, num_experts=300)                                      # over 256: vLLM sends uint16
    arr = vllm_routes(5, 3, 2, 300, moe_layers=(0, 2))
    arr[0, 0] = [299, 257]
    assert arr.dtype == np.uint16
    rec = from_vllm(arr, 5, big)
    assert rec.dtype == torch.int16 and unpack(rec)[0, 0].tolist() == [299, 257]


# ----------------------------------------------------------------------------- the in-process engine


class StandInLLM:
    """``vllm.LLM`` as far as the engine uses it: its arguments kept (``built``), ``refuse`` raised when built
    with routes on, and ``generate`` answering each request with tokens 7, 8, ... (log-prob -0.5) and, built
    with routes on, routes laid out as vLLM lays them out, the outputs of a request out of order."""

    built: list[dict] = []
    refuse: Exception | None = None

    def __init__(self, model: str, **kw):
        if kw.get(LLM_FLAG) and StandInLLM.refuse is not None:
            raise StandInLLM.refuse
        StandInLLM.built.append(kw)
        self.kw = kw
        hf = tf.AutoConfig.from_pretrained(model)
        self.shape = (hf.num_hidden_layers, getattr(hf, "num_experts_per_tok", 0),
                      getattr(hf, "num_experts", 0))

    def collective_rpc(self, *a, **kw):
        pass

    def reset_prefix_cache(self):
        pass

    def generate(self, prompts, sps, use_tqdm=False, lora_request=None):
        outs = []
        for p, sp in zip(prompts, sps, strict=True):
            n_prompt = len(p["prompt_token_ids"])
            comps = []
            for j in range(sp.n):
                ids = [7 + j + i for i in range(sp.max_tokens)]
                routes = vllm_routes(n_prompt + len(ids), *self.shape) if self.kw.get(LLM_FLAG) else None
                comps.append(SimpleNamespace(index=j, token_ids=ids, finish_reason="length", stop_reason=None,
                                             logprobs=[{t: SimpleNamespace(logprob=-0.5)} for t in ids],
                                             routed_experts=routes))
            outs.append(SimpleNamespace(outputs=comps[::-1]))
        return outs


@pytest.fixture
def stand_in_vllm(monkeypatch):
    """The in-process engine over :class:`StandInLLM` (``import vllm`` answered by a stand-in module)."""
    import nanogrpo.engines.vllm_inprocess.engine as engine_mod

    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = StandInLLM, lambda **kw: SimpleNamespace(**kw)
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    monkeypatch.setattr(engine_mod, "import_vllm", lambda: vllm)
    for var in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_LOGGING_LEVEL", "VLLM_LOGGING_STREAM"):
        monkeypatch.setenv(var, "")
    StandInLLM.built, StandInLLM.refuse = [], None
    yield engine_mod.VLLMEngine
    StandInLLM.built, StandInLLM.refuse = [], None


def test_vllm_options_ask_for_routes_only_where_the_run_replays_them():
    from nanogrpo.engines.vllm_inprocess import vllm_options

    r3 = Config.load(None, ["rollout.engine=vllm", "moe.routing_replay=rollout"])
    assert vllm_options(r3)["return_routes"] is True
    for mode in ("off", "policy"):
        assert not vllm_options(Config.load(None, ["rollout.engine=vllm", f"moe.routing_replay={mode}"])
                                )["return_routes"]


def test_the_engine_is_built_with_the_flag_for_a_moe_model_and_fills_routes_once_asked(stand_in_vllm):
    VLLMEngine = stand_in_vllm
    model = qwen3_moe()
    spec = moe_spec(model)
    eng = VLLMEngine(model, eos_token_id=2, pad_token_id=PAD, max_batch=4, return_routes=True)
    assert StandInLLM.built[-1][LLM_FLAG] is True and eng.record_routes is False
    params = SamplingParams(max_new_tokens=3, n=2, seed=0)
    assert eng.generate(PROMPTS, params).routes is None                       # not asked (record_routes)
    eng.record_routes = True                                                  # as RoutingReplay sets it
    gen = eng.generate(PROMPTS, params)
    assert len(gen.routes) == 4 and [c[0] for c in gen.completion_ids] == [7, 8, 7, 8]  # by output index
    for i, rec in enumerate(gen.routes):
        n = len(PROMPTS[i // 2]) + 3
        want = vllm_routes(n, spec.num_layers, spec.top_k, spec.num_experts)
        assert tuple(rec.shape) == (n, 2, 2) and torch.equal(unpack(rec[:-1]), torch.from_numpy(want).long())
    prompts = [p for p in PROMPTS for _ in range(2)]                          # aligned with the batch
    ids, am, cm, _, p = pad_batch(prompts, gen.completion_ids, gen.logprobs, PAD)
    routes = batch_routes(gen.routes, am, p, spec)
    assert routes.shape[:2] == ids.shape and (unpack(routes)[2, :2] == NO_ROUTE).all()  # row 2's padding
    assert torch.equal(routes[2, 2:], gen.routes[2])


def test_a_dense_model_or_a_run_without_replay_builds_without_the_flag_and_records_nothing(stand_in_vllm):
    VLLMEngine = stand_in_vllm
    from nanogrpo.models.tiny import make_model

    dense = VLLMEngine(make_model("demo", TOK), tokenizer=TOK, max_batch=4, return_routes=True)
    plain = VLLMEngine(qwen3_moe(), eos_token_id=2, pad_token_id=PAD, max_batch=4)
    assert not any(kw.get(LLM_FLAG) for kw in StandInLLM.built)
    assert not hasattr(dense, "record_routes") and not hasattr(plain, "record_routes")
    assert plain.generate(PROMPTS, SamplingParams(max_new_tokens=2, seed=0)).routes is None
    # the flag passed by hand (vllm.llm_kwargs): routes returned, and recorded once asked
    by_hand = VLLMEngine(qwen3_moe(), eos_token_id=2, pad_token_id=PAD, max_batch=4,
                         llm_kwargs={LLM_FLAG: True})
    by_hand.record_routes = True
    assert len(by_hand.generate(PROMPTS, SamplingParams(max_new_tokens=2, seed=0)).routes) == 2


def test_replay_of_the_engine_s_routes_is_refused_at_setup_where_vllm_was_built_without_them(stand_in_vllm):
    from nanogrpo.training.routing import RoutingReplay

    VLLMEngine = stand_in_vllm
    cfg = Config.load(None, ["rollout.engine=vllm", "moe.routing_replay=rollout"])
    model = qwen3_moe()
    with pytest.raises(ConfigError, match="the vllm engine records no routes"):
        RoutingReplay.for_run(cfg, model, VLLMEngine(model, eos_token_id=2, pad_token_id=PAD, max_batch=4))
    eng = VLLMEngine(model, eos_token_id=2, pad_token_id=PAD, max_batch=4, return_routes=True)
    assert RoutingReplay.for_run(cfg, model, eng) is not None and eng.record_routes is True


def test_a_vllm_that_cannot_return_routes_is_one_line_at_build(stand_in_vllm):
    """vLLM's refusal comes as a pydantic ValidationError opening "1 validation error for VllmConfig"; the
    engine says the cause and the way out in one line (the real CPU build: tests/test_vllm.py)."""
    import pydantic

    VLLMEngine = stand_in_vllm

    class VllmConfig(pydantic.BaseModel):
        @pydantic.model_validator(mode="after")
        def aux(self):
            raise ValueError("AuxOutput Connector requires Model Runner V2; set VLLM_USE_V2_MODEL_RUNNER=1.")

    with pytest.raises(pydantic.ValidationError) as err:
        VllmConfig()
    assert str(err.value).startswith("1 validation error for VllmConfig")
    assert build_cause(err.value) == route_refusal(err.value) == (
        "Value error, AuxOutput Connector requires Model Runner V2; set VLLM_USE_V2_MODEL_RUNNER=1.")
    assert route_refusal(ValueError("Unsupported CPU attention configuration")) is None
    StandInLLM.refuse = err.value
    with pytest.raises(ConfigError) as e:
        VLLMEngine(qwen3_moe(), eos_token_id=2, pad_token_id=PAD, max_batch=4, return_routes=True)
    assert str(e.value) == (
        "rollout.engine=vllm cannot return MoE routes on this vLLM build (Value error, AuxOutput Connector "
        "requires Model Runner V2; set VLLM_USE_V2_MODEL_RUNNER=1.): use rollout.engine=hf, or "
        "moe.routing_replay=policy")
    with pytest.raises(ConfigError, match=f"remove {LLM_FLAG} from vllm.llm_kwargs"):
        VLLMEngine(qwen3_moe(), eos_token_id=2, pad_token_id=PAD, max_batch=4, llm_kwargs={LLM_FLAG: True})
    VLLMEngine(qwen3_moe(), eos_token_id=2, pad_token_id=PAD, max_batch=4)    # without the flag: built
    with pytest.raises(ConfigError, match="prefix cache on"):
        VLLMEngine(qwen3_moe(), eos_token_id=2, pad_token_id=PAD, max_batch=4, return_routes=True,
                   enable_prefix_caching=False)


# ----------------------------------------------------------------------------- the server tier


class RoutesServer(BaseHTTPRequestHandler):
    """``vllm serve`` on the token route: ``max_tokens`` tokens 7, 8, ... (log-prob -0.5) under
    ``server.version`` and, started with routes on (``server.routes``: (decoder layers, top_k, experts)),
    each choice's ``routed_experts`` as vLLM encodes it; ``/health``."""

    def log_message(self, *a):
        pass

    def _send(self, obj) -> None:
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send({})

    def do_POST(self):
        srv = self.server
        req = json.loads(self.rfile.read(int(self.headers["content-length"])))
        srv.hits += 1
        n = req["sampling_params"]["max_tokens"]
        ids = [7 + i for i in range(n)]
        routes = None if srv.routes is None else \
            npy_base64(vllm_routes(len(req["token_ids"]) + n, *srv.routes))
        self._send({"choices": [{
            "index": 0, "finish_reason": "length", "stop_reason": None, "token_ids": ids,
            "weight_versions": [{"version": "3", "start": 0, "end": n}], "routed_experts": routes,
            "logprobs": {"content": [{"token_id": t, "logprob": -0.5} for t in ids]}}]})


def routes_server(routes):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), RoutesServer)
    srv.hits, srv.routes = 0, routes
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    return srv


@pytest.fixture
def with_and_without():
    """Two servers of the tiny Qwen3-MoE (2 layers, top 2 of 6): the first returns routes, the second was
    started without the flag."""
    a, b = routes_server((2, 2, 6)), routes_server(None)
    yield a, b
    for s in (a, b):
        stop(s)


def test_the_server_engine_reads_each_choice_s_routes_and_none_where_a_server_sends_none(with_and_without):
    a, b = with_and_without
    spec = moe_spec(qwen3_moe())
    eng = engine_over(a, b, route_spec=spec)
    params = SamplingParams(max_new_tokens=3, n=4, seed=0)
    assert eng.record_routes is False and eng.generate(PROMPTS, params).routes is None
    eng.record_routes = True
    gen = eng.generate(PROMPTS, params)
    assert a.hits > 0 and b.hits > 0 and len(gen.routes) == 8
    got = [r for r in gen.routes if r is not None]
    assert 0 < len(got) < 8                                                   # the second server's: None
    for i, rec in enumerate(gen.routes):
        if rec is not None:
            n = len(PROMPTS[i // 4]) + 3
            want = torch.from_numpy(vllm_routes(n, 2, 2, 6)).long()
            assert tuple(rec.shape) == (n, 2, 2) and torch.equal(unpack(rec[:-1]), want)
    assert not hasattr(engine_over(a, route_spec=None), "record_routes")     # a dense model's engine


def test_routes_of_another_model_from_a_server_stop_the_run_in_one_line(with_and_without):
    a, _ = with_and_without
    a.routes = (5, 2, 6)                                                      # five layers: not this model
    eng = engine_over(a, route_spec=moe_spec(qwen3_moe()))
    eng.record_routes = True
    with pytest.raises(RouteError) as err:
        eng.generate(PROMPTS, SamplingParams(max_new_tokens=2, seed=0))
    assert "\n" not in str(err.value) and "routes of another model?" in str(err.value)


def test_a_server_without_routes_is_refused_before_the_model_loads_under_r3(with_and_without):
    from nanogrpo.engines.vllm_server.contact import ServerWithoutRoutes, preflight

    a, b = with_and_without

    def cfg(servers, mode="rollout"):
        return Config.load(None, ["rollout.engine=vllm_server", f"rollout.servers={json.dumps(servers)}",
                                  f"moe.routing_replay={mode}", "vllm_server.connect_wait_s=2"])

    preflight(cfg([url(a)]))                                                  # routes on: nothing said
    assert a.hits == 1
    with pytest.raises(ServerWithoutRoutes) as err:
        preflight(cfg([url(a), url(b)]))
    assert str(err.value) == (
        f"moe.routing_replay=rollout: the vLLM server at {url(b)} returns no MoE routes (started without "
        "--enable-return-routed-experts, or its model is dense): start it with nanogrpo vllm-serve --config "
        "<the run's config>, or set moe.routing_replay=policy")
    hits = b.hits
    preflight(cfg([url(b)], "off"))                                           # not replayed: not asked
    assert b.hits == hits


def test_vllm_serve_starts_moe_servers_with_the_flag_only_where_the_run_replays_routes(tmp_path):
    from nanogrpo.launch import serve_command
    from nanogrpo.models.tiny import make_model

    moe, dense = tmp_path / "moe", tmp_path / "dense"
    qwen3_moe().config.save_pretrained(moe)
    make_model("tiny", TOK).config.save_pretrained(dense)
    for d in (moe, dense):
        TOK.save_pretrained(d)

    def cmd(model, mode, cuda=False):
        cfg = Config.load(None, ["rollout.engine=vllm_server", 'rollout.servers=["http://127.0.0.1:1"]',
                                 f"model.path={model}", f"moe.routing_replay={mode}"])
        return serve_command(cfg, 8100, state_dir=tmp_path / f"state-{model.name}", cuda=cuda)[0]

    assert SERVE_FLAG in cmd(moe, "rollout") and SERVE_FLAG in cmd(moe, "rollout", cuda=True)
    assert SERVE_FLAG not in cmd(moe, "off") and SERVE_FLAG not in cmd(moe, "policy")
    assert SERVE_FLAG not in cmd(dense, "rollout")
