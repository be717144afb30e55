"""Tools given to a chat template as Python functions, turned into the JSON schemas templates read,
as transformers' `get_json_schema` builds them: the function's name, its Google-style docstring's
summary and `Args:` descriptions (a trailing `(choices: [...])` becomes an `enum`), and its
parameters' type hints (int, float, str, bool, None, Any, list/tuple/dict and their typed forms,
Union/Optional, Literal, Enum). A function without a docstring, an argument without a type hint
or a description, or a hint with no JSON form (a custom class) is refused, naming it.

    def multiply(x: float, y: float = 2.0):
        '''Multiplies two numbers.

        Args:
            x: The first number
            y: The second number
        '''
    tool_schema(multiply) == {"type": "function", "function": {"name": "multiply",
        "description": "Multiplies two numbers.", "parameters": {"type": "object", "properties": {
        "x": {"type": "number", "description": "The first number"}, "y": {...}}, "required": ["x"]}}}
"""

from __future__ import annotations

import enum
import inspect
import json
import re
import types
import typing
from typing import Any, Callable, Mapping, Sequence

# JSON types of the scalar values an enum (Enum members, Literal arguments, choices) may hold
_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
_PLAIN = {**{t: {"type": name} for t, name in _SCALARS.items()},
          list: {"type": "array"}, tuple: {"type": "array"}, dict: {"type": "object"}}

# docstring sections: the summary runs to the first section; Args: to Returns:/Raises:/the end
_SUMMARY = re.compile(r"^(.*?)[\n\s]*(Args:|Returns:|Raises:|\Z)", re.DOTALL)
_ARGS = re.compile(r"\n\s*Args:\n(.*?)[\n\s]*(Returns:|Raises:|\Z)", re.DOTALL)
_RETURNS = re.compile(r"\n\s*Returns:\n\s*(.*?)[\n\s]*(Raises:|\Z)", re.DOTALL)
# one argument: "name (type): text", its text running on until a line, no deeper indented, starts another
_ARG = re.compile(r"(?:^|\n)([ \t]*)(\w+)(?:[ \t]*\([^()\n]*\))?:\s*(.*?)\s*"
                  r"(?=\n(?!\1[ \t])[ \t]*\w+(?:[ \t]*\([^()\n]*\))?:|\Z)", re.DOTALL)
_CHOICES = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.IGNORECASE)


def tool_schemas(tools: Sequence[Any] | None) -> list[Any] | None:
    """`tools` as a template gets them: mappings as they are, functions and methods as tool_schema
    builds them. Anything else is a ValueError."""
    if tools is None:
        return None
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise ValueError(f"tools must be a list of JSON schemas (dicts) or functions, got {type(tools).__name__}")
    out = []
    for i, tool in enumerate(tools):
        if isinstance(tool, Mapping):
            out.append(tool)
        elif inspect.isfunction(tool) or inspect.ismethod(tool):
            out.append(tool_schema(tool))
        else:
            raise ValueError(f"tools[{i}] must be a JSON schema (a dict) or a function with type hints and a "
                             f"docstring, got {type(tool).__name__}")
    return out


def tool_schema(func: Callable) -> dict:
    """The JSON schema of `func` as a chat template's tool (module docstring)."""
    name = getattr(func, "__name__", "operation")
    doc = inspect.getdoc(func)
    if not doc:
        raise ValueError(f"tool {name!r} has no docstring, which describes the tool and its arguments to the model")
    summary, described, returns = _parse_docstring(doc.strip())
    parameters = _parameters(func, name)
    returned = parameters["properties"].pop("return", None)
    if returned is not None and returns is not None:
        returned["description"] = returns
    for arg, schema in parameters["properties"].items():
        if arg not in described:
            raise ValueError(f"tool {name!r}: the docstring's Args: section does not describe the argument {arg!r}")
        text = described[arg]
        choices = _CHOICES.search(text)
        if choices:
            schema["enum"] = [c.strip() if isinstance(c, str) else c for c in json.loads(choices.group(1))]
            text = text[:choices.start()].strip()
        schema["description"] = text
    function = {"name": name, "description": summary, "parameters": parameters}
    if returned is not None:
        function["return"] = returned
    return {"type": "function", "function": function}


