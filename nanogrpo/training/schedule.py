"""The update schedule: how one rollout batch becomes optimizer steps.

``grpo.updates_per_batch`` = μ passes over the batch, each ``grpo.mini_batches`` = M optimizer steps:
the batch's groups, in the order they were generated, are cut into M contiguous mini-batches of
whole groups (sizes differ by one group at most), and every mini-batch is one
:func:`~nanogrpo.training.step.policy_update`::

    pass 0: mb 0, mb 1, ..., mb M-1      pass 1: mb 0, ..., mb M-1      ...     (M x μ optimizer steps)

as TRL's ``steps_per_generation`` x ``num_iterations`` and verl's PPO mini-batches x ``ppo_epochs``
order them. Every optimizer step is one policy version: the trainer counts them, publishes them (split
mode, ``server.publish_every``) and can checkpoint between them (``train.save_every_updates``).

Normalisation: each optimizer step normalises by *its mini-batch's* totals (sequences, tokens,
``constant``'s completions x max_new_tokens, the ``top_entropy_quantile`` threshold), as TRL and verl do
per optimizer step; the micro-batches inside a mini-batch still add up to exactly its loss.
Advantages (``batch_std`` and ``reinforce_pp`` included) are the whole batch's, computed at rollout
time, before the split (as both peers).

Old log-probs (what the PPO ratio of a mini-batch is anchored on):

- no correction (``rollout.correction=none``, the seed's rule): the first optimizer step on a fresh
  batch from an exact engine (fast, hf) is on-policy (``logp.detach()``: ratio 1); every later one,
  in this pass or the next, takes the behaviour log-probs the engine recorded (the policy that
  generated the batch). Nothing else is computed: that policy *is* the engine's.
- a correction, or a batch that is off-policy from the start (vLLM's kernels, a stale split-mode
  batch): the trainer's own log-probs of the generating policy, ``proximal``, anchor the ratio (with a
  correction) and are what the behaviour log-probs are weighed and measured against. With one
  mini-batch they come from the first update's own forward; with M > 1 the mini-batches
  after the first are trained after the weights moved, so one forward without gradients over the
  whole batch runs before the first optimizer step (:func:`proximal_logprobs`) -- what TRL
  (``old_per_token_logps`` when ``steps_per_generation > 1``) and verl (``compute_log_prob`` before
  the update) do. Every correction weight and mismatch stat of every step is then measured against
  the generating policy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from nanogrpo.batch import RolloutBatch
from nanogrpo.config import Config
from nanogrpo.training.micro import trained_mask
from nanogrpo.training.step import UpdateResult, no_grad_passes, policy_update
from nanogrpo.training.terms import Terms


def group_splits(num_groups: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges [start, end) of group indices covering ``num_groups``, sizes differing by
    at most one (the larger first); a range may be empty when ``num_groups < parts``."""
    base, extra = divmod(num_groups, parts)
    out, start = [], 0
    for k in range(parts):
        end = start + base + (1 if k < extra else 0)
        out.append((start, end))
        start = end
    return out


