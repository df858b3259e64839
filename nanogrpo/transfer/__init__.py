"""Trainer-to-server weight transfer over vLLM's weight-transfer protocol.

- :mod:`nanogrpo.transfer.source`: the trainer's weights as vLLM's ``WeightSource`` (FSDP2 shards gathered
  one tensor at a time);
- :mod:`nanogrpo.transfer.gloo`: a gloo (``torch.distributed``, TCP) engine, both sides, for the CPU;
- :mod:`nanogrpo.transfer.plugin`: the vLLM plugin that registers it in every vLLM process.

``nccl`` and ``ipc`` are vLLM's own trainer-side engines (``vllm.distributed.weight_transfer``);
:mod:`nanogrpo.engines.vllm_server.sync` picks one by ``vllm_server.transfer``. Everything here needs vLLM
(``pip install -e ".[vllm]"``); nothing imports it at package import.
"""
