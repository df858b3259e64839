"""``[train]``, ``[eval]``, ``[log]`` and ``[server]``: the run around the algorithm."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from nanogrpo.config.base import _Strict


class TrainConfig(_Strict):
    steps: int = Field(1000, ge=0)
    """Training steps (rollout batches) of the run; ``--steps`` sets it, also to extend a resumed run."""
    lr: float = Field(1e-6, gt=0)
    """AdamW learning rate (the seed's 1e-6)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's (beta1, beta2)."""
    warmup_steps: int = Field(0, ge=0)
    """Linear learning-rate warm-up over this many steps, then constant (the seed: constant)."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradients are clipped to this global norm before each optimizer step."""
    micro_batch_size: int = Field(8, gt=0)
    """Sequences per forward/backward; gradients accumulate over the step's micro-batches."""
    micro_batch_tokens: int = Field(0, ge=0)
    """Token budget per micro-batch (rows x padded length), rows length-sorted; 0: by
    ``micro_batch_size`` only, which stays the cap on rows either way."""
    logprob_chunk: int = Field(1024, gt=0)
    """Completion tokens per chunk of the fused LM-head + log-softmax (one (chunk, vocab) float32 buffer)."""
    save_every: int = Field(200, ge=0)
    """0: only the final checkpoint (and step_0)."""
    save_every_updates: int = Field(0, ge=0)
    """Also checkpoint every this many optimizer steps (policy versions) inside a step, between the
    optimizer steps of one rollout batch (``grpo.mini_batches`` x ``updates_per_batch`` > 1), as
    ``step_N_update_U`` with the batch itself: a run killed there resumes at that update, exactly. Only
    the newest such checkpoint is kept. 0: checkpoints at step boundaries only (``save_every``)."""
    seed: int = 0
    """Seeds sampling, the prompt order and initialisation; ``--seed`` sets it."""
    out: str = "runs/nanogrpo"
    """The run directory (config, metrics, checkpoints); ``--out`` sets it."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward (HF gradient checkpointing): less memory, more time."""
    share_prefix: bool = True
    """Run each distinct prompt once per micro-batch in the policy and reference forwards (its G
    samples read its keys/values); same log-probs and gradients. Not applied under gradient
    checkpointing, nor on the fsdp2 and deepspeed backends (see ``nanogrpo.training.distributed``)."""
    autocast: bool = False
    """bf16 autocast for forward/backward while weights, gradients and optimizer state stay float32."""
    optimizer_offload: bool = False
    """Keep float32 master weights and AdamW moments in CPU memory (the seed's ZeRO CPU offload)."""
    backend: Literal["single", "ddp", "fsdp2", "deepspeed"] = "single"
    """``ddp``/``fsdp2`` under ``torchrun``, ``deepspeed`` under the ``deepspeed`` launcher."""
    zero_stage: int = Field(2, ge=1, le=3)
    """DeepSpeed ZeRO stage (backend ``deepspeed``)."""
    fsdp_cpu_offload: bool = False
    """FSDP2: sharded parameters, gradients and optimizer state on the CPU (``CPUOffloadPolicy``)."""


class EvalConfig(_Strict):
    n: int = Field(200, gt=0)
    """Held-out problems per evaluation (the first ``n`` of ``data.eval_split``)."""
    max_new_tokens: int | None = None
    """None: same as rollout.max_new_tokens."""
    batch_size: int = Field(64, gt=0)
    """Prompts per generation call."""
    every: int = Field(0, ge=0)
    """Evaluate on ``data.eval_split`` every this many training steps (and at the last step); 0: never."""
    k: int = Field(1, ge=1)
    """Samples per problem: 1 is greedy pass@1; >1 samples at ``temperature`` for pass@k and maj@k."""
    temperature: float | None = Field(None, gt=0)
    """Sampling temperature when ``k > 1``; None: same as rollout.temperature."""
    seed: int = 1234
    """Sampling seed for ``k > 1`` (fixed, so that evaluations of different steps compare)."""


class LogConfig(_Strict):
    tensorboard: bool = True
    """TensorBoard event files in ``RUN/tb``."""
    wandb: bool = False
    """Also log to Weights & Biases (needs ``pip install wandb``)."""
    wandb_project: str = "nanogrpo"
    """The Weights & Biases project (``log.wandb``)."""
    wandb_run_name: str | None = None
    """The Weights & Biases run name; None: the run directory's name."""
    samples_every: int = Field(10, ge=0)
    """Log a rollout table every this many steps: sample prompts and completions with each reward
    component, the total and the advantage (``RUN/samples.jsonl``, TensorBoard text, a W&B table); 0:
    never."""
    samples_per_step: int = Field(8, ge=1)
    """Rows of each rollout table: the first two completions of each group, group after group."""


class ServerConfig(_Strict):
    """Split mode: ``nanogrpo serve`` / ``nanogrpo rollout`` / ``nanogrpo train --server``."""

    publish_every: int = Field(1, ge=1)
    """The trainer publishes its weights to the server every this many optimizer steps (policy versions;
    between the mini-batches of one batch too)."""
    max_staleness: int = Field(4, ge=0)
    """Batches generated more than this many policy versions ago are dropped (and counted)."""
    queue_size: int = Field(16, gt=0)
    """Batches the server holds (awaiting reference log-probs, ready, or delivered and not yet
    acknowledged); beyond it uploads get 503."""
    token_file: str | None = None
    """File holding the shared token (else the NANOGRPO_TOKEN environment variable; never a flag)."""
    timeout_s: float = Field(60.0, gt=0)
    """Clients: per-request timeout; retries with backoff give up after ``retry_for_s``."""
    retry_for_s: float = Field(600.0, gt=0)
    """Clients: how long retries with backoff go on before a request fails loudly."""
    lease_s: float = Field(60.0, gt=0)
    """Server: a batch delivered to a trainer rank goes back in the queue (same id, delivered again) if the
    rank does not acknowledge it within this many seconds after receiving it (the rank died, or its
    connection did); the rank acknowledges as soon as the batch is safe in its run directory."""
    max_version_step: int = Field(1000, ge=1)
    """Server: how far one publish may move the policy version forward (the trainer moves it by
    ``publish_every`` optimizer steps); a larger jump is refused."""
    max_body_mb: float = Field(256.0, gt=0)
    """Server: the largest rollout batch a worker may upload, in MiB (``nanogrpo serve --max-body-mb``
    overrides it); beyond it 413. Trainer: a batch it takes from the server is read up to twice this (the
    reference log-probs the server adds), never more (``nanogrpo.http_limits``)."""
