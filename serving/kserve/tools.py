"""Tool calling for ``/v1/chat/completions``: OpenAI's ``tools`` and ``tool_choice``.

- ``tools`` (functions, each with a JSON schema of its ``parameters``) go to the chat
  template as ``tools`` (Hugging Face's ``apply_chat_template`` convention), unless
  ``tool_choice`` is ``"none"``.
- ``tool_choice`` a named function: the output is held to that function's parameters'
  schema (a structured output) and answered as one call of it; ``"required"``: to a
  JSON array of one or more ``{"name", "arguments"}`` calls of the tools (one at most
  with ``parallel_tool_calls`` false).
- ``"auto"`` (the default with tools): the model decides; its text is a call when it is
  such a JSON object or array, or ``<tool_call>...</tool_call>`` blocks holding them
  (Hermes' and Qwen's format), each naming a tool given. Anything else is content.

Answered as OpenAI does: ``message.tool_calls`` (``id``, ``type`` ``function``,
``function.name``, ``function.arguments`` as a JSON string) with ``content`` null and
``finish_reason`` ``"tool_calls"``.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from . import core

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def _invalid(message: str) -> core.InvalidRequest:
    return core.InvalidRequest(message)


class Tools:
    """A chat request's tools and how they may be called (``mode``: ``auto``,
    ``required`` or ``named``, with ``named`` the function's name)."""

    def __init__(self, tools: list[dict], mode: str, named: str | None, parallel: bool) -> None:
        self.tools = tools
        self.schemas = {t["function"]["name"]: t["function"].get("parameters") for t in tools}
        self.mode = mode
        self.named = named
        self.parallel = parallel

    def structured(self) -> dict | None:
        """The structured output a call is held to (vLLM's ``structured_outputs``), or
        None (``auto``)."""
        if self.mode == "named":
            return {"json": self._parameters(self.named or "")}
        if self.mode != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": self._parameters(name)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name in self.schemas
        ]
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            array["maxItems"] = 1
        return {"json": array}

    def _parameters(self, name: str) -> dict:
        return self.schemas.get(name) or {"type": "object", "properties": {}}

    def calls(self, text: str) -> list[dict] | None:
        """The tool calls in a generation's ``text`` (OpenAI's ``tool_calls``), or None
        when it is content."""
        if self.mode == "named":
            found = [(self.named, _loads(text))]
        else:
            found = _calls_in(text)
        if not found or any(
            name not in self.schemas or not isinstance(args, dict) for name, args in found
        ):
            return None
        return [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args)},
            }
            for name, args in found
        ]


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _calls_in(text: str) -> list[tuple[Any, Any]]:
    """(name, arguments) of each call in ``text``: a JSON call or list of calls, or
    ``<tool_call>`` blocks of them; empty when it holds none."""
    blocks = _BLOCK.findall(text)
    docs = [_loads(b) for b in blocks] if blocks else [_loads(text.strip())]
    found = []
    for doc in docs:
        for call in doc if isinstance(doc, list) else [doc]:
            if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
                return []
            args = call.get("arguments", call.get("parameters"))
            if isinstance(args, str):
                args = _loads(args)
            found.append((call["name"], args))
    return found


def parse(body: dict) -> Tools | None:
    """A chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``,
    checked (a 400 naming the field); None without tools or with ``tool_choice``
    ``"none"``."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool) and parallel is not None:
        raise _invalid(f"parallel_tool_calls must be true or false, got {parallel!r:.40}")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise _invalid(f"tool_choice {choice!r:.60} needs tools")
        return None
    if not isinstance(tools, list):
        raise _invalid(f"tools must be a list of functions, got {tools!r:.60}")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not (
            isinstance(tool, dict)
            and tool.get("type") == "function"
            and isinstance(fn, dict)
            and isinstance(fn.get("name"), str)
            and fn["name"]
        ):
            raise _invalid(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                f"'parameters': ...}}}}, got {tool!r:.80}"
            )
        if not isinstance(fn.get("parameters", {}), dict):
            raise _invalid(f"tools[{i}].function.parameters must be a JSON schema (an object)")
    names = [t["function"]["name"] for t in tools]
    if choice in (None, "auto"):
        return Tools(tools, "auto", None, parallel is not False)
    if choice == "none":
        return None
    if choice == "required":
        return Tools(tools, "required", None, parallel is not False)
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and named):
        raise _invalid(
            "tool_choice must be none, auto, required or {'type': 'function', 'function': "
            f"{{'name': ...}}}}, got {choice!r:.80}"
        )
    if named not in names:
        raise _invalid(f"tool_choice names {named!r:.60}, which is not among tools ({names})")
    return Tools(tools, "named", named, parallel is not False)
