"""The in-process vLLM engine (the package docstring says how it works): :class:`VLLMEngine` and the
policy's weights as it takes them (:func:`policy_state_dict`: LoRA adapters merged)."""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from nanogrpo.engines.base import Generation, SamplingParams
from nanogrpo.engines.hf import check_request, resolve_special_ids
from nanogrpo.engines.stops import StopStrings
from nanogrpo.engines.vllm_inprocess.options import (
    CPU_HEAD_SIZES,
    MIN_CPU_KV_BYTES,
    head_dim,
    kv_bytes_per_token,
)
from nanogrpo.engines.vllm_inprocess.process import NOISE, build_cause, guard_process_state, import_vllm
from nanogrpo.engines.vllm_inprocess.routes import LLM_FLAG, route_refusal, route_spec
from nanogrpo.engines.vllm_inprocess.sampling_rules import check_convention, request_seeds, sample_on
from nanogrpo.errors import ConfigError, ModelError
from nanogrpo.moe.routes import from_completion_output

log = logging.getLogger("nanogrpo.engines.vllm_inprocess")

_TIE_KEYS = ("model.embed_tokens.weight", "lm_head.weight")


def policy_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights under their plain HF names; for a PEFT LoRA model, base weights with
    each adapter merged in (``W + scale * B @ A``, computed aside: ``model`` is not modified)."""
    from nanogrpo.models.lora import is_peft

    if not is_peft(model):
        return dict(model.state_dict())
    base = model.get_base_model()
    deltas: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, mod in base.named_modules():
            if hasattr(mod, "get_delta_weight") and hasattr(mod, "base_layer") and not mod.merged:
                adapters = [a for a in mod.active_adapters if a in mod.lora_A]
                if adapters:
                    deltas[f"{name}.weight"] = sum(mod.get_delta_weight(a) for a in adapters)
        out = {}
        for key, value in base.state_dict().items():
            if ".lora_" in key:
                continue
            key = key.replace(".base_layer.", ".")
            out[key] = value + deltas[key].to(value.dtype) if key in deltas else value
    return out



def write_config(cfg, architecture: str, path: Path) -> None:
    """The model's config as vLLM reads it, naming its class where the config does not (a model built in
    code has no ``architectures``; vLLM then guesses from the model type, and took a Qwen3-MoE for a pooling
    model: "Tokenizer not available when `skip_tokenizer_init=True`")."""
    import json

    d = json.loads(cfg.to_json_string())
    if not d.get("architectures"):
        d["architectures"] = [architecture]
    path.write_text(json.dumps(d, indent=2, sort_keys=True))


class VLLMEngine:
    """Generation with ``vllm.LLM`` over a copy of ``model``'s weights (see the module docstring).

    Args:
        model: the HF model whose config and current weights vLLM starts from (not kept).
        eos_token_id, pad_token_id, tokenizer: special ids, as for :class:`HFEngine`.
        ignore_eos: never stop at EOS (benchmarks).
        max_model_len: longest prompt + completion (default: the model's
            ``max_position_embeddings``).
        max_batch: sequences per ``generate`` call expected; on the CPU the KV cache gets
            room for that many of ``max_model_len`` tokens unless ``kv_cache_bytes`` is given.
        tempered_logprobs: report ``log_softmax(logits / T)`` (vLLM's ``processed_logprobs``)
            instead of the untempered ``log_softmax(logits)``; see the module docstring.
        kv_cache_bytes: KV cache size (0: the CPU rule above; on a GPU vLLM's own sizing
            from ``gpu_memory_utilization``).
        gpu_memory_utilization, tensor_parallel_size, enforce_eager (None: eager on the CPU,
            CUDA graphs on a GPU), max_num_seqs (0: vLLM's default), enable_prefix_caching,
            sleep_mode, seed: as the ``[vllm]`` config keys.
        stop_strings: give vLLM the tokenizer so that it stops at ``SamplingParams.stop`` (multi-turn
            runs); without it stop strings are left to the caller (vLLM samples on to EOS).
        lora_sync: for a PEFT LoRA ``model``: ``adapter`` (vLLM holds the frozen base weights, loaded
            once, and serves the adapter through its LoRA kernels: each :meth:`load_from` writes the
            adapter, megabytes, and the next rollouts name it) or ``merged`` (every weight, the adapter
            merged in). Ignored for a plain model.
        return_routes: a mixture-of-experts ``model``: build vLLM to return the experts each MoE layer chose
            for each token (``enable_return_routed_experts``; :func:`vllm_options` sets it under
            ``moe.routing_replay=rollout``). Ignored for a dense model. A vLLM build that cannot return them
            (the CPU build: no Triton for its Model Runner V2) is a ConfigError here, in one line.
        llm_kwargs: further ``vllm.LLM`` arguments, passed as given.

    An engine whose vLLM returns routes (built with ``return_routes``, or ``enable_return_routed_experts``
    in ``llm_kwargs``) has a ``record_routes`` attribute, False until the run's routing replay sets it
    (:class:`~nanogrpo.training.routing.RoutingReplay`); then each ``generate`` fills ``Generation.routes``
    (:func:`~nanogrpo.moe.routes.from_completion_output`; a call with stop strings records none: its rows
    may be sampled on). One that does not has no such attribute, so a run that replays the engine's routes
    is refused at setup instead of at its first batch.
    """

    name = "vllm"
    owns_weights = True
    """vLLM holds its own copy of the weights: push the policy's after changing them (``load_from``)."""
    behaviour_logprobs = True
    """The log-probs come from other kernels than the trainer's: take the ratio against them."""

    def __init__(self, model, eos_token_id: int | Sequence[int] | None = None,
                 pad_token_id: int | None = None, *, tokenizer=None, ignore_eos: bool = False,
                 max_model_len: int | None = None, max_batch: int = 256, tempered_logprobs: bool = False,
                 kv_cache_bytes: int = 0, gpu_memory_utilization: float = 0.3, tensor_parallel_size: int = 1,
                 enforce_eager: bool | None = None, max_num_seqs: int = 0, enable_prefix_caching: bool = True,
                 sleep_mode: bool = False, seed: int = 0, stop_strings: bool = False,
                 lora_sync: str = "adapter", return_routes: bool = False,
                 llm_kwargs: dict[str, Any] | None = None):
        from nanogrpo.models.lora import is_peft

        if torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:
            raise ConfigError("rollout.engine=vllm runs in one process; with several ranks use split mode "
                              "(`nanogrpo rollout ... rollout.engine=vllm` workers) or rollout.engine=fast")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # before vLLM configures its logging,
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # off stdout (eval/bench JSON)
        vllm = import_vllm()
        base = model.get_base_model() if is_peft(model) else model
        cfg = base.config
        p = next(model.parameters())
        cuda = p.device.type == "cuda"
        if not cuda and head_dim(cfg) not in CPU_HEAD_SIZES:
            raise ModelError(f"vLLM's CPU attention takes head sizes {list(CPU_HEAD_SIZES)}, this model's is "
                             f"{head_dim(cfg)}; use rollout.engine=fast or hf for it")
        if tensor_parallel_size > 1:
            raise ConfigError("vllm.tensor_parallel_size > 1 runs vLLM's workers as separate processes, "
                              "which nanogrpo's in-process weight sync does not reach; use 1 (split mode: "
                              "one `nanogrpo rollout` worker per GPU)")
        if sleep_mode and not cuda:
            raise ConfigError("vllm.sleep_mode frees GPU memory during the update; vLLM's CPU build has no "
                              "sleep mode: set vllm.sleep_mode=false")
        if stop_strings and tokenizer is None:
            raise ConfigError("VLLMEngine(stop_strings=True) needs the tokenizer (vLLM decodes to find them)")
        self.tokenizer = tokenizer if stop_strings else None
        self.eos_ids, self.pad_id = resolve_special_ids(base, tokenizer, eos_token_id, pad_token_id)
        self.ignore_eos, self.tempered, self.sleep_mode = ignore_eos, tempered_logprobs, sleep_mode
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.dtype = p.dtype
        limit = int(getattr(cfg, "max_position_embeddings", 0) or 0)
        self.max_model_len = int(max_model_len or limit or 4096)
        if limit and self.max_model_len > limit:
            log.warning("vLLM: max_model_len %d > the model's max_position_embeddings %d; using %d",
                        self.max_model_len, limit, limit)
            self.max_model_len = limit
        if not cuda and not kv_cache_bytes:
            kv_cache_bytes = max(MIN_CPU_KV_BYTES, kv_bytes_per_token(cfg, self.dtype) * self.max_model_len
                                 * max_batch)
        kw: dict[str, Any] = dict(
            dtype=str(self.dtype).removeprefix("torch."), max_model_len=self.max_model_len,
            enforce_eager=not cuda if enforce_eager is None else enforce_eager,
            load_format="dummy", skip_tokenizer_init=not stop_strings, generation_config="vllm", seed=seed,
            logprobs_mode="processed_logprobs" if tempered_logprobs else "raw_logprobs",
            enable_prefix_caching=enable_prefix_caching, tensor_parallel_size=tensor_parallel_size)
        if kv_cache_bytes:
            kw["kv_cache_memory_bytes"] = int(kv_cache_bytes)
        else:
            kw["gpu_memory_utilization"] = gpu_memory_utilization
        if max_num_seqs:
            kw["max_num_seqs"] = max_num_seqs
        if not cuda:  # vLLM 0.32 CPU: a seeded request whose prefill is split into chunks crashes
            kw["enable_chunked_prefill"] = False  # ("CPU Generator does not use offset"): whole prompts
            # (vLLM warns that this is not "officially supported"; tests/test_vllm.py checks the outputs)
            kw["max_num_batched_tokens"] = max(4096, self.max_model_len)
        if sleep_mode:
            kw["enable_sleep_mode"] = True
        self.adapter = lora_sync == "adapter" and is_peft(model)
        """Serve the LoRA adapter on the frozen base weights (see ``lora_sync``)."""
        self._lora = None
        self._lora_version = 0
        self._base_loaded = False
        self.last_sync_bytes = 0
        if self.adapter:
            kw.update(self._serve_adapter(model))
        asked = self._ask_routes(base, kw, return_routes, llm_kwargs)
        self._keys = set(policy_state_dict(model))
        t0 = time.perf_counter()
        self.llm = self._build(vllm, base, kw, tokenizer if stop_strings else None, asked)
        self._asleep = False
        self.load_from(model)
        log.info("vLLM engine ready in %.1f s (max_model_len %d, %s log-probs)", time.perf_counter() - t0,
                 self.max_model_len, "tempered" if tempered_logprobs else "untempered")

    def _serve_adapter(self, model) -> dict[str, Any]:
        """vLLM's LoRA settings for serving ``model``'s adapter; a folder for its versions, removed with
        the engine."""
        import shutil
        import weakref

        from nanogrpo.models.lora import check_adapter_servable, vllm_max_lora_rank

        check_adapter_servable(model)
        self._adapter_root = Path(tempfile.mkdtemp(prefix="nanogrpo-vllm-lora-"))
        weakref.finalize(self, shutil.rmtree, str(self._adapter_root), True)  # the adapters' files
        return dict(enable_lora=True, max_loras=1, max_cpu_loras=2,
                    max_lora_rank=vllm_max_lora_rank(model.peft_config[model.active_adapter].r))

    def _ask_routes(self, base, kw: dict[str, Any], return_routes: bool, llm_kwargs: dict | None) -> bool:
        """vLLM's flag for MoE routes in ``kw`` when asked (``return_routes``, a MoE model nanogrpo records)
        or passed by hand (``llm_kwargs``); whether it was asked. An engine that returns them has
        ``record_routes``."""
        spec = route_spec(base)  # None: dense, or a mixture of experts nanogrpo does not record
        asked = return_routes and spec is not None
        if asked:
            kw[LLM_FLAG] = True
        kw.update(llm_kwargs or {})
        self._route_spec = spec if kw.get(LLM_FLAG) else None
        if kw.get(LLM_FLAG) and not kw.get("enable_prefix_caching", True):
            raise ConfigError("vLLM returns MoE routes only with its prefix cache on (the routes of cached "
                              "prompt tokens come from it): set vllm.enable_prefix_caching=true")
        if self._route_spec is not None:
            self.record_routes = False
            """Fill ``Generation.routes`` (set by the run's routing replay)."""
        return asked

    @staticmethod
    def _build(vllm, base, kw: dict[str, Any], tokenizer, asked: bool):
        """vLLM's ``LLM`` in this process over ``base``'s config (the weights come from memory after); its
        refusals in one line."""
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
        for name in ("vllm.renderers.base", "vllm.model_executor.model_loader.reload.layerwise",
                     "vllm.v1.worker.cpu_worker", "vllm.engine.arg_utils"):
            logging.getLogger(name).addFilter(NOISE)  # (adding the same filter twice keeps one)
        with tempfile.TemporaryDirectory(prefix="nanogrpo-vllm-") as d, guard_process_state():
            write_config(base.config, type(base).__name__, Path(d) / "config.json")
            if tokenizer is not None:  # stop strings: vLLM decodes to find them
                tokenizer.save_pretrained(d)
            try:
                return vllm.LLM(model=d, **kw)
            except Exception as e:
                refused = route_refusal(e) if kw.get(LLM_FLAG) else None
                if refused:
                    out = ("use rollout.engine=hf, or moe.routing_replay=policy" if asked else
                           f"remove {LLM_FLAG} from vllm.llm_kwargs")
                    raise ConfigError(f"rollout.engine=vllm cannot return MoE routes on this vLLM build "
                                      f"({refused}): {out}") from e
                raise ModelError(f"vLLM could not build an engine for this {type(base).__name__}: "
                                 f"{build_cause(e)}") from e

    # ------------------------------------------------------------ weights

    def load_from(self, model: torch.nn.Module) -> None:
        """Push ``model``'s current weights into vLLM: in place (LoRA adapters merged), or, serving the
        adapter (``lora_sync=adapter``), the base weights once and the adapter as a new LoRA request."""
        if not self.adapter:
            sd = policy_state_dict(model)
            self.update_weights(sd)
            self.last_sync_bytes = sum(v.numel() * v.element_size() for v in sd.values())
            return
        import shutil

        from vllm.lora.request import LoRARequest

        from nanogrpo.models.lora import base_state_dict, write_adapter

        if not self._base_loaded:
            self.update_weights(base_state_dict(model))
            self._base_loaded = True
        self._lora_version += 1
        path = self._adapter_root / f"v{self._lora_version}"
        self.last_sync_bytes = write_adapter(model, path)
        old, self._lora = self._lora, LoRARequest(f"nanogrpo-v{self._lora_version}", self._lora_version,
                                                  str(path))
        if old is not None:  # one adapter at a time: the previous one leaves the engine and the disk
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    @torch.no_grad()
    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a full set of new weights into vLLM in place (no restart, nothing written to disk).

        Unknown or missing keys are an error (vLLM re-packs whole layers, so a partial update
        would leave layers half-loaded); with tied embeddings either key of the pair will do.
        """
        sd = dict(state_dict)
        if self.tied:
            for have, want in (_TIE_KEYS, _TIE_KEYS[::-1]):
                if have in sd and want not in sd:
                    sd[want] = sd[have]
        unknown, missing = sorted(set(sd) - self._keys), sorted(self._keys - set(sd))
        if unknown or missing:
            what = f"keys not in the model: {unknown[:5]}" if unknown else f"missing keys: {missing[:5]}"
            raise KeyError(f"VLLMEngine.update_weights takes the model's full state dict; {what}")
        self._wake()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(sd.items()),
                                                          "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()  # cached prompt KV was computed with the old weights

    # ------------------------------------------------------------ generation

    def _check_convention(self, params: SamplingParams) -> None:
        check_convention(params, self.tempered)

    def _seeds(self, params: SamplingParams, count: int) -> list[int]:
        return request_seeds(params, count)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> Generation:
        check_request(prompts, params)
        self._check_convention(params)
        vllm = import_vllm()
        from vllm.inputs import TokensPrompt

        stops = StopStrings(self.tokenizer, params.stop) if self.tokenizer is not None else None
        common = dict(n=params.n, max_tokens=params.max_new_tokens, logprobs=0, detokenize=bool(stops),
                      skip_special_tokens=False, ignore_eos=self.ignore_eos,
                      stop_token_ids=None if self.ignore_eos else list(self.eos_ids))
        if stops:  # vLLM's text rule; the same token as stops.py's where both decode alike
            common.update(stop=list(stops.strings), include_stop_str_in_output=True,
                          spaces_between_special_tokens=False)
        if params.greedy:
            sps = [vllm.SamplingParams(temperature=0.0, **common)] * len(prompts)
        else:
            sps = [vllm.SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                       seed=s, **common) for s in self._seeds(params, len(prompts))]
        self._wake()
        t0 = time.perf_counter()
        try:
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sps,
                                     use_tqdm=False, lora_request=self._lora)
        finally:
            gen_s = time.perf_counter() - t0
            if self.sleep_mode:
                self.llm.sleep(level=1)
                self._asleep = True
        comp: list[list[int]] = []
        lps: list[list[float]] = []
        reasons: list[str] = []
        spec = self._route_spec if getattr(self, "record_routes", False) and not stops else None
        routes: list[torch.Tensor | None] | None = None if spec is None else []
        for prompt, out in zip(prompts, outs, strict=True):
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                if routes is not None:  # (prompt + completion tokens, moe_layers, top_k)
                    routes.append(from_completion_output(c, len(prompt), spec))
                comp.append(ids)
                lps.append([step[t].logprob for t, step in zip(ids, c.logprobs, strict=True)])
                reasons.append("stop_string" if isinstance(c.stop_reason, str)
                               else "stop" if c.finish_reason == "stop" and not self.ignore_eos else "length")
        if stops:
            self._sample_on(prompts, params, stops, comp, lps, reasons)
        n_tok = sum(len(c) for c in comp)
        return Generation(comp, lps, reasons, stats={"generate_s": gen_s, "new_tokens": float(n_tok),
                                                     "tok_per_s": n_tok / max(gen_s, 1e-9)}, routes=routes)

    def _sample_on(self, prompts: list[list[int]], params: SamplingParams, stops: StopStrings,
                   comp: list[list[int]], lps: list[list[float]], reasons: list[str]) -> None:
        sample_on(self.generate, prompts, params, stops, comp, lps, reasons)

    def _wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False
