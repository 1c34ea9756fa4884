"""Pydantic models of the request bodies (the OpenAI fields xhal-serve implements).

Field constraints carry the 400s: a violated one is reported naming its field. Unknown fields
are accepted and ignored, as OpenAI clients send extras, except the sampling features xhal-serve
does not implement (``params.NOT_IMPLEMENTED``: guided decoding, tools, ...),
which are refused when set. ``null`` means "the default" for every field that has one, as the
OpenAI API documents its optional fields (``"n": null`` is ``n`` 1).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_N = 128
MAX_LOGPROBS = 20


class StreamOptions(BaseModel):
    include_usage: bool = False


class RequestFields(BaseModel):
    """A request body whose optional fields take ``null`` as their default."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data  # pydantic reports that the body is not an object
        fields = cls.model_fields
        return {
            k: v for k, v in data.items()
            if v is not None or k not in fields or fields[k].is_required()
        }  # fmt: skip


class SamplingFields(RequestFields):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, gt=0)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)  # vLLM's extension
    logit_bias: dict[str, float] | None = None  # token id (as a string, JSON's keys) -> bias
    min_p: float | None = Field(None, ge=0, le=1)  # vLLM's extension
    min_tokens: int | None = Field(None, ge=0)  # vLLM's: EOS and stops wait for this many
    # vLLM's: the prompt's last N tokens only (after the chat template, for chat)
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    # vLLM's: each prompt token's logprob and the N likeliest there (not streamed)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)  # what a torch generator takes
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False  # vLLM's extension: each choice carries its token ids
    stop_token_ids: list[int] | None = None  # vLLM's extension: stop after any of these tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0 only with echo: the prompt scored alone
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS (and such) around the prompt
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # the reply begins with the prompt's text and, with logprobs, its tokens' entries (the first
    # token's logprob null)
    echo: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[ContentPart] | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema


class ToolDefinition(BaseModel):
    """OpenAI's function tool; it reaches the chat template as sent."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    function: FunctionDefinition


class ChatTemplateFields(RequestFields):
    """How the conversation is rendered (vLLM's extensions): ``add_generation_prompt`` opens the
    assistant's turn; ``continue_final_message`` instead leaves the last message open so the model
    continues it; ``chat_template`` replaces the tokenizer's template; ``chat_template_kwargs``
    reach the template as variables (Qwen3's ``enable_thinking``)."""

    model_config = ConfigDict(extra="allow")

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class ChatCompletionRequest(ChatTemplateFields, SamplingFields):
    max_completion_tokens: int | None = Field(None, gt=0)
    # OpenAI's function tools (``tool_calls.py``): the template shows them to the model and the
    # server's parser reads its calls back; tool_choice "auto" (the default) or "none"
    tools: list[ToolDefinition] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # false: at most the first call is returned
    add_special_tokens: bool = False  # vLLM's: the template writes them
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # vLLM's: the reply repeats the last message when it has the reply's role
