"""Route records (nanogrpo.moe.routes): compact storage, the batch field and its wire format, vLLM's
formats (hand-made payloads), the mismatch metrics on hand-worked numbers, and the [moe] config."""

from __future__ import annotations

import base64
import io
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from nanogrpo.batch import BatchError, RolloutBatch
from nanogrpo.config import Config
from nanogrpo.errors import ConfigError
from nanogrpo.moe import (
    NO_ROUTE,
    RouteError,
    batch_routes,
    from_completion_output,
    from_server_choice,
    from_vllm,
    mismatch_metrics,
    mismatch_sums,
    moe_spec,
    route_bytes,
    route_dtype,
    router_disagreement,
)
from nanogrpo.moe.families import MoeSpec, softmax_gather
from nanogrpo.moe.routes import decode_npy_base64, pack, unpack
from tests.moe_models import batch_tensors, build


def spec_of(layers=2, experts=6, k=2, layer_ids=None, num_layers=None) -> MoeSpec:
    ids = tuple(layer_ids or range(layers))
    return MoeSpec("qwen3_moe", routers=(None,) * len(ids), names=tuple(f"l{i}" for i in ids), layer_ids=ids,
                   num_layers=num_layers or layers, num_experts=experts, top_k=k, gate=softmax_gather)


def npy_b64(arr: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


def test_records_are_the_smallest_integers_that_hold_the_experts():
    assert [route_dtype(e) for e in (6, 128, 254, 255, 256, 32767)] == [torch.uint8] * 3 + [torch.int16] * 3
    with pytest.raises(RouteError, match="40000 experts: route records hold at most 32767"):
        route_dtype(40000)
    ids = torch.tensor([[0, 5], [NO_ROUTE, NO_ROUTE], [253, 1]])
    for dt in (torch.uint8, torch.int16):
        assert torch.equal(unpack(pack(ids, dt)), ids)
    assert pack(ids, torch.uint8)[1].tolist() == [255, 255]
    # memory: Qwen3-30B-A3B's 48 MoE layers of 128 experts, top 8: 384 bytes per token
    big = spec_of(layers=48, experts=128, k=8)
    assert big.bytes_per_token == 384 and route_bytes(big, 4096) == 1_572_864
    assert spec_of(layers=61, experts=256, k=8).bytes_per_token == 61 * 8 * 2   # DeepSeek-V3: int16


def _batch(routes=None):
    ids, am, cm, p = batch_tensors()
    n = ids.shape[0]
    return RolloutBatch(input_ids=ids, attention_mask=am.to(torch.int8), completion_mask=cm,
                        rewards=torch.arange(n, dtype=torch.float32), advantages=torch.zeros(n),
                        group_ids=torch.arange(n) // 2, old_logprobs=-torch.ones(cm.shape) * cm,
                        prompt_len=p, group_size=2, routes=routes)


def test_per_sample_records_line_up_with_the_batch_s_padding():
    spec = spec_of()
    b = _batch()
    am = b.attention_mask.bool()
    per_row = []
    for i in range(b.num_seqs):                                              # token j of row i holds (i, j)
        t = int(am[i].sum())
        per_row.append(pack(torch.stack([torch.full((t, 2), i), torch.arange(t)[:, None].expand(t, 2)], 1)
                            % 6, torch.uint8))
    r = batch_routes(per_row, b.attention_mask, b.prompt_len, spec)
    assert r.shape == (6, 12, 2, 2) and r.dtype == torch.uint8
    u = unpack(r)
    assert (u[~am] == NO_ROUTE).all()
    for i in range(6):
        assert u[i][am[i]][:, 1, 0].tolist() == [j % 6 for j in range(int(am[i].sum()))]
    with pytest.raises(RouteError, match=r"row 2: routes for 11 tokens, the row has 3 prompt \+ 5 "):
        batch_routes([*per_row[:2], per_row[0], *per_row[3:]], b.attention_mask, b.prompt_len, spec)
    with pytest.raises(RouteError, match="5 route records for a batch of 6 rows"):
        batch_routes(per_row[:5], b.attention_mask, b.prompt_len, spec)
    with pytest.raises(RouteError, match=r"row 0's routes name expert 9; qwen3_moe has 6 experts"):
        batch_routes([torch.full_like(per_row[0], 9), *per_row[1:]], b.attention_mask, b.prompt_len, spec)
    # a batch carries them over the wire and through select / to
    b.routes = r
    back = RolloutBatch.from_bytes(b.to_bytes(), num_experts=6)
    assert torch.equal(back.routes, r)
    assert torch.equal(b.select(torch.tensor([4, 1])).routes, r[[4, 1]])
    assert b.to("cpu").routes is not None
    assert RolloutBatch.from_bytes(_batch().to_bytes()).routes is None      # optional


def test_a_batch_refuses_routes_that_do_not_fit_in_one_line():
    good = torch.full((6, 12, 2, 2), 255, dtype=torch.uint8)
    b = _batch()
    good[b.attention_mask.bool()] = 1
    cases = [
        (good.long(), "routes must be a uint8 or int16 tensor, got torch.int64"),
        (good[:, :11], r"routes has shape \(6, 11, 2, 2\), expected \(6, 12, moe_layers, top_k\)"),
        (torch.ones(6, 12, 2, 2, dtype=torch.uint8), "routes on padding must be the none-value"),
        (torch.where(good == 1, 9, good), "routes name expert 9; the model has 6"),
        (torch.full((6, 12, 2, 2), -3, dtype=torch.int16), "routes hold a negative expert id"),
    ]
    for routes, msg in cases:
        with pytest.raises(BatchError, match=msg):
            _batch(routes).validate(num_experts=6)
    data = _batch(good.clone()).to_bytes()
    with pytest.raises(BatchError, match="routes name expert 1; the model has 1"):
        RolloutBatch.from_bytes(data, num_experts=1)
    RolloutBatch.from_bytes(data, num_experts=2)


def test_vllm_routes_in_process_and_from_the_token_route():
    """vLLM's (tokens - 1, decoder layers, top_k) arrays: the MoE layers kept, one NO_ROUTE row for the last
    token, expert ids and shapes checked (hand-made payloads: vLLM's CPU build returns none, see the note)."""
    spec = spec_of(layers=2, layer_ids=[1, 3], num_layers=4)                # layers 0 and 2 dense
    arr = np.arange(5 * 4 * 2, dtype=np.uint8).reshape(5, 4, 2) % 6        # 6 tokens: 5 rows
    rec = from_vllm(arr, 6, spec)
    assert rec.shape == (6, 2, 2) and rec.dtype == torch.uint8
    assert torch.equal(unpack(rec[:5]), torch.from_numpy(arr[:, [1, 3]]).long())
    assert (unpack(rec[5]) == NO_ROUTE).all()
    assert torch.equal(from_vllm(arr[:, [1, 3]], 6, spec), rec)            # already MoE layers only
    out = SimpleNamespace(token_ids=[7, 8, 9], routed_experts=arr)
    assert torch.equal(from_completion_output(out, 3, spec), rec)
    assert from_completion_output(SimpleNamespace(token_ids=[7], routed_experts=None), 3, spec) is None
    choice = {"index": 0, "token_ids": [7, 8, 9], "routed_experts": npy_b64(arr.astype(np.uint16))}
    assert torch.equal(from_server_choice(choice, 3, spec), rec)
    assert from_server_choice({"index": 0, "token_ids": [7]}, 3, spec) is None  # a server without the flag
    bad = [
        (lambda: from_vllm(arr, 8, spec), r"routes for 5 tokens, the sample has 8 \(expected 7"),
        (lambda: from_vllm(arr[:, :3], 6, spec), r"3 layers, qwen3_moe has 2 MoE layers of 4"),
        (lambda: from_vllm(arr[..., :1], 6, spec), r"top 1 experts per token, qwen3_moe routes to 2"),
        (lambda: from_vllm(arr + 6, 6, spec), r"expert ids in \[\d+, \d+\], qwen3_moe has 6 experts"),
        (lambda: from_vllm(arr.astype(np.float32), 6, spec), "expected a 3-D integer array"),
        (lambda: decode_npy_base64("not base64!"), "routed_experts is not base64 of a .npy array"),
        (lambda: decode_npy_base64(npy_b64(np.zeros(3, dtype=np.float16))), "expected an integer array"),
        (lambda: from_server_choice({"routed_experts": npy_b64(arr)}, 3, spec), "no token_ids"),
    ]
    for call, msg in bad:
        with pytest.raises(RouteError, match=msg):
            call()
    obj = io.BytesIO()
    np.save(obj, np.array([{"a": 1}], dtype=object), allow_pickle=True)     # a pickle is never loaded
    with pytest.raises(RouteError, match="not base64 of a .npy array"):
        decode_npy_base64(base64.b64encode(obj.getvalue()).decode())


def test_mismatch_metrics_on_hand_worked_numbers():
    trainer = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-3.0, -1.0, -9.0, 0.0]])
    engine = torch.tensor([[-1.5, -2.0, -0.5, 0.0], [-2.0, -1.0, -1.0, 0.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    tot = {k: float(v) for k, v in mismatch_sums(trainer, engine, mask).items()}
    # Δ over the 5 trained tokens: 0.5, 0, 0, -1, 0 (the -8 is off the mask)
    k3 = (math.exp(0.5) - 0.5 - 1) + (math.exp(-1) + 1 - 1)
    m = mismatch_metrics(tot)
    assert m["mismatch_abs"] == pytest.approx(1.5 / 5) and m["mismatch_abs_max"] == pytest.approx(1.0)
    assert m["mismatch_kl"] == pytest.approx(k3 / 5)
    assert m["mismatch_ratio_out"] == pytest.approx(1 / 5)                   # |-1| > ln 2, 0.5 is not
    assert mismatch_metrics({k: float(v) for k, v in mismatch_sums(trainer, engine, mask, tau=1.5).items()}
                            )["mismatch_ratio_out"] == pytest.approx(2 / 5)   # ln 1.5 = 0.405 < 0.5
    a = pack(torch.tensor([[[0, 1], [2, 3]], [[4, 5], [0, 1]], [[1, 2], [NO_ROUTE, NO_ROUTE]]]), torch.uint8)
    b = pack(torch.tensor([[[1, 0], [2, 4]], [[4, 5], [0, 2]], [[1, 3], [0, 1]]]), torch.uint8)
    # token 0: layer 0 same set in another order, layer 1 differs; token 1: layer 1 differs; token 2: layer 0
    # differs, layer 1 has no record
    assert router_disagreement(a, b) == (3, 5)
    assert router_disagreement(a, b, torch.tensor([True, True, False])) == (2, 4)
    assert mismatch_metrics({"route_token_layers": 5.0, "route_flipped": 3.0}) == {"router_disagreement": 0.6}


def test_the_moe_config_section_is_strict_and_checked_across_sections():
    cfg = Config.from_dict({})
    assert (cfg.moe.routing_replay, cfg.moe.ratio_band) == ("off", 2.0)
    on = Config.from_dict({}, {"moe.routing_replay": "rollout", "rollout.engine": "hf"})
    assert on.moe.routing_replay == "rollout"
    r2 = Config.from_dict({}, {"moe.routing_replay": "policy", "rollout.engine": "vllm"})
    assert r2.moe.routing_replay == "policy"
    # vLLM returns routes (enable_return_routed_experts): R3 is taken on both vLLM engines
    r3 = Config.from_dict({}, {"moe.routing_replay": "rollout", "rollout.engine": "vllm"})
    assert (r3.moe.routing_replay, r3.rollout.engine) == ("rollout", "vllm")
    tier = Config.from_dict({}, {"moe.routing_replay": "rollout", "rollout.engine": "vllm_server",
                                 "rollout.servers": ["http://127.0.0.1:8100"]})
    assert tier.moe.routing_replay == "rollout"
    bad = [
        ({"moe.routing_replay": "r3"}, "Input should be 'off', 'rollout' or 'policy'"),
        ({"moe.replay": "rollout"}, "unknown config key 'moe.replay'"),
        ({"moe.ratio_band": 1.0}, "moe.ratio_band"),
        ({"moe.routing_replay": "rollout", "rollout.engine": "fast"}, "the fast engine does not run mixture"),
        ({"moe.routing_replay": "rollout", "rollout.engine": "vllm", "vllm.enable_prefix_caching": False},
         "only with its prefix cache on; set vllm.enable_prefix_caching=true"),
        ({"moe.routing_replay": "rollout", "rollout.engine": "vllm", "tools.enabled": True},
         "multi-turn rollouts"),
        ({"moe.routing_replay": "rollout", "tools.enabled": True}, "multi-turn rollouts"),
    ]
    for over, msg in bad:
        with pytest.raises(ConfigError, match=msg):
            Config.from_dict({}, over)


def test_a_real_model_s_spec_sizes_its_records():
    spec = moe_spec(build("qwen3_moe"))
    ids, am, _, _ = batch_tensors()
    assert route_bytes(spec, int(am.sum())) == int(am.sum()) * 2 * 2
    assert spec.describe() == "qwen3_moe: 2 MoE layers of 6 experts, top 2 (4 bytes of routes per token)"
    assert ids.shape == am.shape
