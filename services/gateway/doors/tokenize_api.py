"""vLLM's /tokenize and /detokenize: the token ids a prompt or a chat
conversation becomes here (the same ids a generation would be sent), and the
text of token ids.

Each call spends one of its tenant's request rate (TENANTS_FILE's
requests_per_s), as a generation does; a text longer than the context could
hold is refused by its length before it is tokenized (prompt_bound.py), and
the tokenizer works off the event loop without holding the GIL. A `model` must name a served
name or an adapter the caller may use (their tokenizer is the base model's), else vLLM's 404."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request

from services.gateway.requests.chat_request import checked_tools, read_messages
from services.gateway.text.chat_template import chat_prompt_ids, with_special_tokens
from services.gateway.errors import bad_request
from services.gateway.requests.schemas import DetokenizeBody, TokenizeBody
from services.gateway.state import GatewayState
from services.gateway.requests.unsupported import reject_unsupported
from services.gateway.requests.validation import check_text

router = APIRouter()
_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "bad values"}, 401: {"description": "missing or wrong API key"},
    422: {"description": "schema error"}, 429: {"description": "the tenant's request rate"}}


def _state(request: Request) -> GatewayState:
    return request.app.state.gateway


@router.post("/tokenize", responses=_ERRORS)
async def tokenize(body: TokenizeBody, request: Request) -> dict[str, Any]:
    """{"prompt"} or {"messages", "tools"} -> {"count", "max_model_len", "tokens"}."""
    state = _state(request)
    charge_rate(state, request)
    reject_unsupported(body.model_extra)
    state.adapter_for(body.model, getattr(request.state, "tenant", None))   # a name served to the caller, else 404
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("Give either prompt or messages.", "prompt" if body.prompt else "messages")
    if body.prompt is not None:
        ids = await asyncio.to_thread(_prompt_ids, await state.bounded_tokenizer("prompt"),
                                      check_text(body.prompt, "prompt"),
                                      body.add_special_tokens is not False)
    else:
        messages = read_messages(body.messages or [])
        tools = [tool.as_template() for tool in checked_tools(body.tools, state.tokenizer)]
        ids = await state.tokenize(_chat_ids, messages, tools, body.add_generation_prompt,
                                   bool(body.add_special_tokens), tenant=getattr(request.state, "tenant", None),
                                   param="messages")
    reply: dict[str, Any] = {"count": len(ids), "max_model_len": (await state.limits()).max_model_len,
                             "tokens": ids}
    if body.return_token_strs:
        reply["token_strs"] = [state.tokenizer.convert_ids_to_tokens(token_id) for token_id in ids]
    return reply


@router.post("/detokenize", responses=_ERRORS)
async def detokenize(body: DetokenizeBody, request: Request) -> dict[str, Any]:
    """{"tokens"} -> {"prompt"}: their text, special tokens included."""
    state = _state(request)
    charge_rate(state, request)
    reject_unsupported(body.model_extra)
    state.adapter_for(body.model, getattr(request.state, "tenant", None))
    size = state.tokenizer_size
    for token_id in body.tokens:
        if not 0 <= token_id < size:
            raise bad_request(f"Token id {token_id} in tokens is outside the tokenizer's "
                              f"vocabulary [0, {size}).", "tokens")
    decode = getattr(state.tokenizer, "decode_long", state.tokenizer.decode)
    text = await asyncio.to_thread(decode, body.tokens, skip_special_tokens=False)
    return {"prompt": text}


def charge_rate(state: GatewayState, request: Request) -> None:
    """Spends one of the caller's tenant's request rate (429 with Retry-After past it)."""
    tenant = getattr(request.state, "tenant", None)
    if tenant is not None:
        state.quotas.take_rate(tenant.name)


def _prompt_ids(tokenizer: Any, prompt: str, add_special_tokens: bool) -> list[int]:
    return list(tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])


def _chat_ids(tokenizer: Any, messages: Any, tools: list[dict[str, Any]],
              add_generation_prompt: bool, add_special_tokens: bool) -> list[int]:
    """The conversation's ids, as a chat request sends them; add_special_tokens
    adds the tokenizer's own special tokens on top of what the template writes."""
    ids = chat_prompt_ids(tokenizer, messages, tools, add_generation_prompt)
    return with_special_tokens(tokenizer, ids) if add_special_tokens else ids
