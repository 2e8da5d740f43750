"""Structured output: a chat reply held to a JSON schema (OpenAI's
`response_format`), and a completion held to a regular expression (vLLM's
`guided_regex`). The constraint holds whatever the model: every reply parses.

    python examples/structured_output.py
    FAIRSERVE_URL=http://other-host:8000 FAIRSERVE_API_KEY=sk-... python examples/structured_output.py

FAIRSERVE_URL defaults to http://127.0.0.1:8000; FAIRSERVE_API_KEY is needed
only when the server has API_KEYS. Prints the JSON object, then the regex match.
"""

import json
import os
import re

from openai import OpenAI

client = OpenAI(base_url=os.environ.get("FAIRSERVE_URL", "http://127.0.0.1:8000").rstrip("/") + "/v1",
                api_key=os.environ.get("FAIRSERVE_API_KEY") or "unused")
model = client.models.list().data[0].id   # the served model's name

# Bounded strings and numbers keep even a small model's reply short.
CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
        "population_thousands": {"type": "integer", "minimum": 0, "maximum": 40000},
        "coastal": {"type": "boolean"},
    },
    "required": ["name", "country", "population_thousands", "coastal"],
    "additionalProperties": False,
}

reply = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Describe Lisbon as JSON."}],
    response_format={"type": "json_schema",
                     "json_schema": {"name": "city", "schema": CITY, "strict": True}},
    max_tokens=200,
    temperature=0,
)
city = json.loads(reply.choices[0].message.content)   # never raises: decoding followed the schema
print("json_schema:", json.dumps(city))

DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
completion = client.completions.create(
    model=model,
    prompt="The first day of spring in 2031 is on",
    max_tokens=16,
    temperature=0,
    extra_body={"guided_regex": DATE},   # vLLM's extra field; guided_choice and guided_grammar too
)
date = completion.choices[0].text
assert re.fullmatch(DATE, date), date
print("guided_regex:", date)
