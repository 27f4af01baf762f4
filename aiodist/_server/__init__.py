"""The rendezvous server: a sans-IO job table (``state``, ``store``), its shell (``serve``)."""
