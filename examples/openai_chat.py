"""Chat with a swarmd node through the official openai client.

make run                      # in one terminal
.venv/bin/python examples/openai_chat.py "Why is the sky blue?"
"""

from __future__ import annotations

import sys

import openai

BASE_URL = "http://127.0.0.1:8800/v1"


def main() -> None:
    prompt = " ".join(sys.argv[1:]) or "Say hello in one sentence."
    client = openai.OpenAI(base_url=BASE_URL, api_key="not-needed-yet")
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        temperature=0.7,
        max_tokens=200,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage is not None:
            swarm = (chunk.model_extra or {}).get("swarm", {})
            print(f"\n[{chunk.usage.completion_tokens} tokens, route {swarm.get('route')}]")


if __name__ == "__main__":
    main()
