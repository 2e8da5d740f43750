"""The gateway's public gRPC API (fairserve.v1.TextGeneration, in
proto/fairserve/v1/gateway.proto): one call for a whole reply, one streamed
token by token. Same parameters, validation, API keys and quotas as HTTP.

    python examples/grpc_client.py
    FAIRSERVE_GRPC_ADDR=other-host:50050 FAIRSERVE_API_KEY=sk-... python examples/grpc_client.py

FAIRSERVE_GRPC_ADDR defaults to 127.0.0.1:50050 (the gateway's GATEWAY_GRPC_PORT);
FAIRSERVE_API_KEY is needed only when the server has API_KEYS. The stubs are
fairserve's generated modules (`fairserve.v1`, from `make proto` or the installed
package); other languages generate theirs from proto/ with protoc. Errors come
as gRPC status codes: INVALID_ARGUMENT (a bad field, named in the details),
UNAUTHENTICATED, RESOURCE_EXHAUSTED (a quota) and UNAVAILABLE (draining or no worker).
"""

import os
import sys

import grpc
from fairserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

address = os.environ.get("FAIRSERVE_GRPC_ADDR", "127.0.0.1:50050")
key = os.environ.get("FAIRSERVE_API_KEY")
metadata = [("authorization", f"Bearer {key}")] if key else []

request = gateway_pb2.TextRequest(
    prompt="Write one sentence about the sea.",   # raw=False: sent as one user turn of the chat template
    max_tokens=32,
    sampling=common_pb2.SamplingParams(temperature=0.7, top_p=0.95, seed=7),
    stop=["\n\n"],
)

with grpc.insecure_channel(address) as channel:   # grpc.secure_channel(...) behind TLS
    stub = gateway_pb2_grpc.TextGenerationStub(channel)
    try:
        reply = stub.Generate(request, metadata=metadata, timeout=120)
        print(f"Generate: {reply.text!r}")
        print(f"  finish_reason={reply.finish_reason} prompt_tokens={reply.usage.prompt_tokens} "
              f"completion_tokens={reply.usage.completion_tokens}")

        pieces = 0
        print("GenerateStream: ", end="", flush=True)
        for chunk in stub.GenerateStream(request, metadata=metadata, timeout=120):
            print(chunk.text, end="", flush=True)
            pieces += 1
            if chunk.finish_reason:
                print(f"\n  finish_reason={chunk.finish_reason} chunks={pieces} "
                      f"completion_tokens={chunk.usage.completion_tokens}")
    except grpc.RpcError as error:
        sys.exit(f"gRPC error {error.code().name}: {error.details()}")
