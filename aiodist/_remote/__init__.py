"""Master-worker mode: rank 0 drives tensors that live on the other ranks (``aiodist.remote``).

``orders`` is what the master tells a worker, ``worker`` carries it out,
``master`` keeps the master's side (its remote tensors, streams and events).
"""
