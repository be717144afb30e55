"""Tools given as Python functions (runtime/tool_schema.py) against transformers' get_json_schema, and
through Tokenizer.apply_chat_template and LLM.chat."""

from __future__ import annotations

import enum
from typing import Any, Literal, Optional, Union

import pytest

from runtime.tool_schema import tool_schema, tool_schemas


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


def multiply(x: float, y: float = 2.0):
    """Multiplies two numbers.

    Args:
        x: The first number
        y: The second number, which
            runs over two lines
    """


def pick(color: Color, level: Level, mode: Literal["fast", 1, None], flag: bool | None = None) -> str:
    """Picks things.

    A second paragraph of the summary.

    Args:
        color (Color): which colour
        level: how much
        mode: the mode
        flag: a flag

    Returns:
        The pick, in a string.

    Raises:
        ValueError: never
    """


def containers(a: list[int], b: tuple[str, float], c: dict[str, list[bool]], d: Optional[int], e: Union[int, str],
               f: Union[list[int], str, None], g: Any, h: list, i: dict, j: tuple) -> dict[str, int]:
    """Containers.

    Args:
        a: ints
        b: a pair
        c: a map
        d: maybe an int
        e: an int or a string
        f: a list or a string
        g: anything
        h: a list
        i: a dict
        j: a tuple
    """


def drink(beverage: str, size: int):
    """Drinks.

    Args:
        beverage: The beverage to drink (choices: ["tea", "coffee"])
        size: The size (CHOICES: [1, 2, 3])
    """


class Toolbox:
    def method(self, n: int) -> Toolbox:  # a return hint with no JSON form is left out
        """A method.

        Args:
            n: a count
        """

    @classmethod
    def klass(cls, s: str):
        """A class method.

        Args:
            s: a string
        """


def no_doc(x: int):
    pass


def no_hint(x):
    """Doc.

    Args:
        x: something
    """


def undescribed(x: int, y: int):
    """Doc.

    Args:
        x: described
    """


def custom(x: Toolbox):
    """Doc.

    Args:
        x: a custom class
    """


def one_tuple(x: tuple[int]):
    """Doc.

    Args:
        x: a one-element tuple
    """


def open_tuple(x: tuple[int, ...]):
    """Doc.

    Args:
        x: a variable-length tuple
    """


class Empty(enum.Enum):
    pass


def empty_enum(x: Empty):
    """Doc.

    Args:
        x: an enum without members
    """


GOOD = [multiply, pick, containers, drink, Toolbox().method, Toolbox.klass]
BAD = [no_doc, no_hint, undescribed, custom, one_tuple, open_tuple, empty_enum]


@pytest.fixture(scope="module")
def get_json_schema():
    return pytest.importorskip("transformers.utils").get_json_schema


@pytest.mark.parametrize("func", GOOD, ids=lambda f: f.__name__)
def test_schema_equals_transformers(func, get_json_schema):
    assert tool_schema(func) == get_json_schema(func)


def test_schema_in_full():
    assert tool_schema(multiply) == {"type": "function", "function": {
        "name": "multiply", "description": "Multiplies two numbers.", "parameters": {
            "type": "object", "properties": {
                "x": {"type": "number", "description": "The first number"},
                "y": {"type": "number", "description": "The second number, which runs over two lines"}},
            "required": ["x"]}}}
    props = tool_schema(pick)["function"]["parameters"]["properties"]
    assert props["color"]["enum"] == ["red", "green"] and props["level"] == {"type": "integer", "enum": [1, 2],
                                                                             "description": "how much"}
    assert props["mode"]["type"] == ["string", "integer", "null"]
    assert tool_schema(pick)["function"]["return"] == {"type": "string", "description": "The pick, in a string."}


@pytest.mark.parametrize("func", BAD, ids=lambda f: f.__name__)
def test_what_transformers_refuses_is_refused_naming_it(func, get_json_schema):
    with pytest.raises(Exception):
        get_json_schema(func)
    with pytest.raises(ValueError, match=r"no docstring|'x'|'y'|Toolbox|tuple|no members"):
        tool_schema(func)


def test_tool_lists():
    schema = {"type": "function", "function": {"name": "f", "parameters": {}}}
    assert tool_schemas(None) is None
    assert tool_schemas([schema, multiply]) == [schema, tool_schema(multiply)]
    for bad in ([3], ["multiply"], [len], schema, "tools"):
        with pytest.raises(ValueError, match="tools"):
            tool_schemas(bad)


TOOLS_TEMPLATE = ("{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
                  "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")


def test_chat_template_gets_functions_as_schemas(tmp_path):
    from tests.runtime.test_chat_template import _folder

    transformers = pytest.importorskip("transformers")
    from runtime.tokenizer import Tokenizer

    d = _folder(tmp_path / "tok", chat_template=TOOLS_TEMPLATE)
    ours, hf = Tokenizer.from_pretrained_dir(d), transformers.AutoTokenizer.from_pretrained(d)
    chat = [{"role": "user", "content": "hello"}]
    tools = [multiply, {"type": "function", "function": {"name": "f"}}, Toolbox().method]
    text = ours.apply_chat_template(chat, tools=tools)
    assert text == hf.apply_chat_template(chat, tools=tools, tokenize=False)
    assert '"name": "multiply"' in text and '"name": "method"' in text
    with pytest.raises(ValueError, match="tools"):
        ours.apply_chat_template(chat, tools=[object()])


def test_llm_chat_takes_tools(tmp_path):
    """LLM.chat(tools=...) as vLLM's: rendered into the prompt (functions as their schemas)."""
    from tests.runtime.test_chat_template import _folder
    from tests.testing.engine import scaled_dummy
    from xlaserve import LLM, SamplingParams

    d = _folder(tmp_path / "tok", chat_template=TOOLS_TEMPLATE)
    llm = LLM(scaled_dummy(seed=0), tokenizer=d, dtype="float32", max_num_seqs=2, max_num_batched_tokens=64,
              token_buckets=(64,), seq_buckets=(2,), max_model_len=128, progress=False)
    out = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(max_tokens=1), tools=[multiply],
                   use_tqdm=False)
    assert out[0].prompt.startswith('{"type": "function", "function": {"name": "multiply"')
