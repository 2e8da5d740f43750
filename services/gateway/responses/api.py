"""The /v1/responses routes: create (streamed or not, in the background or
not), retrieve (with stream=true&starting_after=N, the events after N as they
come), cancel and delete. Only the tenant that created a response sees it:
any other gets the 404 an unknown id gets.

A background response is a detached request of the scheduler (its id the
response's), which keeps its tokens and this gateway's state of it (the
attachment): a gateway that does not hold the response (another replica, or
this one restarted) adopts it by reading it again from its first token, and so
rebuilds the very events it had streamed (docs/architecture.md)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from services.gateway.requests.backend import GenerationSpec
from services.gateway.requests.chat_request import ChatRequest, call_reader, constrain_tool_call, read_chat
from services.gateway.text.chat_template import chat_prompt_ids, turn_stop_token_ids
from services.gateway.errors import ApiError, bad_request, from_backend, overloaded
from services.gateway.streaming.generation import merge_streams
from services.gateway.models.lora_catalog import with_adapter
from services.gateway.doors.openai_api import chat_fields
from services.gateway.responses.body import ResponseCreateBody
from services.gateway.responses.events import ResponseBuilder, conversation_of
from services.gateway.responses.runner import start
from services.gateway.responses.store import ResponseRecord, ResponseStore, TooManyResponses
from services.gateway.responses.translate import chat_body, input_messages, refuse_unimplemented
from services.gateway.requests.schemas import ChatCompletionBody
from services.gateway.requests.spec import build_spec
from services.gateway.doors.sse import event_stream
from services.gateway.state import GatewayState, scheduler_request_id, until_disconnected

router = APIRouter(prefix="/v1")


def _state(request: Request) -> GatewayState:
    return request.app.state.gateway


def _owner(request: Request) -> str:
    tenant = getattr(request.state, "tenant", None)
    return tenant.name if tenant is not None else ""


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"No response with id {response_id!r} found.", "invalid_request_error",
                    "response_id", "not_found")


async def _record(request: Request, response_id: str) -> ResponseRecord:
    record = _state(request).responses.get(response_id, _owner(request))
    if record is None and response_id.startswith("resp_"):
        record = await _adopt(request, response_id)
    if record is None:
        raise _not_found(response_id)
    return record


@router.post("/responses")
async def create_response(body: ResponseCreateBody, request: Request) -> Response:
    state = _state(request)
    refuse_unimplemented(body.model_extra)
    tenant = getattr(request.state, "tenant", None)
    adapter = state.adapter_for(body.model, tenant)     # a served name, an adapter, else 404
    store_it = body.store is not False
    if body.background and not store_it:
        raise bad_request("background responses must be stored: send store true (or leave it out).",
                          "background")
    owner = _owner(request)
    conversation = _previous(state.responses, body.previous_response_id, owner) + input_messages(body)
    chat_request = chat_body(body, conversation)
    chat = read_chat(chat_request, state.tokenizer)
    prompt_ids = await state.tokenize(chat_prompt_ids, chat.messages, chat.template_tools, tenant=tenant,
                                      param="input")
    fields = constrain_tool_call(chat_fields(chat_request, turn_stop_token_ids(state.tokenizer)), chat)
    spec = with_adapter(build_spec(fields, prompt_ids, await state.limits(), state.caller(tenant)), adapter)
    builder = _builder(body, adapter.name if adapter is not None else state.settings.model_id)
    record = ResponseRecord(owner, builder, conversation, bool(body.background), store_it)
    if record.background:
        spec = dataclasses.replace(spec, detached=True,
                                   attachment=_attachment(record, chat_request.model_dump(exclude_none=True)))
    try:
        state.responses.add(record)
    except TooManyResponses as error:
        raise overloaded(str(error), 60, "too_many_responses") from None
    request_id = getattr(request.state, "request_id", "") or record.response_id
    supplied = bool(getattr(request.state, "request_id_supplied", False))
    scheduler_id = record.response_id if record.background else scheduler_request_id(request_id, 0, supplied)
    _run(state, record, chat, spec, scheduler_id, request_id)
    return await _answer(request, state.responses, record, bool(body.stream))


def _run(state: GatewayState, record: ResponseRecord, chat: ChatRequest, spec: GenerationSpec,
         scheduler_id: str, trace_id: str) -> None:
    """Starts filling `record` from the generation of `spec` (or, attach: its replay)."""
    deltas = merge_streams([state.service.stream(spec, scheduler_id, trace_id)])
    reader = call_reader(chat, state.settings.tool_call_parser, stream=True)
    start(record, state.responses, reader(deltas, 1) if reader is not None else deltas, state.response_tasks)


def _attachment(record: ResponseRecord, chat_request: dict[str, Any]) -> bytes:
    """What another gateway needs to rebuild the response from its tokens."""
    builder = record.builder
    return json.dumps({"owner": record.owner, "id": builder.response_id, "created_at": builder.created_at,
                       "model": builder.model, "echo": builder.echo, "conversation": record.conversation,
                       "store": record.store, "chat": chat_request}).encode()


async def _adopt(request: Request, response_id: str) -> ResponseRecord | None:
    """A background response this gateway does not hold, read again from the scheduler."""
    state, owner = _state(request), _owner(request)
    spec = await state.backend.detached(response_id, owner)
    if spec is None:
        return None
    saved = json.loads(spec.attachment)
    if saved.get("owner") != owner or saved.get("id") != response_id:
        return None
    builder = ResponseBuilder(response_id, saved["created_at"], saved["model"], saved["echo"])
    record = ResponseRecord(owner, builder, saved["conversation"], True, saved["store"])
    try:
        state.responses.add(record)
    except TooManyResponses as error:
        raise overloaded(str(error), 60, "too_many_responses") from None
    chat = read_chat(ChatCompletionBody.model_validate(saved["chat"]), state.tokenizer)
    _run(state, record, chat, spec, response_id, response_id)
    return record


async def _answer(request: Request, store: ResponseStore, record: ResponseRecord, stream: bool) -> Response:
    if record.background and not stream:
        return JSONResponse(record.builder.snapshot())
    try:
        if not record.background:
            await until_disconnected(request, _settled(record))   # a refusal is the HTTP status
            if record.failure is not None:
                store.remove(record.response_id)
                raise from_backend(record.failure)
        if stream:
            return event_stream(_sse(record, -1, cancel_on_close=not record.background))
        await until_disconnected(request, _ended(record))
    except BaseException:
        if not record.background and record.task is not None and not record.task.done():
            record.task.cancel()          # the client of a foreground response left
        raise
    return JSONResponse(record.builder.snapshot())


async def _settled(record: ResponseRecord) -> None:
    """Until the response has output or has ended."""
    async for _ in record.follow():
        if record.builder.output or record.done:
            return


async def _ended(record: ResponseRecord) -> None:
    async for _ in record.follow():
        pass


async def _sse(record: ResponseRecord, after: int, cancel_on_close: bool = False) -> AsyncIterator[bytes]:
    try:
        async for event in record.follow(after):
            yield f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()
    finally:
        if cancel_on_close and not record.done and record.task is not None:
            record.task.cancel()    # the client of a foreground response left


def _previous(store: ResponseStore, response_id: str | None, owner: str) -> list[dict[str, Any]]:
    """The conversation a response continues: the previous one's messages and output."""
    if not response_id:
        return []
    record = store.get(response_id, owner)
    if record is None:
        raise ApiError(404, f"No response with id {response_id!r} found.", "invalid_request_error",
                       "previous_response_id", "not_found")
    if not record.done or record.builder.status not in ("completed", "incomplete"):
        raise bad_request(f"Response {response_id!r} is {record.builder.status}; only a finished response "
                          "can be continued.", "previous_response_id")
    return [*record.conversation, *conversation_of(record.builder.output)]


