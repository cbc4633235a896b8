"""Tools (tools.py): the calculator (tasks/calculator.py) evaluates arithmetic and nothing
else, schemas come from type hints and docstrings, calls parse in the Hermes format with
errors returned as results, and the prompts carry the tools however the template treats
them."""

import pytest

from tasks.calculator import calculator
from tools import call, load_tools, schema, tools_prompt, use_tools


def test_the_calculator_does_arithmetic_exactly():
    assert calculator("2 + 3 * 4") == "14"
    assert calculator("12345678 * 87654321") == str(12345678 * 87654321)  # no float rounding
    assert calculator("(7 - 10) / 2") == "-1.5" and calculator("2 ** 10") == "1024" and calculator("17 % 5") == "2"
    assert calculator("6 / 3") == "2"


@pytest.mark.parametrize(
    "expression",
    ["__import__('os').system('true')", "open('x')", "a + 1", "[1, 2]", "2 ** 1000", "9" * 300, "1 +", "True + 1"],
)
def test_the_calculator_refuses_anything_but_arithmetic(expression):
    with pytest.raises((ValueError, SyntaxError)):
        calculator(expression)


def test_a_schema_comes_from_hints_and_docstring():
    assert schema(calculator) == {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression of numbers, + - * / // % ** and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }

    def no_hints(x):
        """Doc."""

    with pytest.raises(ValueError, match="needs a type hint"):
        schema(no_hints)
    with pytest.raises(ValueError, match="cannot load tool"):
        load_tools("calculator,nowhere:fn")
    assert load_tools("calculator") == [calculator]


def test_calls_parse_and_errors_come_back_as_results(monkeypatch):
    tools = [calculator]
    assert call(tools, '{"name": "calculator", "arguments": {"expression": "40 + 2"}}') == "42"
    assert call(tools, "{not json").startswith("error: JSONDecodeError")
    assert call(tools, '{"name": "search", "arguments": {}}') == "error: no tool or field 'search'"
    assert call(tools, '{"name": "calculator", "arguments": {"expression": "x"}}').startswith("error: ValueError")
    assert call(tools, '{"name": "calculator", "arguments": {"expr": "1"}}').startswith("error: TypeError")
    monkeypatch.setenv("GRPO_TOOLS", "calculator")
    answer = 'First <tool_call>{"name": "calculator", "arguments": {"expression": "2*21"}}</tool_call> then '
    answer += '<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>'
    reply = use_tools({}, [{"role": "user", "content": "q"}, {"role": "assistant", "content": answer}])
    assert reply == {"role": "tool", "content": "42\nerror: ZeroDivisionError: division by zero"}
    assert use_tools({}, [{"role": "assistant", "content": "The answer is 42."}]) is None  # no call: the end


def test_the_prompts_carry_the_tools_in_the_template_or_the_system_prompt():
    import tiny
    from data import build_prompts

    tokenizer = tiny.build_tiny_tokenizer()  # a template that renders no tools: the system prompt has them
    (plain,) = build_prompts([{"question": "What is 2+2?"}], tokenizer, 4096, "test", None, tools=[calculator])
    text = tokenizer.decode(plain["prompt_ids"])
    assert plain["prompt_messages"][0] == {"role": "system", "content": tools_prompt([calculator])}
    assert '"name": "calculator"' in text and "<tool_call>" in text
    tokenizer.chat_template = (  # one that does, as Qwen2.5's: the schemas go to it, not to the system prompt
        "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (rendered,) = build_prompts([{"question": "What is 2+2?"}], tokenizer, 4096, "test", None, tools=[calculator])
    assert tokenizer.decode(rendered["prompt_ids"]).startswith('<tools>{"type": "function"')
    assert rendered["prompt_messages"] == [{"role": "user", "content": "What is 2+2?"}]
