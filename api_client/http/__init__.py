"""kiln's HTTP gateway (`kiln api`): a stateless client of the queue over the same Redis, built
on api_client (never torch), so any number of replicas can run behind a proxy.

The extra `kiln-render[api]` (FastAPI, uvicorn) is loaded by `kiln api` only: `import
api_client` and `kiln --help` never import it (tests/test_client_import.py). This package's
__init__ imports nothing; tokens.py and settings.py need only redis and the standard library, so
`kiln api token` runs without the web framework too.

    settings.py   KILN_API_* settings, read once
    tokens.py     API tokens, kept hashed in Redis; who owns which job
    sessions.py   the page's session cookie (never the token)
    guard.py      the ASGI layer before any route: Host, Origin and body size
    body.py       JSON bodies bounded before anything parses them; asgi.py what both layers share
    auth.py       the one dependency every private route hangs under
    tenancy.py    what a tenant may send (its own inputs) and is shown (no store paths)
    quotas.py     per-tenant limits: jobs queued or running, upload bytes
    hub.py        one Redis reader fanning job events out to every SSE watcher
    views.py      the wire shapes the gateway adds to api_client's models (job, upload, problem)
    routes.py     /v1: models, jobs, events, images, videos, uploads, workers, queues
    files.py      a finished job's images and videos as routes serve them; a video's byte ranges
    options.py    OPTIONS on any path
    dialect.py    what the compatible APIs share: refusals, submit, the served check, images
    held.py       a dialect's call held open until its job ends, without a thread per call
    openai.py     OpenAI's Images API under /openai/v1
    a1111/        AUTOMATIC1111's API under /sdapi/v1: fields (its bodies read), answers, routes
    app.py        builds the app: public routes, the private router, /docs, the page
    serve.py      `kiln api`: first token, uvicorn
"""
