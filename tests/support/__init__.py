"""What tests share, one module per thing it owns: deployments (a real worker process a module's
tests share), receivers (webhook receivers and a sender for them), servers (a local server in a
thread), backends (a client-only process), images (PNG bytes in, pixels and details out),
records (rq job records written straight into Redis, a timings log's lines), jobs (where a
watched job is) and fleet (a live worker's published state)."""
