"""Long context under a lossy KV policy: a prompt longer than the model's
context is refused under the exact `full` policy, and served under `sink`
(StreamingLLM: the first KV_SINK_TOKENS plus the most recent tokens, within
KV_BUDGET_TOKENS), the prompt streaming through the budget chunk by chunk.
`window` keeps only the most recent tokens; docs/engine.md, "Lossy KV
policies", says what each keeps and what it costs.

    python examples/long_context.py
    FAIRSERVE_URL=http://other-host:8000 FAIRSERVE_API_KEY=sk-... python examples/long_context.py

FAIRSERVE_URL defaults to http://127.0.0.1:8000; FAIRSERVE_API_KEY is needed
only when the server has API_KEYS; FAIRSERVE_PROMPT_TOKENS sets the prompt's
length (default: the model's context plus 256 tokens; on a CPU and a model with
a long context, a prompt that long takes minutes: set it lower to just see the calls).
"""

import os
import sys

import httpx

base_url = os.environ.get("FAIRSERVE_URL", "http://127.0.0.1:8000").rstrip("/")
key = os.environ.get("FAIRSERVE_API_KEY")
client = httpx.Client(base_url=base_url, timeout=1800,
                      headers={"Authorization": f"Bearer {key}"} if key else {})
model = client.get("/v1/models").raise_for_status().json()["data"][0]["id"]

PARAGRAPH = ("The harbour master kept a log of every boat that came in: its name, its cargo, "
             "the weather at sea and the hour of its arrival. ")
measured = client.post("/tokenize", json={"model": model, "prompt": PARAGRAPH,
                                          "add_special_tokens": False}).raise_for_status().json()
context = measured["max_model_len"]
target = int(os.environ.get("FAIRSERVE_PROMPT_TOKENS") or context + 256)
prompt = PARAGRAPH * (target // measured["count"] + 1) + "\nThe last boat to arrive was"
length = client.post("/tokenize", json={"model": model, "prompt": prompt}).raise_for_status().json()["count"]
print(f"model context: {context} tokens; prompt: {length} tokens")

body = {"model": model, "prompt": prompt, "max_tokens": 32, "temperature": 0}
full = client.post("/v1/completions", json={**body, "kv_policy": "full"})
if full.status_code == 400:
    print(f"kv_policy=full: 400 {full.json()['error']['message']}")
else:
    print(f"kv_policy=full: {full.status_code} (the prompt fits the context)")

sink = client.post("/v1/completions", json={**body, "kv_policy": "sink"})
if sink.status_code != 200:
    sys.exit(f"kv_policy=sink: {sink.status_code} {sink.text}")
reply = sink.json()
usage = reply["usage"]
print(f"kv_policy=sink: 200 finish_reason={reply['choices'][0]['finish_reason']} "
      f"prompt_tokens={usage['prompt_tokens']} completion_tokens={usage['completion_tokens']}")
print("text:", reply["choices"][0]["text"])
