"""A bounded schemathesis pass over the gateway's own OpenAPI schema,
in process against the ASGI app with the fake scheduler, without and with
API keys: valid and invalid bodies alike never produce a 5xx, and every
error has the one shape."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings
from services.gateway.tenancy.tenant_config import load_tenants
from tests.fixtures.tiny_model import build_tokenizer
from tests.unit.gateway.fakes import EOS_ID, FakeScheduler

ERROR_FIELDS = {"message", "type", "param", "code"}
API_KEY = "sk-schema-key"


def _app(api_keys: str = "") -> object:
    tokenizer = build_tokenizer()
    reply = [*tokenizer.encode("Paris is nice.", add_special_tokens=False), EOS_ID]
    settings = GatewaySettings(max_model_len=256, tenants=load_tenants(api_keys))
    return create_app(settings, FakeScheduler(reply_ids=reply), tokenizer)


schema = schemathesis.openapi.from_asgi("/openapi.json", _app())
keyed_schema = schemathesis.openapi.from_asgi("/openapi.json", _app(f"tenant={API_KEY}"))


def _check(case: schemathesis.Case, headers: dict[str, str] | None = None) -> None:
    response = case.call(headers=headers)
    case.validate_response(response, checks=[not_a_server_error])
    if response.status_code >= 400:
        assert set(response.json()["error"]) == ERROR_FIELDS, response.text


@schema.parametrize()
@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_server_errors(case: schemathesis.Case) -> None:
    _check(case)


@keyed_schema.parametrize()
@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_server_errors_with_api_keys(case: schemathesis.Case) -> None:
    _check(case, {"Authorization": f"Bearer {API_KEY}"})
