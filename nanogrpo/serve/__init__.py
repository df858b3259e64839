"""Split mode over HTTP: the reference/data server, its client, rollout workers and the consuming trainer.

    server.py    ``nanogrpo serve``: validates uploads, adds reference log-probs, queues, relays weights
    client.py    ``ServerClient``: every call has a timeout; retries with backoff while the server is away
    worker.py    ``nanogrpo rollout``: sample -> rollout() -> upload; picks up published weights
    consumer.py  ``nanogrpo train --server``: get -> policy_update -> publish weights every K steps
    auth.py      the shared token (environment or file, never the command line)
"""
