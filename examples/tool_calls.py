"""Tool calls on /v1/chat/completions, as the openai client makes them: the
model is offered a tool, its call comes back parsed (`message.tool_calls`), the
tool's result goes back as a `tool` message and the model answers with it.

    python examples/tool_calls.py
    FAIRSERVE_URL=http://other-host:8000 FAIRSERVE_API_KEY=sk-... python examples/tool_calls.py

FAIRSERVE_URL defaults to http://127.0.0.1:8000; FAIRSERVE_API_KEY is needed
only when the server has API_KEYS. `tool_choice` naming the tool (or
"required") constrains decoding to a call whose arguments follow the tool's
`parameters`; "auto" (the default) lets the model choose, and its text is read
for calls in the Hermes `<tool_call>` format.
"""

import json
import os

from openai import OpenAI

client = OpenAI(base_url=os.environ.get("FAIRSERVE_URL", "http://127.0.0.1:8000").rstrip("/") + "/v1",
                api_key=os.environ.get("FAIRSERVE_API_KEY") or "unused")
model = client.models.list().data[0].id   # the served model's name

WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 32},
                       "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}}


def get_weather(city: str, unit: str) -> str:
    """The tool itself: here a stand-in for a real weather service."""
    return f"18 degrees {unit} and sunny in {city}"


messages = [{"role": "user", "content": "What is the weather in Lisbon, in celsius?"}]
reply = client.chat.completions.create(
    model=model, messages=messages, tools=[WEATHER],
    tool_choice={"type": "function", "function": {"name": "get_weather"}},   # or "auto", "required"
    max_tokens=120, temperature=0)
message = reply.choices[0].message
print("finish_reason:", reply.choices[0].finish_reason)   # "tool_calls"
call = message.tool_calls[0]
arguments = json.loads(call.function.arguments)           # a JSON object, as the schema asks
print(f"tool call: {call.function.name}({json.dumps(arguments)}) id={call.id}")

result = get_weather(**arguments)
messages += [{"role": "assistant", "content": message.content, "tool_calls": [call.model_dump()]},
             {"role": "tool", "tool_call_id": call.id, "content": result}]
answer = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER],
                                        max_tokens=64, temperature=0)
print("tool result:", result)
print("answer:", answer.choices[0].message.content)
