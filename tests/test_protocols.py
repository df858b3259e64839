"""Tool-call protocols: what counts as a call, what a malformed one tells the model; tools that do not
exist fail at start in one line."""

from pathlib import Path

import pytest

from nanogrpo.cli import main
from nanogrpo.config import load_config
from nanogrpo.errors import ToolError
from nanogrpo.tools.protocols import CodeProtocol, HermesProtocol, make_protocol
from nanogrpo.tools.runner import ToolRunner, resolve_tool


@pytest.mark.parametrize("turn,call", [
    ("<think>let me compute <code>print(37*48)</code>", "print(37*48)"),
    ("<code>\n    x = 3\n    print(x)\n</code>\n", "x = 3\nprint(x)"),          # overhang, indentation
    ("<code>python\nprint(1)</code>", "print(1)"),
    ("<code>a</code> <code>b</code>", "a"),                                  # the first closed block
])
def test_code_protocol_finds_the_call(turn, call):
    assert CodeProtocol().parse(turn).text == call


def test_a_call_opened_in_the_prompt():
    p = CodeProtocol()
    got = p.parse("print(6*7)</code>", before="User: ...<code>x</code> Assistant: <code>")
    assert got.text == "print(6*7)"
    assert p.parse("print(6*7)</code>", before="example: <code>x</code> now").text is None
    assert p.parse("<code>a</code>", before="<code>").text == "a"


@pytest.mark.parametrize("turn,why", [
    ("print(1)</code>", "without an opening <code>"),
    ("<code>  \n</code>", "empty <code> block"),
    ("no call here", "no </code>"),
])
def test_code_protocol_malformed_calls(turn, why):
    c = CodeProtocol().parse(turn)
    assert c.text is None and why in c.error


@pytest.mark.parametrize("turn,result", [
    ('<tool_call>\n{"name": "python", "arguments": {"code": "print(2)"}}\n</tool_call>', ("print(2)", None)),
    ('<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"1+1\\"}"}</tool_call>', ("1+1", None)),
    ('<tool_call>{"name": "python", "arguments": {"code": "x"</tool_call>', (None, "not valid JSON")),
    ('<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>', (None, "unknown tool 'search'")),
    ('<tool_call>{"name": "python", "arguments": {"src": "x"}}</tool_call>', (None, "argument 'code'")),
    ('<tool_call>[1, 2]</tool_call>', (None, '{"name": ..., "arguments": {...}}')),
])
def test_hermes_protocol(turn, result):
    c = HermesProtocol("python", "code").parse(turn)
    assert c.text == result[0]
    if result[1]:
        assert result[1] in c.error


def test_hermes_output_is_qwens_tool_message():
    """What Qwen2.5/Qwen3's chat template writes after an assistant turn that ends in a tool call."""
    p = make_protocol("hermes")
    fed = p.before_output + "42" + p.after_output
    assert fed == "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n" \
                  "<|im_start|>assistant\n"
    assert p.stop == ("</tool_call>",)


def test_a_malformed_call_is_not_run_and_is_counted():
    cfg = load_config(overrides=["tools.enabled=true"]).tools
    tools = ToolRunner(cfg)
    [res] = tools.run([CodeProtocol().parse("print(1)</code>")], [{}])
    assert res.status == "invalid" and res.output.startswith("error: </code> without")
    assert tools.sandbox._proc is None                         # nothing was started for it
    tools.close()


def test_unknown_tools_fail_at_start(tmp_path, capsys):
    with pytest.raises(ToolError, match="cannot import 'no_such_module'"):
        resolve_tool("no_such_module:fn")
    with pytest.raises(ToolError, match="has no function 'nope'"):
        resolve_tool("tests.tool_fixtures:nope")
    with pytest.raises(ToolError, match="file not found"):
        resolve_tool(str(tmp_path / "missing.py") + ":fn")
    assert resolve_tool("python") == "nanogrpo.tools.python:run_python"
    out = tmp_path / "never"
    config = Path(__file__).resolve().parents[1] / "configs" / "demo-tools.toml"
    assert main(["train", "--config", str(config), "--out", str(out),
                 "tools.function=no_such_module:fn"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("nanogrpo: error: tool 'no_such_module:fn'") and len(err.splitlines()) == 1
    assert not out.exists()
