"""Stop strings at the token level: a stop string spanning tokens, a token overhanging it, partial
UTF-8 bytes, special tokens; the streaming scanner agrees with the reference; the hf engine stops
where the rule says and keeps the tokens it sampled."""

from __future__ import annotations

import random

import pytest
import torch

from nanogrpo.engines.base import SamplingParams
from nanogrpo.engines.hf import HFEngine
from nanogrpo.engines.stops import StopStrings
from nanogrpo.models.tiny import make_model

CORPUS = ["<code>print(12*34)</code>\n<output>\n408\n</output>\n</think><answer>408</answer>",
          "héllo wörld ünïcode ✓ <tool_call>{}</tool_call>\n", "a </code>> </co de </code>\n\n"]


@pytest.fixture(scope="module")
def bpe():
    """A byte-level BPE tokenizer trained here (offline): merges across '</', 'code', '>\\n'."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def brute_force(tok, strings, ids):
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if any(s in text for s in strings):
            return k
    return None


def test_stop_spanning_tokens_keeps_the_overhang(bpe):
    ids = bpe("<code>print(12*34)</code>\n<output>", add_special_tokens=False)["input_ids"]
    stops = StopStrings(bpe, ["</code>"])
    k = stops.find(ids)
    assert bpe.decode(ids[:k]) == "<code>print(12*34)</code>\n"     # the whole last token, overhang kept
    assert "</code>" not in bpe.decode(ids[:k - 1]) and "</code>" not in bpe.decode(ids[k - 1:k])  # spans
    scanner = stops.scanner()
    assert [scanner.push(t) for t in ids].index(True) == k - 1


@pytest.mark.parametrize("strings", [["</code>"], ["</tool_call>", "</answer>"], ["✓"], ["<|im_end|>x"],
                                     ["ün"]])
def test_find_and_scanner_agree_with_every_prefix(bpe, strings):
    rng = random.Random(0)
    stops = StopStrings(bpe, strings)
    vocab = len(bpe)
    texts = CORPUS + [f"ab {s}cd" for s in strings]
    seqs = [bpe(t, add_special_tokens=False)["input_ids"] for t in texts]
    seqs += [[rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for _ in range(150)]
    found = 0
    for ids in seqs:
        want = brute_force(bpe, strings, ids)
        assert stops.find(ids) == want, (strings, ids)
        scanner = stops.scanner()
        hits = [scanner.push(t) for t in ids]
        assert (hits.index(True) + 1 if True in hits else None) == want
        found += want is not None
    assert found > 0


def test_hf_engine_stops_at_a_string_across_tokens(bpe):
    """Greedy text of a random model; a stop string taken from it across a token boundary; the engine
    ends there (``stop_string``) with exactly the tokens it sampled before, the overhang included."""
    model = make_model("tiny", bpe, seed=3)
    model.config.eos_token_id = bpe.eos_token_id
    engine = HFEngine(model, tokenizer=bpe)
    prompts = [bpe(t, add_special_tokens=False)["input_ids"] for t in ("<code>print(", "héllo")]
    free = engine.generate(prompts, SamplingParams(max_new_tokens=24, temperature=0.0))
    ids = free.completion_ids[0]
    # a 3-character string that starts inside token 4 and ends inside a later token
    text_before = bpe.decode(ids[:4], skip_special_tokens=False)
    whole = bpe.decode(ids, skip_special_tokens=False)
    stop = whole[len(text_before) - 1:len(text_before) + 2]
    assert len(stop) == 3
    got = engine.generate(prompts, SamplingParams(max_new_tokens=24, temperature=0.0, stop=(stop,)))
    k = brute_force(bpe, [stop], ids)
    assert got.completion_ids[0] == ids[:k] and got.finish_reasons[0] == "stop_string"
    assert got.logprobs[0] == pytest.approx(free.logprobs[0][:k], abs=1e-6)
    other = brute_force(bpe, [stop], free.completion_ids[1])
    if other is None:
        assert got.completion_ids[1] == free.completion_ids[1]
        assert got.finish_reasons[1] == free.finish_reasons[1]
    else:
        assert got.completion_ids[1] == free.completion_ids[1][:other]


def test_stop_strings_need_a_tokenizer_and_text():
    with pytest.raises(ValueError, match="need the tokenizer"):
        StopStrings(None, ["</code>"])
    with pytest.raises(ValueError, match="non-empty"):
        StopStrings(object(), [""])
    assert StopStrings(None, []).find([1, 2, 3]) is None
    torch.manual_seed(0)
