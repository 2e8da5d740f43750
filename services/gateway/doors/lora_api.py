"""Runtime LoRA updates, vLLM's endpoints: POST /v1/load_lora_adapter {lora_name, lora_path} and
POST /v1/unload_lora_adapter {lora_name}.

Off unless LORA_RUNTIME_UPDATES=true (then a 404, as an unknown route). With API keys only an
operator tenant (ADMIN_KEYS, or `admin: true`) may call them: any other key is a 403. The path
must name an adapter directory inside LORA_ROOT, symlinks resolved (common/lora_paths.py), so
no call can make the server read a file elsewhere; errors name the field, never a resolved
path. An unloaded adapter is a 404 to new requests at once; running ones finish.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from common.model_files.lora_paths import AdapterPathError
from common.model_files.peft_config import AdapterError
from services.gateway.errors import NOT_FOUND, ApiError, bad_request, not_found
from services.gateway.state import GatewayState

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1")


class LoadLoraBody(BaseModel):
    lora_name: str = Field(max_length=128)
    lora_path: str = Field(max_length=4096)


class UnloadLoraBody(BaseModel):
    lora_name: str = Field(max_length=128)


def _operator_state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    if not state.settings.lora_runtime_updates:
        raise not_found(request.url.path)
    tenant = getattr(request.state, "tenant", None)
    if state.settings.tenants.enabled and (tenant is None or not tenant.admin):
        raise ApiError(403, "Loading and unloading LoRA adapters needs an operator key (ADMIN_KEYS).",
                       "permission_error", None, "forbidden")
    return state


@router.post("/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraBody, request: Request) -> JSONResponse:
    state = _operator_state(request)
    try:
        entry = state.loras.load(body.lora_name, body.lora_path)
    except AdapterPathError as error:
        raise bad_request(str(error), "lora_path" if str(error).startswith("lora_path") else "lora_name") from None
    except AdapterError as error:
        raise bad_request(f"lora_path: {error}", "lora_path") from None
    log.info("LoRA adapter loaded", extra={"adapter": entry.name})
    return JSONResponse({"message": f"Success: LoRA adapter '{entry.name}' added successfully."})


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraBody, request: Request) -> JSONResponse:
    state = _operator_state(request)
    if not state.loras.unload(body.lora_name):
        raise ApiError(404, f"The LoRA adapter `{body.lora_name[:200]}` is not loaded.", NOT_FOUND, "lora_name",
                       "model_not_found")
    log.info("LoRA adapter unloaded", extra={"adapter": body.lora_name})
    return JSONResponse({"message": f"Success: LoRA adapter '{body.lora_name}' removed successfully."})
