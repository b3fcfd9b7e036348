"""The chat template: how OpenAI-style messages become one prompt for a decoder whose tokenizer has no chat
tokens of its own (the shipped family's byte-level BPE has only <pad>, <s> and </s>).

    <s>system: You answer briefly.
    user: 47+8=
    assistant: 55
    user: rev:123=
    assistant:

One turn per message, "{role}: {content}" and a newline; the prompt ends with "assistant:" for the model
to continue. The answer ends at </s> or where the model starts the next turn: "\\nuser:" and "\\nsystem:"
are stop sequences of every chat request, besides the caller's own (never shown). Roles: system, user,
assistant; OpenAI's "developer" is read as system. Content is a string, or a list of text parts.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..generation.options import InvalidGeneration

CHAT_STOPS = ("\nuser:", "\nsystem:")
ROLE_NAMES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_MESSAGE_CHARS = 200_000


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str = Field(..., max_length=MAX_MESSAGE_CHARS)


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")  # name, tool_call_id, ...: nothing here reads them
    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str, Field(max_length=MAX_MESSAGE_CHARS)] | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


def render(messages: list[Message]) -> str:
    """The prompt (the tokenizer's <s> comes first, added with the ids)."""
    if not messages:
        raise InvalidGeneration("messages is empty", "messages", "empty_prompt")
    turns = [f"{ROLE_NAMES[m.role]}: {m.text()}\n" for m in messages]
    return "".join(turns) + "assistant:"
