"""The live dashboard in real headless Chromium (Debian's /usr/bin/chromium,
driven by Playwright).

First against the real stack (four processes on a tiny model) while
concurrent streams run: the gateway serves dashboard/ at /dashboard and its
/stats. Then against a stand-in HTTP server whose /stats (schema:
docs/metrics.md) changes on every call and can drop parts, as when a
service is down.

Set DASHBOARD_SCREENSHOT_DIR to keep the screenshots somewhere known.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from services.gateway.observability.latency_tracker import LatencyTracker, RequestRecord
from fairserve.launcher.stack import Stack

playwright_api = pytest.importorskip("playwright.sync_api")

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
DASHBOARD_DIR = Path(__file__).resolve().parents[2] / "dashboard"
POLL_MS = 200
SPAN_S = 10
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".css": "text/css; charset=utf-8"}

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium")


@dataclass
class StandInStats:
    """A /stats payload that moves on every call: synthetic requests go
    through a real LatencyTracker, counters grow, queues wave."""

    missing: set[str] = field(default_factory=set)
    tick: int = 0
    rng: random.Random = field(default_factory=lambda: random.Random(1))
    clock_s: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.tracker = LatencyTracker(window_s=60.0, clock=lambda: self.clock_s)

    def next_payload(self) -> dict:
        with self.lock:
            self.tick += 1
            self.clock_s += 0.5
            self._feed_requests()
            payload = {"ts": time.time(), "gateway": self.tracker.snapshot(),
                       "scheduler": self._scheduler(), "kvcache": self._kvcache()}
            for part in self.missing:
                payload.pop(part, None)
            return payload

    def _feed_requests(self) -> None:
        load = 1.0 + 0.6 * math.sin(self.tick / 4)
        for session, weight in (("alice", 3), ("bob", 2), ("carol", 1)):
            for _ in range(weight):
                ttft = self.rng.lognormvariate(math.log(0.08 * load), 0.5)
                gaps = tuple(self.rng.lognormvariate(math.log(0.02 * load), 0.3)
                             for _ in range(self.rng.randint(8, 40)))
                self.tracker.record(RequestRecord(
                    session_id=session, input_tokens=self.rng.randint(50, 400), output_tokens=len(gaps) + 1,
                    e2e_s=ttft + sum(gaps), ttft_s=ttft, queue_wait_s=ttft * 0.3, inter_token_s=gaps,
                    finish_reason=self.rng.choices(("stop", "length", "cancelled"), (6, 3, 1))[0]))

    def _scheduler(self) -> dict:
        tick = self.tick
        workers = []
        for index in range(2):
            free = 300 + int(150 * math.sin(tick / 5 + index))
            cached = 100 + (tick * 7 + index * 30) % 120
            workers.append({"worker_id": f"worker-{index}", "healthy": True, "running": 4 + (tick + index) % 5,
                            "free_blocks": free, "cached_blocks": cached, "total_blocks": 1024,
                            "last_step_ms": 20 + 10 * math.sin(tick / 3 + index), "last_batch_size": 3 + tick % 6,
                            "steps": tick * 10, "evictions": tick * (2 + index)})
        clients = [{"client_id": name, "counter": tick * rate + offset, "served_tokens": tick * rate * 9}
                   for name, rate, offset in (("alice", 30.0, 0.0), ("bob", 28.0, 5.0), ("carol", 25.0, 9.0))]
        return {"pending": 3 + round(3 * math.sin(tick / 3)), "prefilling": tick % 3, "active": 8 + tick % 5,
                "admitted": tick * 6, "finished": tick * 6 - 8, "preemptions": tick // 4,
                "rejections": {"queue": tick // 6, "never_fit": 1, "timeout": 0},
                "holds": {"active_kv": tick // 3, "cache_pool": tick // 5}, "policy": "vtc",
                "workers": workers, "clients": clients}

    def _kvcache(self) -> dict:
        tick = self.tick
        return {"lookups": tick * 6, "hits": tick * 4, "lookup_tokens": tick * 1200,
                "hit_tokens": tick * 500 + (tick % 4) * 150, "nodes": 40 + tick,
                "blocks_by_worker": {"worker-0": 100 + tick, "worker-1": 90 + tick}, "backend": "memory"}


def make_handler(stats: StandInStats) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            path = self.path.split("?", 1)[0]
            if path == "/stats":
                self._send(HTTPStatus.OK, "application/json", json.dumps(stats.next_payload()).encode())
            elif path == "/dashboard":
                self.send_response(HTTPStatus.TEMPORARY_REDIRECT)
                query = self.path.partition("?")[2]
                self.send_header("Location", "/dashboard/" + (f"?{query}" if query else ""))
                self.end_headers()
            elif path.startswith("/dashboard/"):
                self._send_file(path.removeprefix("/dashboard/") or "index.html")
            else:
                self._send(HTTPStatus.NOT_FOUND, "text/plain", b"not found")

        def _send_file(self, name: str) -> None:
            file = (DASHBOARD_DIR / name).resolve()
            if file.parent != DASHBOARD_DIR or not file.is_file():
                self._send(HTTPStatus.NOT_FOUND, "text/plain", b"not found")
                return
            self._send(HTTPStatus.OK, CONTENT_TYPES.get(file.suffix, "application/octet-stream"),
                       file.read_bytes())

        def _send(self, status: HTTPStatus, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # keep test output quiet
            pass

    return Handler


@pytest.fixture()
def stand_in() -> Iterator[tuple[str, StandInStats]]:
    stats = StandInStats()
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(stats))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", stats
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


class PageProblems:
    """Console errors, uncaught exceptions and failed requests of a page."""

    def __init__(self, page) -> None:
        self.items: list[str] = []
        page.on("console", lambda message: message.type == "error" and self.items.append(message.text))
        page.on("pageerror", lambda error: self.items.append(f"uncaught: {error}"))
        page.on("requestfailed", lambda request: self.items.append(f"request failed: {request.url}"))


def open_dashboard(browser, base_url: str, poll_ms: int = POLL_MS, span_s: int = SPAN_S):
    page = browser.new_page(viewport={"width": 1440, "height": 1280})
    problems = PageProblems(page)
    # A short span, so that a few seconds of polls fill the charts' width.
    page.goto(f"{base_url}/dashboard?interval={poll_ms}&span={span_s}")
    return page, problems


def wait_for_polls(page, count: int, timeout_ms: int = 15000) -> None:
    already = int(page.evaluate("Number(document.body.dataset.polls || 0)"))
    page.wait_for_function(f"Number(document.body.dataset.polls || 0) >= {already + count}",
                           timeout=timeout_ms)


def canvas_images(page) -> dict[str, str]:
    return page.evaluate("""() => Object.fromEntries(
        [...document.querySelectorAll('.card')].map(card =>
            [card.dataset.chart, card.querySelector('canvas').toDataURL()]))""")


def charts_with_data(page) -> set[str]:
    return set(page.evaluate("""() => window.fairserveDashboard.charts
        .filter(({chart}) => chart.bars ? chart.bars.length > 0
            : chart.points.some(p => Object.values(p.values).some(Number.isFinite)))
        .map(({config}) => config.id)"""))


def unavailable_cards(page) -> set[str]:
    return set(page.evaluate(
        "() => [...document.querySelectorAll('.card.unavailable')].map(card => card.dataset.chart)"))


def cards_of(page, part: str) -> set[str]:
    return set(page.evaluate(
        f"() => [...document.querySelectorAll('.card[data-part=\"{part}\"]')].map(card => card.dataset.chart)"))


def keep_screenshot(page, tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    page.screenshot(path=str(path), full_page=True)
    keep_dir = os.environ.get("DASHBOARD_SCREENSHOT_DIR")
    if keep_dir:
        Path(keep_dir).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(keep_dir) / name)
    return path


class StreamLoad:
    """`streams` threads, each posting streaming /generate requests back to
    back until stopped, from a few sessions with a shared prompt prefix."""

    def __init__(self, base_url: str, streams: int, max_tokens: int = 24) -> None:
        self._base_url = base_url
        self._streams = streams
        self._max_tokens = max_tokens
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(streams)
        self.finished = 0
        self.failures: list[str] = []

    def __enter__(self) -> "StreamLoad":
        for index in range(self._streams):
            self._pool.submit(self._run, index)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._pool.shutdown(wait=True)

    def _run(self, index: int) -> None:
        with httpx.Client(base_url=self._base_url, timeout=120) as client:
            round_ = 0
            while not self._stop.is_set():
                round_ += 1
                body = {"prompt": f"A story shared by every stream, part {round_}, told by {index}:",
                        "max_tokens": self._max_tokens, "raw": True, "ignore_eos": True, "stream": True,
                        "session_id": f"session-{index % 4}"}
                try:
                    with client.stream("POST", "/generate", json=body) as response:
                        response.read()
                        if response.status_code != 200:
                            self.failures.append(f"{response.status_code}: {response.text[:200]}")
                except httpx.HTTPError as error:
                    self.failures.append(repr(error))
                self.finished += 1


LIVE_CHARTS = {"ttft", "tpot", "throughput", "queues", "kv_blocks", "hit_rate", "worker_batch",
               "worker_step", "worker_running", "vtc_over_time", "sessions"}


def test_real_stack_under_load_moves_the_charts(browser, tiny_stack: Stack, tmp_path):
    with StreamLoad(tiny_stack.url, streams=16) as load:
        page, problems = open_dashboard(browser, tiny_stack.url, poll_ms=500, span_s=30)
        wait_for_polls(page, 10, timeout_ms=30000)
        before = canvas_images(page)
        wait_for_polls(page, 4, timeout_ms=30000)
        after = canvas_images(page)
        assert load.finished > 0
        with_data = charts_with_data(page)
        screenshot = keep_screenshot(page, tmp_path, "dashboard-live.png")
    assert load.failures == []
    assert LIVE_CHARTS <= with_data, LIVE_CHARTS - with_data
    assert {chart for chart in LIVE_CHARTS if before[chart] == after[chart]} == set()
    assert unavailable_cards(page) == set()
    assert page.locator(".badge.ok").count() == 3
    assert screenshot.stat().st_size > 10_000
    assert problems.items == []
    page.close()


def test_charts_move_and_the_console_stays_clean(browser, stand_in, tmp_path):
    base_url, _stats = stand_in
    page, problems = open_dashboard(browser, base_url)
    wait_for_polls(page, 12)
    before = canvas_images(page)
    wait_for_polls(page, 4)
    after = canvas_images(page)
    assert len(before) >= 12
    assert {chart for chart in before if before[chart] == after[chart]} == set()
    assert charts_with_data(page) == set(before)
    assert unavailable_cards(page) == set()
    assert page.locator(".badge.ok").count() == 3
    screenshot = keep_screenshot(page, tmp_path, "dashboard.png")
    assert screenshot.stat().st_size > 10_000
    assert problems.items == []
    page.close()


def test_missing_parts_show_unavailable_and_come_back(browser, stand_in, tmp_path):
    base_url, stats = stand_in
    page, problems = open_dashboard(browser, base_url)
    wait_for_polls(page, 3)
    stats.missing = {"scheduler", "kvcache"}
    wait_for_polls(page, 3)
    down = cards_of(page, "scheduler") | cards_of(page, "kvcache")
    assert down and unavailable_cards(page) == down
    assert page.locator('.badge.unavailable[data-part="scheduler"]').is_visible()
    assert page.get_by_text("scheduler unavailable").first.is_visible()
    assert page.get_by_text("kvcache unavailable").first.is_visible()
    assert page.locator('.tile.unavailable .value', has_text="unavailable").count() >= 1
    keep_screenshot(page, tmp_path, "dashboard-parts-missing.png")

    stats.missing = {"gateway"}
    wait_for_polls(page, 3)
    assert unavailable_cards(page) == cards_of(page, "gateway")

    stats.missing = set()
    wait_for_polls(page, 3)
    assert unavailable_cards(page) == set()
    assert problems.items == []
    page.close()


def test_an_empty_payload_marks_every_part_unavailable(browser, stand_in):
    base_url, stats = stand_in
    stats.missing = {"gateway", "scheduler", "kvcache"}
    page, problems = open_dashboard(browser, base_url)
    wait_for_polls(page, 3)
    assert unavailable_cards(page) == set(canvas_images(page))
    assert page.locator(".badge.unavailable").count() == 3
    assert problems.items == []
    page.close()
