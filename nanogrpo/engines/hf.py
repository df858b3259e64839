"""Reference engine: Hugging Face ``model.generate`` behind the :class:`Engine` interface.

Simple and slow: it is the yardstick the fast engine is tested against and the
fallback for model families :mod:`nanogrpo.engines.fast` does not know. It wraps
the live model (same weights as the trainer; ``update_weights`` is a
``load_state_dict``). Log-probabilities come from the raw logits ``generate``
returns (``output_logits``), as float32 ``log_softmax(logits / logprob_temperature)``
(untempered by default). Stop strings (``SamplingParams.stop``) end a row through a
stopping criterion that scans each sampled token (:mod:`nanogrpo.engines.stops`).

The helpers at the top (special-id resolution, left padding, cutting at EOS) are
shared with the fast engine.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import nullcontext

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from nanogrpo.algo.support import support_logprobs
from nanogrpo.engines.base import Generation, SamplingParams
from nanogrpo.engines.stops import StopScanner, StopStrings


def resolve_special_ids(model, tokenizer=None, eos_token_id: int | Sequence[int] | None = None,
                        pad_token_id: int | None = None) -> tuple[list[int], int]:
    """EOS ids and the pad id: explicit values, else the tokenizer's, else the model config's."""
    if eos_token_id is None and tokenizer is not None:
        eos_token_id = tokenizer.eos_token_id
    if eos_token_id is None:
        gen_cfg = getattr(model, "generation_config", None)
        eos_token_id = getattr(gen_cfg, "eos_token_id", None) or getattr(model.config, "eos_token_id", None)
    if eos_token_id is None:
        raise ValueError("no EOS token id: pass eos_token_id= or a tokenizer that has one")
    eos = [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(e) for e in eos_token_id]
    if pad_token_id is None and tokenizer is not None:
        pad_token_id = tokenizer.pad_token_id
    if pad_token_id is None:
        pad_token_id = getattr(model.config, "pad_token_id", None)
    return eos, int(eos[0] if pad_token_id is None else pad_token_id)


def check_request(prompts: list[list[int]], params: SamplingParams) -> None:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate() needs at least one prompt and every prompt at least one token")
    if params.max_new_tokens < 1 or params.n < 1:
        raise ValueError(f"max_new_tokens and n must be >= 1, got {params.max_new_tokens} and {params.n}")
    if (params.temperature < 0 or not 0 < params.top_p <= 1 or params.top_k < 0
            or not params.logprob_temperature > 0):
        raise ValueError(f"bad sampling params: temperature={params.temperature} (>= 0), "
                         f"top_p={params.top_p} (in (0, 1]), top_k={params.top_k} (>= 0), "
                         f"logprob_temperature={params.logprob_temperature} (> 0)")
    if params.support_logprobs and not params.greedy and params.logprob_temperature != params.temperature:
        raise ValueError("support_logprobs reports the sampling distribution's log-probs: "
                         f"logprob_temperature must be the temperature ({params.logprob_temperature} != "
                         f"{params.temperature})")


def left_pad(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts right-aligned in one tensor: ids [B, P] and attention mask [B, P] (1 = real token)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def cut_at_eos(tokens: torch.Tensor, logprobs: torch.Tensor, eos_ids: list[int], ignore_eos: bool = False
               ) -> tuple[list[list[int]], list[list[float]], list[str]]:
    """Per row: keep tokens up to and including the first EOS. tokens [R, N] long, logprobs [R, N] float."""
    tokens, logprobs = tokens.cpu(), logprobs.float().cpu()
    n = tokens.shape[1]
    if ignore_eos:
        lengths = torch.full((tokens.shape[0],), n)
        stopped = torch.zeros(tokens.shape[0], dtype=torch.bool)
    else:
        is_eos = torch.isin(tokens, torch.tensor(eos_ids))  # [R, N]
        stopped = is_eos.any(1)
        lengths = torch.where(stopped, is_eos.int().argmax(1) + 1, n)
    ids, lps = tokens.tolist(), logprobs.tolist()
    lens = lengths.tolist()
    return ([r[:k] for r, k in zip(ids, lens, strict=True)], [r[:k] for r, k in zip(lps, lens, strict=True)],
            ["stop" if s else "length" for s in stopped.tolist()])


def cut_at_stop(stops: StopStrings, comp: list[list[int]], logprobs: list[list[float]], reasons: list[str]
                ) -> tuple[list[list[int]], list[list[float]], list[str]]:
    """Cut each sequence after the token that completes a stop string (finish reason ``stop_string``)."""
    comp, logprobs, reasons = list(comp), list(logprobs), list(reasons)
    for i, c in enumerate(comp):
        k = stops.find(c)
        if k is not None:
            comp[i], logprobs[i], reasons[i] = c[:k], logprobs[i][:k], "stop_string"
    return comp, logprobs, reasons


class _StopCriterion(StoppingCriteria):
    """``model.generate`` stopping criterion: a row is done on the token that completes a stop string."""

    def __init__(self, stops: StopStrings, width: int):
        self.width = width
        self.scanners: list[StopScanner] | None = None
        self.stops = stops

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        if self.scanners is None:
            self.scanners = [self.stops.scanner() for _ in range(input_ids.shape[0])]
        last = input_ids[:, -1].tolist()
        if input_ids.shape[1] <= self.width:
            return torch.zeros(len(last), dtype=torch.bool, device=input_ids.device)
        return torch.tensor([s.push(t) for s, t in zip(self.scanners, last)], device=input_ids.device)


class HFEngine:
    """``model.generate`` with left-padded prompts; each prompt repeated ``n`` times.

    ``ignore_eos=True`` (for benchmarks) forces ``max_new_tokens`` tokens per
    sequence (HF's ``min_new_tokens``); every finish reason is then ``"length"``.
    """

    name = "hf"

    def __init__(self, model, eos_token_id: int | Sequence[int] | None = None,
                 pad_token_id: int | None = None, *, tokenizer=None, ignore_eos: bool = False,
                 record_routes: bool = False):
        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids, self.pad_id = resolve_special_ids(model, tokenizer, eos_token_id, pad_token_id)
        self.ignore_eos = ignore_eos
        self.record_routes = record_routes
        """A mixture-of-experts model: each sequence's routes in ``Generation.routes``
        (:class:`nanogrpo.moe.replay.GenerationRoutes`; ``moe.routing_replay`` sets it)."""

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    vision = None
    """The model's :class:`~nanogrpo.data.images.ImageSpec` when it takes images (set by the engine
    factory); None: a text model."""

    def generate(self, prompts: list[list[int]], params: SamplingParams, images=None) -> Generation:
        """``images``: per prompt, its :class:`~nanogrpo.data.images.VisionInputs` (vision-language
        models; every one of the prompt's ``n`` samples sees them)."""
        check_request(prompts, params)
        ids, mask = left_pad(prompts, self.pad_id, self.device)
        ids, mask = ids.repeat_interleave(params.n, 0), mask.repeat_interleave(params.n, 0)  # [R, P]
        mm = {}
        if images is not None:
            from nanogrpo.algo.vision import concat
            from nanogrpo.models.vision import forward_kwargs

            if len(images) != len(prompts):
                raise ValueError(f"{len(images)} image inputs for {len(prompts)} prompts")
            pv, grid, _ = concat([(v.pixel_values, v.grid) for v in images for _ in range(params.n)],
                                 images[0].pixel_values.shape[1])
            mm = {k: v for k, v in forward_kwargs(self.model, ids, pv, grid).items() if k != "position_ids"}
        if self.vision is not None or images is not None:
            from nanogrpo.models.vision import media_token_ids

            mm["suppress_tokens"] = media_token_ids(self.model)  # never sampled: they stand for pixels
        n_new = params.max_new_tokens
        kw = dict(max_new_tokens=n_new, do_sample=not params.greedy, eos_token_id=self.eos_ids,
                  pad_token_id=self.pad_id, output_logits=True, return_dict_in_generate=True,
                  repetition_penalty=1.0)  # override whatever the checkpoint's generation_config sets
        if not params.greedy:
            kw.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
        if self.ignore_eos:
            kw["min_new_tokens"] = n_new
        stops = StopStrings(self.tokenizer, params.stop)
        if stops:
            kw["stopping_criteria"] = StoppingCriteriaList([_StopCriterion(stops, ids.shape[1])])
        cuda = ids.device.type == "cuda"
        routes = _route_recorder(self.model) if self.record_routes else nullcontext()
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.random.fork_rng(devices=[ids.device] if cuda else []), torch.no_grad(), routes:
                if params.seed is not None:
                    torch.manual_seed(params.seed)
                if cuda:
                    torch.cuda.synchronize(ids.device)
                t0 = time.perf_counter()
                out = self.model.generate(input_ids=ids, attention_mask=mask, **kw, **mm)
                if cuda:
                    torch.cuda.synchronize(ids.device)
                gen_s = time.perf_counter() - t0
                new = out.sequences[:, ids.shape[1]:]  # [R, T], T <= n_new
                lp_t = params.logprob_temperature
                if params.support_logprobs and not params.greedy:  # what generate's warpers sampled from
                    sup = (params.top_k, params.top_p)
                    lps = torch.stack([support_logprobs(step.float() / lp_t, new[:, t], sup)
                                       for t, step in enumerate(out.logits)], 1)  # [R, T]
                else:
                    lps = torch.stack([torch.log_softmax(step.float() / lp_t, -1).gather(1, new[:, t:t + 1])
                                       [:, 0] for t, step in enumerate(out.logits)], 1)  # [R, T]
        finally:
            self.model.train(was_training)
        comp, logprobs, reasons = cut_at_eos(new, lps, self.eos_ids, self.ignore_eos)
        if stops:
            comp, logprobs, reasons = cut_at_stop(stops, comp, logprobs, reasons)
        n_tok = sum(len(c) for c in comp)
        per_seq = None
        if self.record_routes:  # (prompt + completion tokens, moe_layers, top_k) per sequence
            plens = mask.sum(1).tolist()
            per_seq = routes.samples(plens, [len(c) for c in comp], ids.shape[1])
        return Generation(comp, logprobs, reasons,
                          stats={"generate_s": gen_s, "new_tokens": float(n_tok),
                                 "decode_steps": float(new.shape[1]), "tok_per_s": n_tok / max(gen_s, 1e-9)},
                          routes=per_seq)

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy new weights into the live model's parameters (in place)."""
        load_in_place(self.model, state_dict)


def _route_recorder(model):
    from nanogrpo.moe.replay import GenerationRoutes

    return GenerationRoutes(model)


def load_in_place(model, state_dict: dict[str, torch.Tensor]) -> None:
    """``load_state_dict`` that copies into the existing tensors; unknown keys are an error.

    Missing keys are allowed (a partial update); the tensors' storage never changes,
    so anything holding their addresses (CUDA graphs, views) sees the new values.
    """
    result = model.load_state_dict(state_dict, strict=False)
    if result.unexpected_keys:
        raise KeyError(f"update_weights: keys not in the model: {result.unexpected_keys[:5]}"
                       f"{' ...' if len(result.unexpected_keys) > 5 else ''}")
