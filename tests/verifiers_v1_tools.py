"""A verifiers 0.4 task for an agent with a shell (the ``bash`` harness): write 42 to ``answer.txt``; the
reward reads the file back from the runtime the harness ran the model's command in
(``env.source = "verifiers:tests.verifiers_v1_tools:AnswerTaskset"``). And a tiny model that calls the tool: a
char-level tokenizer with ``<tool_call>`` tokens and a chat template that renders tool calls and tool
results (Hermes style, what ``renderers``' ``qwen3`` tool parser reads), taught to answer the task with
one ``bash`` call and then ``done``."""

from __future__ import annotations

from pathlib import Path

import verifiers.v1 as vf

SHIPPED = Path(__file__).parent / "data" / "verifiers-v1-tool-model"
COMMAND = "echo 42 | tee answer.txt"
CALL = '<tool_call>{"name": "bash", "arguments": {"command": "' + COMMAND + '"}}</tool_call>'
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% if m.get('tool_calls') %}{% for tc in m['tool_calls'] %}<tool_call>"
    "{{ {'name': tc['function']['name'], 'arguments': tc['function']['arguments']} | tojson }}</tool_call>"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class AnswerTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def wrote_42(self, runtime) -> float:
        """1 when ``answer.txt`` in the runtime's working directory holds 42."""
        try:
            return float((await runtime.read("answer.txt")).decode().strip() == "42")
        except Exception:  # noqa: BLE001 - no file: no reward
            return 0.0


class AnswerTaskset(vf.Taskset[AnswerTask, vf.TasksetConfig]):
    def load(self):
        yield AnswerTask(vf.TaskData(prompt="Write 42 to answer.txt."), self.config.task)


__all__ = ["AnswerTaskset"]


def build_tool_model(out: Path, steps: int = 300) -> Path:
    """The tiny tool-calling model, trained (supervised) to reply ``CALL`` to the task and ``done`` to the
    tool's answer, saved to ``out``."""
    import random

    import torch
    from verifiers.v1.harnesses.bash.harness import BASH_SYSTEM_PROMPT

    from nanogrpo.demos.warm_start import save, sft
    from nanogrpo.models.tiny import make_model, make_tokenizer

    tok = make_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    tok.chat_template = TEMPLATE
    first = [{"role": "system", "content": BASH_SYSTEM_PROMPT},
             {"role": "user", "content": "Write 42 to answer.txt."}]
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c0", "type": "function", "function": {"name": "bash", "arguments": {"command": COMMAND}}}]}
    second = first + [call, {"role": "tool", "tool_call_id": "c0", "content": "42\n"}]
    pairs = [(first, CALL + "<|im_end|>"), (second, "done<|im_end|>")]
    seqs, trained = [], []
    for msgs, reply in pairs:
        prompt = tok(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)["input_ids"]
        target = tok(reply, add_special_tokens=False)["input_ids"]
        seqs.append(prompt + target)
        trained.append([False] * len(prompt) + [True] * len(target))
    torch.manual_seed(0)
    model = make_model("tiny", tok)
    order = [random.Random(k).randrange(2) for k in range(steps * 8)]
    sft(model, tok.pad_token_id, [seqs[i] for i in order], [trained[i] for i in order], steps, 8, 3e-3, 0)
    return save(model, tok, out)


if __name__ == "__main__":
    import sys

    print(build_tool_model(Path(sys.argv[1]) if len(sys.argv) > 1 else SHIPPED))
