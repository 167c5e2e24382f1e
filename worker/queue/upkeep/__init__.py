"""A worker's upkeep: what runs by the clock or out of band, beside the job it holds (the job's
path is worker/queue/ itself). pulse: the side thread's beats and the watch on Redis; sweep: jobs
whose lease lapsed, put back; repair and keytypes: keys a client retyped, moved aside; quarantine:
records no worker can read; publisher: the worker's state and each job's record; webhooks: the
outbox and its senders; metrics: Prometheus; backlog: what waits, by model and lane."""
