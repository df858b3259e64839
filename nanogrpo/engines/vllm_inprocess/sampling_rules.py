"""What every vLLM engine (in-process, :mod:`nanogrpo.engines.vllm_inprocess.engine`; on servers,
:mod:`nanogrpo.engines.vllm_server.engine`) does alike: refuse a request whose log-prob convention
vLLM would not report exactly, seed each request from ``params.seed``, and sample on a row that vLLM
stopped at a stop string nanogrpo's token rule does not see."""

from __future__ import annotations

import logging
import random
import secrets
from dataclasses import replace

from nanogrpo.engines.base import SamplingParams
from nanogrpo.engines.stops import StopStrings
from nanogrpo.errors import ConfigError

log = logging.getLogger("nanogrpo.engines.vllm_inprocess")


def check_convention(params: SamplingParams, tempered: bool) -> None:
    """Refuse a request whose log-prob convention vLLM would not report exactly: ``tempered`` is how vLLM was
    built (``processed_logprobs``, else ``raw_logprobs``; a server: ``--logprobs-mode``). Shared by every
    vLLM engine (in-process and servers)."""
    want = params.logprob_temperature
    truncated = not params.greedy and (params.top_k or params.top_p < 1)
    if params.support_logprobs and truncated and not tempered:
        raise ConfigError("support_logprobs asks for the log-probs over the top-k/top-p support: build "
                          "this vLLM engine with tempered_logprobs=True (rollout.tempered_logprobs)")
    if params.greedy or not tempered:
        got, how = 1.0, "untempered log_softmax(logits)"
    elif (params.top_k or params.top_p < 1) and not params.support_logprobs:
        raise ConfigError("vLLM's tempered log-probs (rollout.tempered_logprobs=true) are taken after "
                          "its top-k/top-p mask, renormalised over the kept tokens, not "
                          "log_softmax(logits / T): ask for them with SamplingParams.support_logprobs "
                          "(as a run with tempered log-probs and top-k/top-p does), or untempered")
    else:
        got, how = params.temperature, f"log_softmax(logits / {params.temperature})"
    if want != got:
        raise ConfigError(f"this vLLM engine reports {how} but the request asks for logprob_temperature="
                          f"{want}; build it with tempered_logprobs={not tempered} "
                          "(rollout.tempered_logprobs) to match")


def request_seeds(params: SamplingParams, count: int) -> list[int]:
    """One seed per prompt (in-process vLLM gives its n samples seed + i), or per sample (a server's
    requests, one per sample): drawn from ``params.seed``."""
    if params.seed is None:
        return [secrets.randbits(62) for _ in range(count)]
    g = random.Random(params.seed)
    return [g.getrandbits(62) for _ in range(count)]


def sample_on(generate, prompts: list[list[int]], params: SamplingParams, stops: StopStrings,
              comp: list[list[int]], lps: list[list[float]], reasons: list[str]) -> None:
    """Rows that vLLM stopped at a stop string where :mod:`nanogrpo.engines.stops` sees none
    (the two decoded the text differently): sampled on with ``generate``, without stop strings, in
    place. Shared by every vLLM engine."""
    odd = [i for i, (c, why) in enumerate(zip(comp, reasons, strict=True))
           if why == "stop_string" and stops.find(c) is None]
    if not odd:
        return
    log.warning("vLLM stopped %d row(s) at a stop string that nanogrpo's token rule does not see; "
                "sampling them on", len(odd))
    for i in odd:
        left = params.max_new_tokens - len(comp[i])
        if left < 1:
            reasons[i] = "length"
            continue
        seed = None if params.seed is None else params.seed + i
        more = generate([prompts[i // params.n] + comp[i]],
                        replace(params, n=1, max_new_tokens=left, stop=(), seed=seed))
        comp[i] += more.completion_ids[0]
        lps[i] += more.logprobs[0]
        reasons[i] = more.finish_reasons[0]
