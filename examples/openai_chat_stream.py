"""Streams a chat completion from fairserve with the official openai client,
exactly as it would from any OpenAI-compatible server.

    python examples/openai_chat_stream.py
    OPENAI_BASE_URL=http://other-host:8000/v1 python examples/openai_chat_stream.py
"""

import os

from openai import OpenAI

client = OpenAI(
    base_url=os.environ.get("OPENAI_BASE_URL", "http://localhost:8000/v1"),
    api_key=os.environ.get("OPENAI_API_KEY", "unused"),  # any value unless API_KEYS is set
)
model = client.models.list().data[0].id

stream = client.chat.completions.create(
    model=model,
    messages=[
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Write one sentence about the sea."},
    ],
    max_tokens=64,
    temperature=0.7,
    stream=True,
    stream_options={"include_usage": True},
)
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
    if chunk.usage is not None:
        print(f"\n[{chunk.usage.prompt_tokens} prompt + "
              f"{chunk.usage.completion_tokens} completion tokens]")
