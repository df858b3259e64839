"""Every model family: the engine ``auto`` picks computes it right, and so does the trainer.

One parametrised test per configuration of ``tests/conformance.py`` (which also prints the
README's table: ``python -m tests.conformance``); the 2-step training runs are ``slow``
except GPT-2's, the model with dropout.
"""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from nanogrpo.algo.heads import PLAIN_HEAD_TYPES
from tests.conformance import CASES, TOL, build, fast_checks, train_check

IDS = [c.name for c in CASES]


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.slow
def test_engine_and_trainer_compute_each_family_right(case):
    r = fast_checks(case)
    assert r["engine"] == case.engine, r["why"]
    assert r["distinct_greedy"] > 1, "the prompts' greedy continuations should differ"
    assert r["greedy_equal"], "greedy tokens differ from model.generate's"
    assert r["engine_logprob_diff"] <= TOL
    assert r["trainer_logprob_diff"] <= TOL and r["trainer_shared_logprob_diff"] <= TOL
    assert r["lean"] == (build(case).config.model_type in PLAIN_HEAD_TYPES)


def _check_train(case, tmp_path):
    r = train_check(case, tmp_path)
    assert r["exit_code"] == 0 and r["steps"] == 2
    assert r["kl_step1"] == 0.0  # policy == reference at step 1: exactly, whatever the model's dropout
    # the checkpoint keeps the model's own configuration (dropout included)
    own = build(case).config.to_dict()
    saved = AutoConfig.for_model(**r["saved_config"]).to_dict()
    for k, v in own.items():
        if "drop" in k:
            assert saved[k] == v, k


GPT2 = [c for c in CASES if c.name.startswith("GPT-2")]


@pytest.mark.parametrize("case", GPT2, ids=[c.name for c in GPT2])
@pytest.mark.slow
def test_dropout_model_trains_with_zero_first_step_kl(case, tmp_path):
    _check_train(case, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if not c.name.startswith("GPT-2")],
                         ids=[n for n in IDS if not n.startswith("GPT-2")])
def test_each_family_trains_with_zero_first_step_kl(case, tmp_path):
    _check_train(case, tmp_path)
