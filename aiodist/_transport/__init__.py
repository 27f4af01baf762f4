"""Layer ``_transport``: moving bytes between two processes.

Owns the transport interface (``base``: ``DataChannel``, ``Listener``), the
``asyncio.BufferedProtocol`` glue that feeds ``_wire`` and reads payloads
straight into the caller's memory (``stream``), what a listener's connections
may cost before their handshake (``admission``), and one module per transport:
TCP (``tcp``), Unix sockets (``uds``), shared memory (``shm`` segments and the
``shmring`` transport, its frames checked sans-IO in ``ringwire``), and the
transports by name, built-in and registered by users (``registry``). A new
built-in transport is a new module here; a user's is registered.

May import: ``_errors``, ``_wire``.
"""