def _builder(body: ResponseCreateBody, model: str) -> ResponseBuilder:
    echo = {"instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature if body.temperature is not None else 1.0,
            "top_p": body.top_p if body.top_p is not None else 1.0,
            "tools": body.tools or [], "tool_choice": body.tool_choice or "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "text": body.text or {"format": {"type": "text"}},
            "previous_response_id": body.previous_response_id, "metadata": body.metadata or {},
            "background": bool(body.background), "store": body.store is not False, "user": body.user,
            "truncation": "disabled", "reasoning": None}
    return ResponseBuilder(f"resp_{secrets.token_hex(16)}", int(time.time()), model, echo)


@router.get("/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request, stream: bool = False,
                            starting_after: int = -1) -> Response:
    record = await _record(request, response_id)
    if stream:
        return event_stream(_sse(record, starting_after))
    return JSONResponse(record.builder.snapshot())


@router.post("/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request) -> Response:
    record = await _record(request, response_id)
    if not record.background:
        raise bad_request("Only a background response can be cancelled.", "response_id")
    await _stop(_state(request), record)
    return JSONResponse(record.builder.snapshot())


@router.delete("/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> Response:
    record = await _record(request, response_id)
    await _stop(_state(request), record)
    _state(request).responses.remove(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


async def _stop(state: GatewayState, record: ResponseRecord) -> None:
    """Cancels the generation of a response in progress and waits for it to end; a
    background one's detached request too (leaving its stream does not)."""
    task = record.task
    if task is not None and not task.done():
        task.cancel()
        await asyncio.wait({task})
        if record.background:
            await state.backend.cancel(record.response_id)
