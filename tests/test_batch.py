"""The rollout batch record: safetensors round trip and validation of every field."""

import pytest
import torch

from nanogrpo.batch import BatchError, RolloutBatch


def make_batch(n=4, p=3, c=5, g=2, ref=True) -> RolloutBatch:
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (n, p + c))
    lens = torch.tensor([5, 2, 1, 4])[:n]
    cm = torch.arange(c)[None] < lens[:, None]
    am = torch.cat([torch.ones(n, p, dtype=torch.int8), cm.to(torch.int8)], 1)
    am[0, 0] = 0
    return RolloutBatch(input_ids=ids, attention_mask=am, completion_mask=cm, rewards=torch.randn(n),
                        advantages=torch.randn(n), group_ids=torch.arange(n) // g,
                        old_logprobs=-torch.rand(n, c) * cm, prompt_len=p, group_size=g, policy_version=3,
                        ref_logprobs=(-torch.rand(n, c) * cm) if ref else None, meta={"ids": ["a", "b"]})


@pytest.mark.parametrize("ref", [True, False])
def test_round_trip_is_exact(ref):
    b = make_batch(ref=ref)
    out = RolloutBatch.from_bytes(b.to_bytes(), vocab_size=50)
    for k, v in b.tensors().items():
        assert torch.equal(v, getattr(out, k)), k
    assert (out.prompt_len, out.group_size, out.policy_version, out.meta) == (3, 2, 3, {"ids": ["a", "b"]})
    assert (out.ref_logprobs is None) == (not ref)


def _mutate(field, value):
    b = make_batch()
    setattr(b, field, value)
    return b


@pytest.mark.parametrize("batch,match", [
    (_mutate("rewards", torch.tensor([1.0, float("nan"), 0.0, 0.0])), "rewards holds NaN"),
    (_mutate("rewards", torch.zeros(3)), "rewards has shape"),
    (_mutate("input_ids", torch.zeros(4, 8, dtype=torch.int32)), "input_ids must be torch.int64"),
    (_mutate("group_ids", torch.tensor([0, 1, 1, 1])), "group_ids must be constant"),
    (_mutate("old_logprobs", torch.ones(4, 5)), "old_logprobs must be <= 0"),
    (_mutate("prompt_len", 8), "prompt_len 8"),
    (_mutate("group_size", 3), "not a multiple of group_size"),
])
def test_validation_rejects(batch, match):
    with pytest.raises(BatchError, match=match):
        batch.validate(vocab_size=50)


def test_out_of_vocab_and_limits():
    b = make_batch()
    with pytest.raises(BatchError, match="outside the vocabulary"):
        b.validate(vocab_size=10)
    with pytest.raises(BatchError, match="exceeds the limit"):
        b.validate(max_seqs=2)


def test_garbage_bytes_rejected():
    for data in (b"", b"\x00" * 4, b"\xff" * 100, make_batch().to_bytes()[:-7]):
        with pytest.raises(BatchError):
            RolloutBatch.from_bytes(data)
