"""LoRA requests at the scheduler: their cache salt always carries the adapter (whatever salt
the gateway sent), the adapter reaches the worker's sequence, and routing prefers a worker
that served the adapter lately, after the cached prefix."""

from __future__ import annotations

from fairserve.v1 import scheduler_pb2

from common.block_hash import adapter_id, adapter_salt
from common.step_convert import step_batch_from_proto, step_batch_to_proto
from common.step import NewSequence, StepBatch
from services.scheduler.convert import request_spec_from_proto
from services.scheduler.core.routing import SessionMap, route

from tests.unit.scheduler.plain_state import make_worker


def test_the_salt_carries_the_adapter_even_when_the_gateway_did_not_fold_it() -> None:
    base = request_spec_from_proto(scheduler_pb2.GenerateRequest(request_id="b", cache_salt="alice"))
    lora = request_spec_from_proto(scheduler_pb2.GenerateRequest(request_id="a", cache_salt="alice",
                                                                  lora_name="qv", lora_digest="abc"))
    folded = request_spec_from_proto(scheduler_pb2.GenerateRequest(
        request_id="f", cache_salt=adapter_salt("alice", adapter_id("qv", "abc")), lora_name="qv",
        lora_digest="abc"))
    other = request_spec_from_proto(scheduler_pb2.GenerateRequest(request_id="o", cache_salt="alice",
                                                                  lora_name="qv", lora_digest="def"))
    assert base.cache_salt == "alice"
    assert lora.cache_salt == folded.cache_salt != base.cache_salt
    assert other.cache_salt not in (base.cache_salt, lora.cache_salt)   # new weights, new salt
    assert (lora.lora_name, lora.lora_digest) == ("qv", "abc")


def test_the_adapter_travels_to_the_worker() -> None:
    batch = StepBatch(new_sequences=(NewSequence("s", (1, 2), lora_name="qv", lora_path="qv", lora_digest="ab"),))
    (new,) = step_batch_from_proto(step_batch_to_proto(batch)).new_sequences
    assert (new.lora_name, new.lora_path, new.lora_digest) == ("qv", "qv", "ab")


def test_routing_prefers_the_prefix_then_a_worker_holding_the_adapter_then_the_load() -> None:
    first, second = make_worker("w0"), make_worker("w1")
    sessions = SessionMap()
    assert route((1, 2), "", [first, second], sessions, {}, 0, adapter="qv") is first
    assert "qv" in first.adapters
    first.reserved_kv_tokens = 100     # busier, but it holds the adapter
    assert route((1, 2), "", [first, second], sessions, {}, 0, adapter="qv") is first
    assert route((1, 2), "", [first, second], sessions, {}, 0) is second          # the base: the load
    assert route((1, 2), "", [first, second], sessions, {"w1": 8}, 0, adapter="qv") is second


def test_fairness_charges_adapter_tokens_like_any_other() -> None:
    from services.scheduler.core.types import CoreConfig, Policy

    from tests.unit.scheduler.fake_worker import FakeEngine
    from tests.unit.scheduler.harness import Harness

    h = Harness(CoreConfig(policy=Policy.VTC, max_batch_size=4), FakeEngine(num_blocks=256))
    h.submit(tuple(range(16)), max_tokens=4, client_id="base")
    h.submit(tuple(range(100, 116)), max_tokens=4, client_id="lora", lora_name="qv", lora_digest="ab")
    for _ in range(10):
        h.step()
    counters = {c.client_id: (c.counter, c.served_tokens) for c in h.core._vtc.snapshot()}  # test-only peek
    assert counters["base"] == counters["lora"] and counters["lora"][1] > 0
