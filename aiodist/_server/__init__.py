"""The rendezvous server: a sans-IO job table (``state``) and its asyncio shell (``serve``)."""
