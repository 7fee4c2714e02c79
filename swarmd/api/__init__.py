"""The OpenAI-compatible HTTP API (aiohttp).

- `app.py`          `create_app`, middlewares, `/health`, `/v1/models`, the chat page at `/`
- `completions.py`  `/v1/chat/completions`, `/v1/completions` (SSE streaming or not)
- `choices.py`      the `n` choices of a request: run at once, the prompt prefilled once
- `logprobs.py`     `LogprobsWriter`: logprobs in the chat and legacy shapes
- `schemas.py`      pydantic request models; every unsupported parameter refused by name
- `errors.py`       the exception tree -> HTTP status table, OpenAI's error shape
- `metrics.py`      `NodeMetrics`: the Prometheus metrics of `/metrics`
- `diagnostics.py`  `build_report`: the plain-text report of `/api/admin/diagnostics`
- `redact.py`       `Redactor`: salted per-report tags for IPs and host names in the report
"""
