"""`selfspec serve`: an OpenAI-compatible HTTP server that decodes self-speculatively.

    selfspec serve runs/demo/model --port 8000 --api-key "$KEY"
    # any OpenAI client: base_url="http://127.0.0.1:8000/v1"

- `protocol.py`: the request bodies (pydantic) and OpenAI-shaped errors;
- `options.py`: the server's options (`AppOptions`, `ServeOptions`), readable without the extra;
- `scheduler.py`: one decode loop shared by every request; requests are batched into waves;
- `prometheus.py`: the Prometheus metrics of `/metrics`;
- `app.py`: the FastAPI application (`create_app`) and the command (`serve`).

Needs the optional extra `selfspec[serve]` (FastAPI, uvicorn, prometheus-client).
"""
