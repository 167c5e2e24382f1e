"""Priority lanes: the order in which a worker pops its queues. Each model has two queues,
kiln:<model id> for interactive jobs (someone is waiting) and kiln:<model id>:batch for batch.

The rule, per worker:

- interactive lanes go before batch lanes: a model's interactive job, however late it came, is
  taken before any of its queued batch jobs;
- within a lane, models take turns (round robin): a busy model does not starve the others;
- batch is never starved: after BATCH_EVERY - 1 interactive jobs in a row, the batch lanes are
  looked at first. So while batch jobs wait, at least one job in every BATCH_EVERY that a worker
  takes is a batch job, however many interactive jobs keep coming.

KilnWorker.reorder_queues (worker/queue/worker.py) asks LaneOrder for the next order after each pop;
RQ's dequeue then pops the first queue in it that holds a job (one BLPOP over all of them).
The same order says which model's job comes next, which the prefetcher reads ahead
(worker/pipelines/prefetch.py).
"""

from __future__ import annotations

from rq import Queue

from api_client import keys

BATCH_EVERY = 4  # at least one batch job in every 4 a worker takes while batch jobs wait


class LaneOrder:
    """The order of a worker's queues for its next pop, from the lane of each job it took."""

    def __init__(self, queues: list[Queue]) -> None:
        self.interactive = [q for q in queues if keys.lane_of(q.name) == "interactive"]
        self.batch = [q for q in queues if keys.lane_of(q.name) == "batch"]
        # Interactive jobs taken since the last batch one.
        self.interactive_in_a_row = 0

    def order(self) -> list[Queue]:
        if self.batch and self.interactive_in_a_row >= BATCH_EVERY - 1:
            return [*self.batch, *self.interactive]
        return [*self.interactive, *self.batch]

    def upcoming_model(self) -> str | None:
        """The model of the job the next pop would take: the first queue, in the next pop's
        order, that holds a job (one round trip of LLENs). None when all are empty, and without
        asking Redis when every queue is one model's (worker.pipelines.prefetch reads no other
        model)."""
        queues = self.order()
        if len({keys.model_of(q.name) for q in queues}) < 2:
            return None
        with queues[0].connection.pipeline(transaction=False) as pipe:
            for queue in queues:
                pipe.llen(queue.key)
            lengths = pipe.execute()
        holding = [q for q, n in zip(queues, lengths, strict=True) if n]
        return keys.model_of(holding[0].name) if holding else None

    def after(self, taken: Queue) -> list[Queue]:
        """The order once a job was taken from taken: its lane's turn passes to the next
        model, and the count of interactive jobs in a row goes on or starts again."""
        batch = keys.lane_of(taken.name) == "batch"
        lane = self.batch if batch else self.interactive
        if taken in lane:
            at = lane.index(taken)
            lane[:] = lane[at + 1 :] + lane[: at + 1]
        self.interactive_in_a_row = 0 if batch else self.interactive_in_a_row + 1
        return self.order()


def worker_queues(models: list[str]) -> list[str]:
    """The queues a worker of these models listens to: every interactive lane, then every
    batch lane (the order of its first pop)."""
    return [keys.queue_name(m, lane) for lane in keys.LANES for m in models]
