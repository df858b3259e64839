"""Split mode over HTTP: the reference/data server, its client, rollout workers and the consuming trainer.

    server.py    ``nanogrpo serve``: settings, state (reference model, counters), uvicorn set-up, CLI
    routes.py    the HTTP endpoints: validate everything, then change state
    queue.py     the batch queue: leases, acknowledgements, re-delivery under the same id
    weights.py   the weight relay: full checks of published weights, bounded version steps
    limits.py    connection guard (idle deadline, per-client and total caps) and request caps
    client.py    ``ServerClient``: every call has a timeout; retries with backoff while the server is away
    worker.py    ``nanogrpo rollout``: sample -> Collector.collect -> upload; follows published weights
    feed.py      ``nanogrpo train --server``: the training loop's source (get, check staleness) and
                 publisher (every K optimizer steps), 1 or N ranks
    inbox.py     the trainer's durable inbox: exactly-once hand-off, replay after a resume
    auth.py      the shared token (environment or file, never the command line)
"""