def mini_batch_rows(batch: RolloutBatch | None, parts: int) -> list[torch.Tensor | None]:
    """Row indices of each of ``parts`` mini-batches of whole groups (None: this rank has no row in it)."""
    if batch is None:
        return [None] * parts
    g = batch.group_size
    out: list[torch.Tensor | None] = []
    for a, b in group_splits(batch.num_seqs // g, parts):
        out.append(torch.arange(a * g, b * g, device=batch.input_ids.device) if b > a else None)
    return out


def mini_batch_count(batch: RolloutBatch | None, mini_batches: int, backend=None) -> int:
    """How many mini-batches a step takes: ``grpo.mini_batches``, fewer when the batch (the rank with the
    most groups) has fewer groups, so that no optimizer step is empty. Collective under several ranks."""
    local = 0 if batch is None else batch.num_seqs // batch.group_size
    most = local if backend is None or backend.world_size == 1 else \
        int(backend.all_reduce([float(local)], ["max"])[0])
    return max(1, min(mini_batches, most))


@torch.no_grad()
def proximal_logprobs(batch: RolloutBatch | None, cfg: Config, be, share_prefix: bool,
                      terms: Terms | None = None) -> torch.Tensor | None:
    """(N, C) this rank's trainer log-probs of the trained tokens under the current weights (0 elsewhere),
    over the update's micro-batches, without gradients (eval mode, the update's autocast). A collective
    on sharded backends: a rank with fewer micro-batches runs empty forwards to match the others."""
    from nanogrpo.algo.logprobs import acc_dtype

    train = cfg.train
    mask = None if batch is None else trained_mask(batch, cfg.grpo)                 # (N, C)
    out = None
    if batch is not None:
        dt = acc_dtype(next(iter(be.module.parameters())).dtype)
        out = torch.zeros(batch.completion_mask.shape, dtype=dt, device=batch.input_ids.device)  # (N, C)
    for rows, lp, _, _ in no_grad_passes(batch, mask, train, be, share_prefix, terms, "proximal",
                                         temperature=cfg.rollout.logprob_temperature(),
                                         support=cfg.rollout.logprob_support()):
        out[rows, :lp.shape[1]] = lp.to(out.dtype)                                   # (n, c)
    return out


@dataclass
class Schedule:
    """Where a rollout batch stands in its schedule: what a mid-batch checkpoint saves and a resume loads."""

    parts: int
    """Mini-batches per pass (``mini_batch_count``)."""
    done: int = 0
    """Optimizer steps taken (or skipped as non-finite) so far, of ``parts`` x ``updates_per_batch``."""
    results: list[UpdateResult] = field(default_factory=list)
    proximal: torch.Tensor | None = None
    """(N, C) the trainer's log-probs of this rank's rows under the generating policy, once known."""

    def total(self, cfg: Config) -> int:
        return self.parts * cfg.grpo.updates_per_batch


def needs_proximal(cfg: Config, parts: int, compared: bool) -> bool:
    """Whether the proximal log-probs must come from a forward before the first optimizer step: several
    mini-batches, and the behaviour log-probs are weighed (a correction) or measured (``compared``)."""
    return parts > 1 and (cfg.rollout.correction != "none" or compared)


def run_updates(be, batch: RolloutBatch | None, cfg: Config, sched: Schedule, *, fresh: bool, exact: bool,
                control, after_update: Callable[[Schedule, UpdateResult], None] | None = None,
                terms: Terms | None = None) -> Schedule:
    """Take the optimizer steps of ``sched`` left to take on ``batch`` (this rank's share; None: none), with
    backend ``be``.

    ``fresh``: the batch was generated by the current weights (lag 0); ``exact``: by an engine that computes
    as the trainer does. ``control``: the run's :class:`~nanogrpo.algo.entropy.EntropyControl` (its
    coefficient in each update's loss, updated after each optimizer step). ``after_update(sched, result)``
    runs after each optimizer step (count the version, publish the weights, checkpoint), with ``sched.done``
    already counting it. ``terms``: what features add to the forwards and the loss
    (:class:`~nanogrpo.training.terms.Terms`)."""
    terms = terms if terms is not None else Terms()
    share = cfg.train.share_prefix and be.prefix_sharing and terms.share_prefix(batch)
    rows = mini_batch_rows(batch, sched.parts)
    wanted = terms.wants_proximal and sched.total(cfg) > 1  # a feature's (R2 records the routes there)
    if sched.proximal is None and (wanted or needs_proximal(cfg, sched.parts, not (fresh and exact))):
        sched.proximal = proximal_logprobs(batch, cfg, be, share, terms)
    while sched.done < sched.total(cfg):
        u = sched.done
        idx = rows[u % sched.parts]
        whole = sched.parts == 1  # the batch itself (no copy: the default costs nothing more)
        mb = batch if whole or idx is None else batch.select(idx)
        old = sched.proximal if whole or sched.proximal is None or idx is None else sched.proximal[idx]
        res = policy_update(be, mb, cfg, on_policy=(u == 0 and fresh and exact), old_logprobs=old,
                            entropy_coef=control.applied(), terms=terms)
        control.update(res.bonus_entropy)
        if whole and sched.proximal is None and batch is not None:
            sched.proximal = res.logprobs  # one mini-batch: the first update's forward, the generating policy
        res.logprobs = None  # not kept: (N, C) per update
        sched.results.append(res)
        sched.done += 1
        if after_update is not None:
            after_update(sched, res)
    return sched


def updates_taken(sched: Schedule) -> int:
    """Optimizer steps that changed the weights (policy versions), of those taken so far."""
    return sum(not r.skipped_nonfinite for r in sched.results)
