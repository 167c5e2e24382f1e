"""What tests share, one module per thing it owns: deployments (a real worker process a module's
tests share), inprocess (a renderer and a worker in the test's own process), receivers (webhook
receivers and a sender for them), servers (a local server in a thread), backends (a client-only
process), images (PNG bytes in, pixels and details out), records (rq jobs written straight into
Redis, a timings log's records and lines), jobs (where a watched job is) and fleet (a live
worker's published state)."""
