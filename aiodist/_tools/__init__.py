"""Development tools that write or check parts of the package (``gen_sync``)."""
