"""An episode's training sequences, assembled from the requests its program made (token ids only).

Requests are taken in the order they were answered. A request whose prompt starts with the whole of
a sequence so far (its prompt, everything sampled and fed in it) continues that sequence: the
prompt's tokens beyond it are context (what the program added: tool output, a user's reply, the
chat template around them; masked), its sampled tokens are trained. Any other request starts a new
sequence: the program rewrote its history (dropped a turn, edited a message, let a template
re-render an earlier reply) and what the model read is no longer a continuation of what it wrote.
Each sequence is trained on its own (the episode's advantage on each); ``rewrites`` counts the
sequences after an episode's first. Nothing is re-tokenised: the ids are the engine's.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Sequence:
    """One training sequence: a prompt, then turns of sampled (trained) and fed (context) tokens."""

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    """0 for fed tokens."""
    loss_mask: list[bool] = field(default_factory=list)
    """True for sampled tokens."""
    turns: int = 0
    finish_reason: str = "stop"
    """The last request's (``stop``, ``stop_string``, ``length``)."""

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    @property
    def sampled(self) -> int:
        return sum(self.loss_mask)


def assemble(records) -> list[Sequence]:
    """The sequences of an episode's records (:class:`~nanogrpo.episodes.endpoint.Record`, in order):
    each request continues the longest sequence its prompt starts with, else starts one."""
    seqs: list[Sequence] = []
    for rec in records:
        prompt = list(rec.prompt_ids)
        best = None
        for s in seqs:
            n = len(s.prompt_ids) + len(s.completion_ids)
            if len(prompt) >= n and prompt[:n] == s.ids and (best is None or n > len(best.ids)):
                best = s
        if best is None:
            best = Sequence(prompt)
            seqs.append(best)
        else:
            fed = prompt[len(best.ids):]
            best.completion_ids += fed
            best.logprobs += [0.0] * len(fed)
            best.loss_mask += [False] * len(fed)
        best.completion_ids += list(rec.completion_ids)
        best.logprobs += [float(x) for x in rec.logprobs]
        best.loss_mask += [True] * len(rec.completion_ids)
        best.turns += 1
        best.finish_reason = rec.finish_reason
    return seqs


LOGPROB_TOLERANCE = 1e-6
"""How far a claimed log-prob may be from the one the engine answered (they travel as JSON or msgpack
floats: exact in practice)."""


def check_claimed(ids: list[int], mask: list[bool], logprobs: list[float], records) -> Sequence | str:
    """The training sequence of a conversation a program claims (:class:`~nanogrpo.envs.program.
    TokenSequence`), built from the endpoint's ``records`` of the episode: each maximal run of sampled
    tokens must be one request's sampled tokens, exactly, with that request's prompt (exactly the ids
    before the run) and log-probs; the sequence's log-probs are the records'. A one-line reason when
    the claim is not what was sampled."""
    if not (len(ids) == len(mask) == len(logprobs)):
        return f"ids, mask and log-probs differ in length ({len(ids)}, {len(mask)}, {len(logprobs)})"
    if not any(mask):
        return "no sampled token"
    first = mask.index(True)
    seq = Sequence(list(ids[:first]))
    k = first
    while k < len(ids):
        if not mask[k]:
            seq.completion_ids.append(ids[k])
            seq.logprobs.append(0.0)
            seq.loss_mask.append(False)
            k += 1
            continue
        run = k
        while run < len(ids) and mask[run]:
            run += 1
        fits = [r for r in records if len(r.prompt_ids) == k and 0 < len(r.completion_ids) <= run - k
                and r.completion_ids == ids[k:k + len(r.completion_ids)] and r.prompt_ids == ids[:k]]
        if not fits:
            return (f"the sampled tokens at {k}..{run} with the {k} before them are no request the "
                    f"endpoint answered ({len(records)} requests)")
        rec = max(fits, key=lambda r: len(r.completion_ids))  # two turns with nothing between: one run
        end = k + len(rec.completion_ids)
        if any(abs(a - b) > LOGPROB_TOLERANCE for a, b in zip(logprobs[k:end], rec.logprobs)):
            return f"the log-probs of the sampled tokens at {k}..{end} are not the engine's"
        seq.completion_ids += rec.completion_ids
        seq.logprobs += [float(x) for x in rec.logprobs]
        seq.loss_mask += [True] * (end - k)
        seq.turns += 1
        seq.finish_reason = rec.finish_reason
        k = end
    return seq
