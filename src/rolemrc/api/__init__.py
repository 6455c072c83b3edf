"""One client for OpenAI-compatible servers (judge, synthesis) and the answer cache they share.

``ApiClient`` (``client.py``): concurrency limit, retries with backoff + jitter honouring
``Retry-After`` (also on malformed 200s and content the caller's check rejects), a request
budget, counts of every fault kind, the key from the environment only. ``AnswerCache``
(``cache.py``): SQLite, valid answers only, checked again on every read.
"""

from rolemrc.api.cache import AnswerCache, request_key
from rolemrc.api.client import (
    FAULT_KINDS,
    ApiClient,
    Budget,
    BudgetExhausted,
    Fault,
    MissingApiKey,
    Outcome,
    Rejected,
    api_key,
    fault_summary,
)

__all__ = [
    "FAULT_KINDS", "AnswerCache", "ApiClient", "Budget", "BudgetExhausted", "Fault", "MissingApiKey", "Outcome",
    "Rejected", "api_key", "fault_summary", "request_key",
]
