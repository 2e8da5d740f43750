"""Two tenants on one server: each key is its tenant's identity, each tenant
sees only its own usage in /stats, and a tenant over its quota gets a 429
(with Retry-After) while the other is served as before. docs/security.md
says what separates tenants.

    python examples/tenants.py

needs a server with two keys and a small token budget for the second tenant:

    echo '{"tenants": {"bob": {"tokens_per_minute": 200}}}' > tenants.json
    API_KEYS=alice=sk-alice,bob=sk-bob TENANTS_FILE=tenants.json make run
    FAIRSERVE_API_KEY=sk-alice FAIRSERVE_OTHER_API_KEY=sk-bob python examples/tenants.py

FAIRSERVE_URL defaults to http://127.0.0.1:8000. FAIRSERVE_API_KEY is the first
tenant's key, FAIRSERVE_OTHER_API_KEY the second's (the one with the budget):
the example spends that budget (at most 40 short requests) until it is refused.
"""

import os
import sys

import httpx

base_url = os.environ.get("FAIRSERVE_URL", "http://127.0.0.1:8000").rstrip("/")
keys = {"first": os.environ.get("FAIRSERVE_API_KEY"), "second": os.environ.get("FAIRSERVE_OTHER_API_KEY")}
if not all(keys.values()):
    sys.exit("set FAIRSERVE_API_KEY and FAIRSERVE_OTHER_API_KEY to two tenants' keys (see this file's docstring)")
clients = {name: httpx.Client(base_url=base_url, timeout=120, headers={"Authorization": f"Bearer {key}"})
           for name, key in keys.items()}
model = clients["first"].get("/v1/models").raise_for_status().json()["data"][0]["id"]
BODY = {"model": model, "prompt": "Name three harbour towns.", "max_tokens": 16, "ignore_eos": True}

print("no key:", httpx.post(f"{base_url}/v1/completions", json=BODY, timeout=120).status_code)   # 401

for name, client in clients.items():
    client.post("/v1/completions", json=BODY).raise_for_status()
    stats = client.get("/stats").raise_for_status().json()
    # A tenant's /stats holds its own counters and fairness entry only, never another's.
    totals = stats["gateway"]["totals"]
    seen = [entry["client_id"] for entry in stats["scheduler"]["clients"]]
    print(f"{name} tenant: requests={totals['requests']} input_tokens={totals['input_tokens']} "
          f"output_tokens={totals['output_tokens']} tenants in its /stats={seen}")

for attempt in range(1, 41):
    reply = clients["second"].post("/v1/completions", json=BODY)
    if reply.status_code == 429:
        error = reply.json()["error"]
        print(f"second tenant, request {attempt}: 429 {error['code']}: {error['message']} "
              f"(Retry-After: {reply.headers.get('retry-after')} s)")
        break
    reply.raise_for_status()
else:
    sys.exit("the second tenant was never refused: give it a small tokens_per_minute in TENANTS_FILE")

after = clients["first"].post("/v1/completions", json=BODY)
print(f"first tenant meanwhile: {after.status_code}")   # 200: one tenant's quota is its own