def _parse_docstring(doc: str) -> tuple[str | None, dict[str, str], str | None]:
    summary, args, returns = _SUMMARY.search(doc), _ARGS.search(doc), _RETURNS.search(doc)
    described = {}
    if args is not None:
        block = "\n".join(line for line in args.group(1).split("\n") if line.strip())
        described = {m[1]: re.sub(r"\s*\n+\s*", " ", m[2].strip()) for m in _ARG.findall(block)}
    return (summary.group(1).strip() if summary else None, described,
            returns.group(1).strip() if returns else None)


def _parameters(func: Callable, name: str) -> dict:
    hints = typing.get_type_hints(func)
    params = inspect.signature(func).parameters
    first = next(iter(params), None)
    # an unannotated first `self`/`cls` is a method's receiver, not an argument
    receiver = first if first in ("self", "cls") and params[first].annotation is inspect.Parameter.empty else None
    required = []
    for p in params.values():
        if p.name == receiver:
            continue
        if p.annotation is inspect.Parameter.empty:
            raise ValueError(f"tool {name!r}: the argument {p.name!r} has no type hint")
        if p.default is inspect.Parameter.empty:
            required.append(p.name)
    properties = {}
    for arg, hint in hints.items():
        if arg == receiver:
            continue
        if arg == "return":
            try:  # the model never writes the return value: a hint with no JSON form is left out
                properties[arg] = _json_type(hint)
            except ValueError:
                pass
        elif arg in params:  # (a bound method's hints include its receiver's)
            properties[arg] = _json_type(hint)
    schema = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    return schema


def _enum(values: list) -> dict:
    kinds = list(dict.fromkeys(_SCALARS[type(v)] for v in values))
    return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": values}


def _json_type(hint: Any) -> dict:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is None:
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            values = [m.value for m in hint]
            if not values:
                raise ValueError(f"the Enum {hint.__name__} has no members, so no value could match it")
            if any(type(v) not in _SCALARS for v in values):
                raise ValueError(f"the Enum {hint.__name__}'s values {values} are not all JSON scalars (int, float, "
                                 "str, bool, None)")
            return _enum(values)
        if hint is Any:
            return {}
        if hint in _PLAIN:
            return dict(_PLAIN[hint])
        raise ValueError(f"the type hint {hint!r} has no JSON schema form (a custom class?); use basic types, "
                         "Enum, Literal, and list/tuple/dict/Union of those, or pass the tool's JSON schema")
    if origin is typing.Union or origin is types.UnionType:
        kinds = [_json_type(t) for t in args if t is not type(None)]
        if len(kinds) == 1:
            out = kinds[0]
        elif all(k.keys() == {"type"} and isinstance(k["type"], str) for k in kinds):
            names = sorted({k["type"] for k in kinds})
            out = {"type": names[0] if len(names) == 1 else names}
        else:
            out = {"anyOf": kinds}
        if type(None) in args:
            out["nullable"] = True
        return out
    if origin is typing.Literal and args:
        if any(type(a) not in _SCALARS for a in args):
            raise ValueError(f"{hint!r}: a Literal's values must be JSON scalars (int, float, str, bool, None)")
        return _enum(list(args))
    if origin is list:
        return {"type": "array", "items": _json_type(args[0])} if args else {"type": "array"}
    if origin is tuple:
        if not args:
            return {"type": "array"}
        if len(args) == 1:
            raise ValueError(f"{hint!r}: a tuple of one element has no JSON schema form here; use list[...] or the "
                             "element's type")
        if ... in args:
            raise ValueError(f"{hint!r}: a variable-length tuple has no JSON schema form here; use list[...]")
        return {"type": "array", "prefixItems": [_json_type(t) for t in args]}
    if origin is dict:
        out = {"type": "object"}
        if len(args) == 2:
            out["additionalProperties"] = _json_type(args[1])
        return out
    raise ValueError(f"the type hint {hint!r} has no JSON schema form; pass the tool's JSON schema instead")
