"""kiln's HTTP gateway (`kiln api`): a stateless client of the queue over the same Redis, built
on api_client (never torch), so any number of replicas can run behind a proxy.

The extra `kiln-render[api]` (FastAPI, uvicorn) is loaded by `kiln api` only: `import
api_client` and `kiln --help` never import it (tests/test_client_import.py). This package's
__init__ imports nothing; tokens.py and settings.py need only redis and the standard library, so
`kiln api token` runs without the web framework too.

    settings.py   KILN_API_* settings, read once
    tokens.py     API tokens, kept hashed in Redis; who owns which job
    guard.py      the ASGI layer before any route: Host, Origin and body size
    auth.py       the one dependency every private route hangs under
    hub.py        one Redis reader fanning job events out to every SSE watcher
    views.py      the wire shapes the gateway adds to api_client's models (job, upload, problem)
    routes.py     /v1: models, jobs, events, images, uploads, workers, queues
    app.py        builds the app: public routes, the private router, /docs, the page
    serve.py      `kiln api`: first token, uvicorn
"""
