"""``python -m classify.serve``: the classifier behind an HTTP API and a web page.

    limits.py     the flags that batch and bound requests
    microbatch.py the worker thread that owns the model and batches concurrent requests
    service.py    the loaded run: predict, explain, describe (through ``classify.inference``)
    schemas.py    request and response bodies (pydantic; the OpenAPI page at /docs)
    errors.py     JSON errors for everything that goes wrong, and the request-body limit
    auth.py       the optional API key on /v1/* (--api-key, $CLASSIFY_API_KEY)
    metrics.py    GET /metrics (Prometheus): requests, errors, latency, queue depth, batch sizes, rejections
    app.py        the FastAPI application: routes, middleware, X-Model-Version, the worker's life cycle
    page.html     the web page at / (self-contained: no CDN, works on a closed network)
    workers.py    --workers N: several server processes on one port (uvicorn's supervisor)
    __main__.py   the command: load the run, then uvicorn

Needs the ``serve`` extra: ``pip install -e ".[serve]"``.
"""
