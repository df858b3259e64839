"""``judge:URL``: an LLM judge behind the reward interface (:class:`nanogrpo.rewards.Judge`).

- :mod:`~nanogrpo.rewards.judges.judge`: the judge itself, an OpenAI-compatible chat-completions client
  (concurrency, retries, a deadline per batch, the API key from the environment);
- :mod:`~nanogrpo.rewards.judges.templates`: its prompt templates and how a reply becomes a score;
- :mod:`~nanogrpo.rewards.judges.reply_cache`: replies cached by request, so none is paid for twice.

Importing this package loads none of them.
"""
