"""Worker process: loads the model, serves Step/Info/Stats, registers with
the scheduler and publishes KV block events to the index."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from fairserve.v1 import worker_pb2, worker_pb2_grpc
from prometheus_client import CollectorRegistry

from common.grpc_server import GrpcServer, insecure_channel
from common.logs import configure_logging
from common.metrics import serve_metrics
from common.model_store import resolve_model_dir
from common.shutdown import on_stop_signal
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.kvcache.client import KvIndexClient
from services.kvcache.publisher import KvEventPublisher
from services.worker.kv_events import add_events, snapshot_source
from services.worker.server import WorkerMetrics, WorkerService, keep_registered
from services.worker.settings import WorkerSettings

log = logging.getLogger("worker")


def engine_config(settings: WorkerSettings, model_dir: Path) -> EngineConfig:
    return EngineConfig(
        model_dir=str(model_dir), device=settings.device, dtype=settings.dtype,
        block_size=settings.block_size, num_blocks=settings.num_blocks,
        kv_memory_fraction=settings.kv_memory_fraction,
        enable_prefix_caching=settings.enable_prefix_caching, eviction_policy=settings.eviction_policy,
        prompt_logits_cache_size=settings.prompt_logits_cache_size,
        max_model_len=settings.max_model_len, model_key=settings.model_key,
        torch_threads=settings.torch_threads, use_cuda_graphs=settings.use_cuda_graphs,
        cuda_graph_max_batch=settings.cuda_graph_max_batch, cuda_graph_max_context=settings.cuda_graph_max_context,
        attention_backend=settings.attention_backend, decode_attention=settings.decode_attention,
        cpu_linear_kernel=settings.cpu_linear_kernel, cpu_native_kernels=settings.cpu_native_kernels,
        direct_forward=settings.direct_forward,
        cpu_weight_codes=settings.cpu_weight_codes,
        lm_head_screen=settings.lm_head_screen, lm_head_screen_max_rows=settings.lm_head_screen_max_rows,
        ngram_min=settings.speculative_ngram_min, ngram_max=settings.speculative_ngram_max,
    )


async def serve(settings: WorkerSettings) -> None:
    model_dir = resolve_model_dir(settings.model_name, Path(settings.model_cache_dir))
    engine = Engine(engine_config(settings, model_dir))
    engine_labels = {"device": engine.info.device, "dtype": engine.info.dtype,
                     "linear_kernel": engine.linear_kernel.kernel if engine.linear_kernel is not None else "none",
                     "prefill_attention": engine.attention_kernel, "decode_attention": engine.decode_attention}
    log.info("engine ready", extra={"model_dir": str(model_dir), "num_blocks": engine.info.num_blocks,
                                    "decode_graphs": engine.graphs is not None, "native_linears": engine.native_linears,
                                    "coded_linears": engine.coded_linears,
                                    "prefill_linear_kernel": engine.prefill_linear_kernel,
                                    "fused_mlps": engine.fused_mlps, "forward": engine.direct_forward,
                                    **engine_labels})
    registry = CollectorRegistry()
    metrics_port = serve_metrics(settings.metrics_port, registry, host=settings.host)
    kv_client = KvIndexClient.connect(settings.kvcache_addr)
    service = WorkerService(engine, settings.worker_id, WorkerMetrics(registry, settings.worker_id,
                                                                     engine.pool_stats(), engine_labels))
    publisher = KvEventPublisher(settings.worker_id, kv_client.publish,
                                 snapshot_source(service.snapshot_async))
    service.on_block_events = lambda events: add_events(publisher, events)
    service.kv_events_unacknowledged = lambda: publisher.unacknowledged
    server = GrpcServer([(worker_pb2_grpc.add_WorkerServicer_to_server, service)],
                        [worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name],
                        settings.host, settings.port)
    await server.start()
    await server.set_serving(True)
    address = f"{settings.advertise_host}:{server.port}"
    log.info("worker serving", extra={"address": address, "metrics_port": metrics_port})

    stop = asyncio.Event()
    on_stop_signal(stop.set)
    scheduler_channel = insecure_channel(settings.scheduler_addr)
    tasks = [
        asyncio.create_task(keep_registered(scheduler_channel, settings.worker_id, address, service,
                                            settings.heartbeat_interval_s, stop)),
        asyncio.create_task(publisher.run(settings.kv_publish_interval_s, stop)),
    ]
    await stop.wait()
    log.info("worker stopping")
    await server.stop()
    await asyncio.gather(*tasks, return_exceptions=True)
    service.shutdown()
    await scheduler_channel.close()
    await kv_client.close()


def main() -> None:
    settings = WorkerSettings.from_env(os.environ)
    configure_logging("worker", settings.log_level)
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
