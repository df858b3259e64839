"""The train-inference mismatch of a MoE run, as pure functions of tensors.

Per step, over the trained tokens of the batch, at the weights that sampled it (the first optimizer
step's forward, before it moves anything), with Δ_t = log π_trainer(t) − log μ_engine(t):

    mismatch_abs        mean |Δ_t|                                  (``logprob_gap``, also logged)
    mismatch_kl         mean exp(Δ_t) − Δ_t − 1                     k3 estimate of KL(μ ‖ π) (samples ~ μ)
    mismatch_ratio_out  share of tokens with exp(Δ_t) outside [1/τ, τ] (τ = 2 by default)

and the router disagreement rate: the share of (token, MoE layer) pairs where the trainer's own top-k
set is not the rollout's record (:class:`~nanogrpo.moe.replay.RouteStats`), with replay on or off.

Sums and counts first (:func:`mismatch_sums`, combined over micro-batches and ranks by ``STAT_OPS``),
rates last (:func:`mismatch_metrics`), as ``nanogrpo.algo.losses`` does.
"""

from __future__ import annotations

import math

import torch

from nanogrpo.algo.corrections import logprob_gap_stats

STAT_OPS = {"mismatch_tokens": "sum", "mismatch_abs_sum": "sum", "mismatch_abs_max": "max",
            "mismatch_kl_sum": "sum", "mismatch_out_sum": "sum",
            "route_token_layers": "sum", "route_flipped": "sum"}
"""How each sum combines over micro-batches and ranks."""


def mismatch_sums(trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor, tau: float = 2.0
                  ) -> dict[str, torch.Tensor]:
    """trainer, engine: (N, C) log-probs of the same tokens; mask (N, C) bool: the trained tokens.
    Returns 0-dim detached sums (keys of :data:`STAT_OPS`; no route keys)."""
    m = mask.bool()                                                          # (N, C)
    t = trainer.detach().double()
    d = torch.where(m, t - engine.to(t.dtype), 0.0)                          # (N, C) log(π / μ)
    d = torch.nan_to_num(d, nan=0.0)
    lim = math.log(tau)
    gap = logprob_gap_stats(t, engine, m)                                    # logprob_gap_sum / _max
    out = {"mismatch_abs_sum": gap["logprob_gap_sum"], "mismatch_abs_max": gap["logprob_gap_max"]}
    out.update({"mismatch_tokens": m.sum(),
                "mismatch_kl_sum": torch.where(m, torch.expm1(d) - d, 0.0).sum(),   # k3
                "mismatch_out_sum": (m & (d.abs() > lim)).sum()})
    return out


def route_sums(stats) -> dict[str, torch.Tensor]:
    """A :class:`~nanogrpo.moe.replay.RouteStats` as sums for :data:`STAT_OPS`."""
    return {"route_token_layers": torch.tensor(float(stats.token_layers), dtype=torch.float64),
            "route_flipped": torch.tensor(float(stats.flipped), dtype=torch.float64)}


def router_disagreement(trainer_routes: torch.Tensor, rollout_routes: torch.Tensor,
                        mask: torch.Tensor | None = None) -> tuple[int, int]:
    """(flipped, compared) (token, layer) pairs between two records of the same tokens
    (..., moe_layers, top_k): a pair counts where both have a record (and ``mask`` (...) is True); it
    flips where the two top-k *sets* differ (the order within a top-k is not a disagreement)."""
    from nanogrpo.moe.routes import unpack

    a, b = unpack(trainer_routes), unpack(rollout_routes)
    if a.shape != b.shape:
        raise ValueError(f"route records of shapes {tuple(a.shape)} and {tuple(b.shape)}")
    both = (a >= 0).all(-1) & (b >= 0).all(-1)                               # (..., layers)
    if mask is not None:
        both &= mask.bool()[..., None].to(both.device)
    differ = (a.sort(-1).values != b.sort(-1).values).any(-1)                # (..., layers)
    return int((both & differ).sum()), int(both.sum())


def mismatch_metrics(tot: dict[str, float]) -> dict[str, float]:
    """The logged rates from the combined sums (absent keys: metric left out)."""
    out = {}
    n = tot.get("mismatch_tokens", 0.0)
    if n:
        out.update({"mismatch_abs": tot["mismatch_abs_sum"] / n, "mismatch_abs_max": tot["mismatch_abs_max"],
                    "mismatch_kl": tot["mismatch_kl_sum"] / n,
                    "mismatch_ratio_out": tot["mismatch_out_sum"] / n})
    if tot.get("route_token_layers"):
        out["router_disagreement"] = tot["route_flipped"] / tot["route_token_layers"]
    return {k: float(v) for k, v in out.items()}
