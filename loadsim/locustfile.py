"""Locust users for a gateway's OpenAI streaming API, built from the load
simulator's workload: `locust -f loadsim/locustfile.py --host http://127.0.0.1:8000`.

This module owns the Locust side only. What users send (weighted prompt kinds,
per-user seeded choices, think times) comes from `loadsim.workload` and
`loadsim.users`, conversations from `loadsim.sessions`, and reading a stream
from `loadsim.sse_timing`.

Every request reports three kinds of Locust request events, so they land in the
stats table, `--csv` files and `--html` report under the prompt kind's name:
`POST` (end-to-end latency, a failure with the error message for a non-200
answer, an error event in the stream or a cut stream), `TTFT` (time to first
token) and `TPOT` (time per output token after the first). A user that hangs up
on purpose after the first token (a workload's `disconnect_fraction`) reports
`HANGUP` instead of `POST` and `TPOT`.

Locust finds User classes when it imports this file, so one class per user class
of the built-in workload (`interactive`, `batch`) is made here, with its weight.
Nothing else happens at import: the options below (also read from the
environment as `LOCUST_<OPTION>`, Locust's convention, or from locust.conf) are
read when a user starts.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import requests
from locust import User, events, task
from locust.exception import StopUser

from loadsim.sessions import ChatSession
from loadsim.sse_timing import StreamTiming, read_stream
from loadsim.transport import error_message
from loadsim.users import PlannedRequest, SimulatedUser
from loadsim.workload import DEFAULT_WORKLOAD, UserClass, Workload, load_workload

DEFAULT_HOST = "http://127.0.0.1:8000"
_user_indexes = itertools.count()


class StreamFailure(Exception):
    """What went wrong with one request; Locust shows the message as the failure."""


@events.init_command_line_parser.add_listener
def add_options(parser: Any) -> None:
    parser.add_argument("--api-key", default="", env_var="LOCUST_API_KEY", is_secret=True,
                        help="bearer key for a gateway started with API_KEYS")
    parser.add_argument("--model", default="", env_var="LOCUST_MODEL",
                        help="model to request (default: the first one /v1/models lists)")
    parser.add_argument("--workload", default="", env_var="LOCUST_WORKLOAD",
                        help="a load simulator workload JSON file whose templates replace the built-in prompt kinds")
    parser.add_argument("--seed", type=int, default=0, env_var="LOCUST_SEED",
                        help="seed of every user's choices (user i draws from seed and i)")
    parser.add_argument("--max-turns", type=int, default=3, env_var="LOCUST_MAX_TURNS",
                        help="a chat conversation lasts 1..N turns, each resending the conversation so far")
    parser.add_argument("--request-timeout", type=float, default=300.0, env_var="LOCUST_REQUEST_TIMEOUT",
                        help="seconds one streamed answer may take")


class RunSettings:
    """The options as users need them, with the model resolved once per run."""

    def __init__(self, options: Any, host: str) -> None:
        self.api_key: str = getattr(options, "api_key", "") or ""
        self.seed: int = getattr(options, "seed", 0)
        self.max_turns: int = getattr(options, "max_turns", 3)
        self.timeout_s: float = getattr(options, "request_timeout", 300.0)
        path = getattr(options, "workload", "")
        self.templates: Workload = load_workload(path) if path else DEFAULT_WORKLOAD
        self.model: str = getattr(options, "model", "") or first_model(host, self.headers())

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def first_model(host: str, headers: dict[str, str]) -> str:
    response = requests.get(host.rstrip("/") + "/v1/models", headers=headers, timeout=10)
    if response.status_code != 200:
        raise StreamFailure(f"GET /v1/models: HTTP {response.status_code}: {error_message(response.content)}")
    models = response.json().get("data") or []
    if not models:
        raise StreamFailure("GET /v1/models: the gateway lists no models")
    return str(models[0]["id"])


def run_settings(environment: Any, host: str) -> RunSettings:
    """One RunSettings per Locust environment, made by the first user that starts."""
    settings = getattr(environment, "fairserve_settings", None)
    if settings is None:
        settings = RunSettings(environment.parsed_options, host)
        environment.fairserve_settings = settings
    return settings


class FairserveUser(User):
    """One simulated person: conversations of streamed requests, thinking between them."""

    abstract = True
    host = DEFAULT_HOST
    user_class: UserClass

    def on_start(self) -> None:
        try:
            self.settings = run_settings(self.environment, self.host)
        except (StreamFailure, requests.RequestException, OSError, ValueError) as error:
            self.report("GET", "/v1/models", 0.0, error=error)
            raise StopUser() from error
        workload = Workload(self.settings.templates.templates, (self.user_class,))
        user = SimulatedUser(next(_user_indexes), self.user_class, workload, self.settings.seed,
                             self.settings.model)
        self.session = ChatSession(user, self.settings.max_turns)
        self.http = requests.Session()

    def on_stop(self) -> None:
        http = getattr(self, "http", None)
        if http is not None:
            http.close()

    def wait_time(self) -> float:
        return self.session.user.think_time()

    @task
    def converse(self) -> None:
        request = self.session.next_request()
        timing = self.stream(request)
        self.session.answered(timing.text if timing is not None and not timing.error and not timing.hung_up
                              else None)

    def stream(self, request: PlannedRequest) -> StreamTiming | None:
        """Sends `request`, reads its stream and reports it; None when no stream came."""
        sent = time.perf_counter()
        try:
            with self.http.post(self.host.rstrip("/") + request.path, json=request.body,
                                headers=self.settings.headers(), stream=True,
                                timeout=(10.0, self.settings.timeout_s)) as response:
                if response.status_code != 200:
                    message = f"HTTP {response.status_code}: {error_message(response.content)}"
                    self.report("POST", request.template, _ms(time.perf_counter() - sent), error=message)
                    return None
                timing = read_stream(response.iter_lines(chunk_size=None), sent,
                                     hang_up_after_first_token=request.disconnect_after_first_token)
        except requests.RequestException as error:
            self.report("POST", request.template, _ms(time.perf_counter() - sent),
                        error=f"{type(error).__name__}: {error}")
            return None
        self.report_timing(request.template, timing)
        return timing

    def report_timing(self, name: str, timing: StreamTiming) -> None:
        if timing.ttft_s is not None:
            self.report("TTFT", name, _ms(timing.ttft_s))
        if timing.hung_up:
            self.report("HANGUP", name, _ms(timing.latency_s))
            return
        self.report("POST", name, _ms(timing.latency_s), length=timing.completion_tokens, error=timing.error)
        if timing.tpot_s is not None:
            self.report("TPOT", name, _ms(timing.tpot_s))

    def report(self, request_type: str, name: str, response_time_ms: float, length: int = 0,
               error: BaseException | str = "") -> None:
        exception = StreamFailure(error) if isinstance(error, str) and error else (error or None)
        self.environment.events.request.fire(
            request_type=request_type, name=name, response_time=response_time_ms, response_length=length,
            exception=exception, context={"user": self.session.user.name if hasattr(self, "session") else ""})


def _ms(seconds: float) -> float:
    return seconds * 1000.0


def _locust_user_classes(workload: Workload) -> dict[str, type[FairserveUser]]:
    """A Locust User class per workload user class, weighted like it (Locust needs integers)."""
    classes = {}
    for user_class in workload.user_classes:
        name = "".join(part.title() for part in user_class.name.replace("_", "-").split("-")) + "User"
        classes[name] = type(name, (FairserveUser,), {
            "__module__": __name__, "__doc__": f"Users of the workload's `{user_class.name}` class.",
            "weight": max(1, round(user_class.weight)), "user_class": user_class})
    return classes


globals().update(_locust_user_classes(DEFAULT_WORKLOAD))
