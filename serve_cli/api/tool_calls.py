"""Tool calls in a chat reply (OpenAI's ``tools``; vLLM's ``--enable-auto-tool-choice`` with
``--tool-call-parser``): the model writes its calls as text in its own format, and a parser turns
them into the reply's ``tool_calls``.

``hermes`` is the format of Hermes, Qwen2.5 and Qwen3 (their chat templates teach it)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The text before the first call is the reply's content. A reply whose call blocks do not all hold a
JSON object with a ``name`` is left as plain content, as vLLM leaves it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from serve_cli.api.errors import invalid

PARSERS = ("hermes",)
_START = "<tool_call>"
# a closed block, or the last one left open when the output ended
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


def offered_tools(body: Any, parser: str | None) -> list[dict[str, Any]] | None:
    """The request's ``tools`` (as sent: dicts) when the model is to see them and may call them
    (``tool_choice`` unset or "auto"), else None. 400 for what cannot be served: tools on a
    server started without a parser, or a ``tool_choice`` that forces a call (that needs guided
    decoding); a tool that is not a named function was refused by its type (``protocol.py``)."""
    tools, choice = getattr(body, "tools", None), getattr(body, "tool_choice", None)
    if isinstance(choice, str) and choice not in ("auto", "none", "required"):
        raise invalid(
            f"'tool_choice' must be \"auto\", \"none\", \"required\" or a named function, got "
            f"{choice!r}",
            "tool_choice",
        )
    if choice not in (None, "auto", "none"):
        raise invalid(
            f"'tool_choice' {choice!r} forces a call, which needs guided decoding; xhal-serve "
            "takes \"auto\" (the model decides) or \"none\"",
            "tool_choice",
            "unsupported_parameter",
        )
    if not tools or choice == "none":
        return None
    if parser is None:
        raise invalid(
            "'tools' are not supported unless the server is started with "
            f"--enable-auto-tool-choice and --tool-call-parser (one of {', '.join(PARSERS)}: the "
            "model's call format)",
            "tools",
            "unsupported_parameter",
        )
    return [tool.model_dump(exclude_none=True) for tool in tools]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it

    def as_dict(self, index: int | None = None) -> dict:
        """OpenAI's shape (with ``index``, a stream delta's)."""
        call = {
            "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


def parse(text: str) -> tuple[str | None, list[ToolCall]]:
    """``text`` -> (the content before the calls, or None when empty; the calls), or
    ``(text, [])`` when it holds no well-formed call."""
    start = text.find(_START)
    if start < 0:
        return text, []
    calls = []
    for block in _BLOCK.findall(text, start):
        try:
            call = json.loads(block)
        except json.JSONDecodeError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        arguments = call.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append(ToolCall(call["name"], arguments))
    content = text[:start].strip()
    return content or None, calls


class StreamedReply:
    """A streamed reply's text, released as content up to where a tool call might begin: the
    text from ``<tool_call>`` on (or a tail that could grow into it) is held until ``finish``
    decides between calls and content."""

    def __init__(self) -> None:
        self.text = ""
        self._released = 0

    def feed(self, delta: str) -> str:
        """Add ``delta``; return the content it releases (may be empty)."""
        self.text += delta
        start = self.text.find(_START, max(0, self._released - len(_START)))
        end = start if start >= 0 else len(self.text) - _open_tail(self.text)
        end = max(end, self._released)
        out, self._released = self.text[self._released : end], end
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The output ended: (the content still to send, the calls)."""
        calls = parse(self.text)[1]
        if not calls:
            return self.text[self._released :], []
        # what was released is the text before the first call; the rest of the content is its
        # stripped end, which parse() dropped: nothing more to send
        return "", calls


def _open_tail(text: str) -> int:
    """The length of the longest tail of ``text`` that is a proper prefix of ``<tool_call>``."""
    for n in range(min(len(_START) - 1, len(text)), 0, -1):
        if _START.startswith(text[-n:]):
            return n
    return 0
