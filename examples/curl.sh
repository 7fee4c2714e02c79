#!/usr/bin/env bash
# Talk to a swarmd node with curl. Start one first: make run
set -euo pipefail
URL=${SWARMD_URL:-http://127.0.0.1:8800}

curl -s "$URL/health"; echo
curl -s "$URL/v1/models"; echo

# A whole reply; -i shows the x-swarm-* headers and server-timing.
curl -si "$URL/v1/chat/completions" -H 'Content-Type: application/json' -d '{
  "model": "smollm2-135m-instruct",
  "messages": [{"role": "user", "content": "What is the capital of France?"}],
  "temperature": 0, "max_tokens": 32
}'; echo

# A streamed reply (Server-Sent Events), with the usage chunk at the end.
curl -sN "$URL/v1/chat/completions" -H 'Content-Type: application/json' -d '{
  "model": "smollm2-135m-instruct",
  "messages": [{"role": "user", "content": "Count to five."}],
  "temperature": 0, "max_tokens": 32,
  "stream": true, "stream_options": {"include_usage": true}
}'
